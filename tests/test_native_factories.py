"""``empty.memory_format`` / ``empty_strided`` in C++ (native_factories.cpp) and
``UntypedStorage.resize_`` through the C++ hooks: the Python kernels' results and errors,
switched like the view kernels. The C++-only tests skip where the library does not serve."""

from __future__ import annotations

import functools
import gc
import itertools

import pytest
import torch

import torchport.sim  # noqa: F401
from tests.helpers import check_python, child_env, privateuse1_registrations
from torchport.backend import active_backend
from torchport.memory import allocator, tensors
from torchport.ops import fallback, native_factories, stats

pytestmark = pytest.mark.modes

_B = active_backend()
_K = native_factories.SERVING[0]
needs_cpp = pytest.mark.skipif(not _K.native, reason="the C++ empty kernels do not serve "
                               "(TORCHPORT_NATIVE=0, no compiler or no Python headers)")
_PU1 = torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1)
_EMPTY = torch.ops.aten.empty.memory_format
_STRIDED = torch.ops.aten.empty_strided.default


class python_kernels:
    """Within: the Python kernels serve (as while a recorder runs)."""

    def __enter__(self) -> None:
        _K.use(False)

    def __exit__(self, *exc: object) -> None:
        _K.use(not fallback.SLOW)


def _layout(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.stride(), t.dtype, t.device, t.storage_offset(),
            t.untyped_storage().nbytes(), t.is_contiguous(),
            t.is_contiguous(memory_format=torch.channels_last) if t.dim() == 4 else None)


def _outcome(fn) -> tuple:
    try:
        return ("ok", _layout(fn()))
    except Exception as e:  # noqa: BLE001 (the exception is the result compared)
        return (type(e), str(e))


_SIZES = [[], [0], [5], [2, 3], [3, 0, 2], [2, 3, 4, 5], [1, 0, 4, 4], [2, 3, 1, 1],
          [2, 3, 4, 5, 6], [2, 0, 2, 2, 2], [7, 1, 1, 9]]
_FORMATS = [None, torch.contiguous_format, torch.channels_last, torch.channels_last_3d,
            torch.preserve_format]
_DTYPES = [None, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool,
           torch.complex64, torch.uint8, torch.float8_e4m3fn, torch.uint16]
_DEVICES = ["sim", "sim:0", "sim:1"]


@needs_cpp
@pytest.mark.parametrize("current", [0, 1])
def test_empty_equals_the_python_kernel(current: int) -> None:
    torch.sim.set_device(current)
    try:
        for size, fmt, dtype, device in itertools.product(_SIZES, _FORMATS, _DTYPES, _DEVICES):
            kw = {"dtype": dtype, "device": device, "memory_format": fmt}
            call = functools.partial(torch.empty, size, **kw)
            native = _outcome(call)
            with python_kernels():
                python = _outcome(call)
            assert native == python, (size, kw)
            if native[0] == "ok":
                want = torch.device("sim", current) if device == "sim" else torch.device(device)
                assert native[1][3] == want
    finally:
        torch.sim.set_device(0)


@needs_cpp
def test_empty_strided_equals_the_python_kernel() -> None:
    layouts = [([], []), ([0], [1]), ([4], [2]), ([2, 3], [1, 2]), ([2, 3], [0, 1]),
               ([3, 4], [5, 1]), ([2, 0], [7, 7]), ([1, 4], [-3, 1]), ([2, 2, 2], [4, 1, 2])]
    torch.sim.set_device(1)
    try:
        for (size, stride), dtype, device in itertools.product(layouts, _DTYPES, _DEVICES):
            kw = {"dtype": dtype, "device": device}
            call = functools.partial(torch.empty_strided, size, stride, **kw)
            native = _outcome(call)
            with python_kernels():
                python = _outcome(call)
            assert native == python, (size, stride, kw)
            assert native[0] == "ok"
    finally:
        torch.sim.set_device(0)


def test_the_default_dtype_is_followed() -> None:
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert torch.empty(3, device="sim").dtype == torch.float64
        assert torch.empty_strided((2,), (1,), device="sim").dtype == torch.float64
    finally:
        torch.set_default_dtype(old)
    assert torch.empty(3, device="sim").dtype == old


# each: the overload and its arguments, reaching the device's kernel itself
_ERRORS = [
    (_EMPTY, ([-1],), {}),
    (_EMPTY, ([2, -3],), {}),
    (_EMPTY, ([2, 3],), {"memory_format": torch.channels_last}),
    (_EMPTY, ([2, 3, 4, 5],), {"memory_format": torch.channels_last_3d}),
    (_EMPTY, ([2**40, 2**40],), {}),
    (_EMPTY, ([2**31, 2**31, 4],), {"dtype": torch.float64}),
    (_EMPTY, ([2],), {"dtype": torch.qint8}),
    (_EMPTY, ([2],), {"dtype": torch.quint4x2}),
    (_EMPTY, ([2],), {"layout": torch.sparse_coo}),
    (_EMPTY, ([2],), {"device": torch.device("sim", 5)}),
    (_STRIDED, ([2, 3], [1]), {}),
    (_STRIDED, ([-2], [1]), {}),
    (_STRIDED, ([3, 2], [-1, 1]), {}),
    (_STRIDED, ([2**62, 4], [4, 1]), {}),
    (_STRIDED, ([2], [1]), {"dtype": torch.qint32}),
    (_STRIDED, ([2], [1]), {"layout": torch.sparse_csr}),
    (_STRIDED, ([2], [1]), {"device": torch.device("sim", 2)}),
]


@needs_cpp
@pytest.mark.parametrize("op,args,kwargs", _ERRORS)
def test_errors_are_the_python_kernels(op, args, kwargs) -> None:
    def call() -> torch.Tensor:
        return op.redispatch(_PU1, *args, **{"device": torch.device("sim", 0), **kwargs})

    native = _outcome(call)
    with python_kernels():
        python = _outcome(call)
    assert native[0] != "ok" and native == python


@needs_cpp
def test_errors_of_an_unsupported_dtype_are_the_python_kernels() -> None:
    rt = _B.runtime
    had = rt.__dict__.get("unsupported_dtypes")
    rt.unsupported_dtypes = frozenset({torch.float64})
    _K.use(True)  # the C++ side reads the refused dtypes as it is switched on
    try:
        native = _outcome(lambda: torch.empty(3, dtype=torch.float64, device="sim"))
        assert native[0] is TypeError and "does not support torch.float64" in native[1]
        with python_kernels():
            assert _outcome(lambda: torch.empty(3, dtype=torch.float64, device="sim")) == native
    finally:
        if had is None:
            del rt.unsupported_dtypes
        else:
            rt.unsupported_dtypes = had
        _K.use(not fallback.SLOW)


@needs_cpp
def test_out_of_memory_is_the_python_kernels() -> None:
    n = 10**12  # more than the device holds
    native = _outcome(lambda: torch.empty(n, dtype=torch.uint8, device="sim"))
    with python_kernels():
        python = _outcome(lambda: torch.empty(n, dtype=torch.uint8, device="sim"))
    assert native[0] is torch.OutOfMemoryError and native == python


def test_a_recorder_sees_empty_and_the_kernels_switch_back() -> None:
    was = _K.native
    with stats.record() as rec:
        assert not _K.native  # the Python kernels serve while recording
        torch.empty(2, 3, device="sim")
        torch.empty_strided((2,), (1,), device="sim")
        torch.zeros(4, device="sim")
    assert rec.ops["empty.memory_format"].calls >= 1
    assert rec.ops["empty_strided"].calls == 1
    assert _K.native == was
    with stats.record() as rec2:
        torch.empty(5, device="sim")
    assert rec2.ops["empty.memory_format"].calls == 1
    assert _K.native == was
    t = torch.empty(2, 2, device="sim").fill_(3)
    assert t.cpu().tolist() == [[3, 3], [3, 3]]


@needs_cpp
def test_the_cpp_kernels_are_registered_alone() -> None:
    for name in ("aten::empty.memory_format", "aten::empty_strided"):
        lines = privateuse1_registrations(name)
        assert len(lines) == 1 and "native_factories.cpp" in lines[0], lines
    with python_kernels():
        lines = privateuse1_registrations("aten::empty.memory_format")
        assert len(lines) == 1 and "native_factories.cpp" not in lines[0], lines


@needs_cpp
def test_the_cpp_kernel_allocates_on_the_current_stream() -> None:
    s = torch.sim.Stream(device="sim:1")
    with torch.sim.stream(s):
        t = torch.empty(1024, device="sim:1")
        with python_kernels():
            p = torch.empty(1024, device="sim:1")
    d = torch.empty(1024, device="sim:1")  # the default stream again
    streams = [_B.allocators[1].active[x.data_ptr()].stream for x in (t, p, d)]
    assert streams[0] == streams[1] and streams[0] != streams[2]
    del t, p, d


def test_without_the_library_the_python_kernels_serve() -> None:
    out = check_python("""
        import torch, torchport.sim
        from torchport.ops import native_factories
        k = native_factories.SERVING[0]
        t = torch.empty(2, 3, 4, 5, device="sim:1", memory_format=torch.channels_last)
        st = torch.arange(4., device="sim").untyped_storage()
        st.resize_(32)
        print(k.native, t.stride(), t.device,
              torch.UntypedStorage.resize_ is torch._C.StorageBase.resize_, st.nbytes())
    """, env=child_env(TORCHPORT_NATIVE="0"))
    assert out.split() == ["False", "(60,", "1,", "15,", "3)", "sim:1", "False", "32"]


# ---- UntypedStorage.resize_ ------------------------------------------------------------

def _allocated(index: int = 0) -> int:
    gc.collect()
    torch.sim.synchronize(index)
    return torch.sim.memory_allocated(index)


@pytest.mark.parametrize("index", [0, 1])
def test_resize_keeps_values_and_frees_memory(index: int) -> None:
    dev = f"sim:{index}"
    values = torch.arange(4096, dtype=torch.float32)
    x = values.to(dev) * 1
    view = x[10:20]
    st = x.untyped_storage()
    base = _allocated(index)
    st.resize_(4096 * 4 * 2)  # grow: the kept bytes survive, every tensor sees them
    assert st.nbytes() == 4096 * 8
    assert torch.equal(x.cpu(), values) and torch.equal(view.cpu(), values[10:20])
    assert _allocated(index) == base + 4096 * 4  # the old block went back
    st.resize_(1024 * 4)  # shrink
    assert _allocated(index) == base - 3072 * 4
    assert torch.equal(torch.empty(0, device=dev).set_(st, 0, (1024,), (1,)).cpu(),
                       values[:1024])
    st.resize_(0)  # FSDP2's free
    assert st.nbytes() == 0 and _allocated(index) == base - 4096 * 4
    st.resize_(16)
    assert st.nbytes() == 16 and _allocated(index) == base - 4096 * 4 + 512
    st.resize_(16)  # the same size: nothing changes
    assert _allocated(index) == base - 4096 * 4 + 512
    with pytest.raises(RuntimeError, match="size must be non-negative, got -1"):
        st.resize_(-1)
    del x, view, st
    assert _allocated(index) == base - 4096 * 4


def test_resize_of_a_storage_torch_made_on_another_device() -> None:
    torch.sim.set_device(1)
    try:
        st = torch.UntypedStorage(64, device="sim:0")
        st.copy_(torch.UntypedStorage.from_buffer(bytes(range(64)), dtype=torch.uint8))
        st.resize_(128)
        assert st.device == torch.device("sim", 0)
        assert bytes(st.cpu())[:64] == bytes(range(64))
    finally:
        torch.sim.set_device(0)


@pytest.mark.skipif(not isinstance(_B.allocators[0], allocator.NativeAllocator),
                    reason="the C++ caching allocator does not serve")
def test_resize_frees_the_block_of_a_storage_made_in_python() -> None:
    alloc = _B.allocators[0]
    base = _allocated()
    block = alloc.malloc(4096)
    t = tensors.wrap_block(_B.devices[0], alloc, block, 4096, torch.float32, [1024], [1])
    t.copy_(torch.arange(1024, dtype=torch.float32))
    assert _allocated() == base + 4096
    t.untyped_storage().resize_(8192)
    assert torch.equal(t.cpu(), torch.arange(1024, dtype=torch.float32))
    assert _allocated() == base + 8192  # the Python-made block left with the resize
    t.untyped_storage().resize_(0)
    assert _allocated() == base
    del t
    assert _allocated() == base  # and is not freed twice


@needs_cpp
def test_resize_is_pytorchs_own_method() -> None:
    assert torch.UntypedStorage.resize_ is torch._C.StorageBase.resize_
    cpu = torch.UntypedStorage(8)
    assert cpu.resize_(16).nbytes() == 16
