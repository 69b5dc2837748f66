"""The CPU fallback's warm calls in C++ (native_hostops.cpp's learnt fallback): once the
Python fallback has run an overload on the CPU (no decomposition, not forced), C++'s boxed
fallback serves its later calls with a host-op kernel, equal to the CPU bit for bit; forced
fallback, op statistics, tools intercepting ops and ``TORCHPORT_FALLBACK=0`` keep the Python
fallback; calls C++ does not serve are handed to it. On device-only memory (the strict sim)
the same fallback serves them through the runtime's copies (native_staged.cpp). The C++-only
tests skip where the library does not serve (the asynchronous sim, TORCHPORT_NATIVE=0)."""

from __future__ import annotations

import ctypes
import warnings
from typing import Any

import pytest
import torch

import torchport.sim  # noqa: F401
from tests.helpers import (
    CPP_HOST_OPS_IDLE,
    check_python,
    child_env,
    cpp_fallback_serves,
    cpp_host_ops_compute,
    python_host_kernels,
    runtime_frame,
    torchport_frames,
)
from torchport.backend import active_backend
from torchport.ops import fallback, native_hostops, stats
from torchport.runtime import NativeCopies

pytestmark = pytest.mark.modes

_B = active_backend()
_K = _B.host_op_kernels
_COMPUTES = cpp_host_ops_compute()
_SERVES = cpp_fallback_serves()
_STAGED = _SERVES and not _B.runtime.host_addressable  # through the runtime's copies
needs_cpp = pytest.mark.skipif(not _COMPUTES, reason=CPP_HOST_OPS_IDLE)
serves = pytest.mark.skipif(not _SERVES, reason=CPP_HOST_OPS_IDLE)


class calls:
    """Counts within: calls the C++ host-op kernels served and handed to Python, and calls
    C++'s fallback handed to the Python one."""

    def __enter__(self) -> calls:
        self._start = (*native_hostops.counts()[:2], native_hostops.fallback_counts()[1])
        return self

    def __exit__(self, *exc: object) -> None:
        end = (*native_hostops.counts()[:2], native_hostops.fallback_counts()[1])
        self.served, self.handed, self.to_python = (e - s for e, s in zip(end, self._start,
                                                                           strict=True))


def _x(seed: int = 0, shape: tuple[int, ...] = (8, 8)) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ops without a sim kernel or a decomposition into its kernels: the CPU fallback
_FALLBACK = [
    ("hypot", lambda a, b: torch.hypot(a, b)),
    ("hypot out", lambda a, b: torch.hypot(a, b, out=torch.empty_like(a))),
    ("hypot_", lambda a, b: a.clone().hypot_(b)),
    ("nextafter", lambda a, b: torch.nextafter(a, b)),
    ("igamma", lambda a, b: torch.igamma(a.abs(), b.abs())),
    ("special_i1e", lambda a, b: torch.special.i1e(a)),
    ("special_erfcx", lambda a, b: torch.special.erfcx(a)),
]


# the Python fallback's own functions (device-only memory: C++ calls only the runtime's)
_PYTHON_FALLBACK = {"make_fallback.<locals>.fallback", "next_path", "run_on_host",
                    "_run_on_host", "HostCall.run", "run_cpu"}


def _warm(fn: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fn(_x(5).to("sim"), _x(6).to("sim"))


@serves
@pytest.mark.parametrize("name,fn", _FALLBACK, ids=[n for n, _ in _FALLBACK])
def test_a_warm_fallback_call_is_served_in_cpp_as_the_cpu_computes(name, fn) -> None:
    _warm(fn)  # the first call: the Python fallback, which learns the path
    a, b = _x(1), _x(2)
    da, db = a.to("sim"), b.to("sim")
    with calls() as c, torchport_frames() as frames:
        got = fn(da, db)
    want = fn(a, b)
    assert got.device.type == "sim" and got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.cpu(), want)
    assert c.served >= 1 and c.handed == 0 and c.to_python == 0, (c.served, c.handed)
    if _STAGED:  # device-only memory: the runtime's copies; no Python fallback
        assert not [f for f in frames if f in _PYTHON_FALLBACK], frames
        copies = [f for f in frames if runtime_frame(f) and ".copy_" in f]
        if _K._native_copies is None:  # its Python copies
            assert copies, frames
        else:  # its C copies (the strict sim's): no Python but its malloc where it ran out
            assert not copies, frames
    else:
        assert frames == [], frames  # no Python of torchport's at all


_COPY = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32, ctypes.c_uint64,
                         ctypes.c_uint64, ctypes.c_uint64)


@serves
@pytest.mark.skipif(not _STAGED or _B.runtime.native_copies() is None,
                    reason="a runtime with C copies on device-only memory (the strict sim)")
def test_a_runtimes_c_copies_serve_warm_fallback_calls_and_hand_declined_ones_to_python(
        monkeypatch) -> None:
    """``Runtime.native_copies``: C++ calls them for a staged call's spans; a copy one
    declines (returns nonzero) is the runtime's Python method's."""
    rt = _B.runtime
    table = rt.native_copies()
    d2h_c, h2d_c = _COPY(table.copy_d2h), _COPY(table.copy_h2d)
    seen: list[str] = []
    declined: set[str] = set()

    @_COPY
    def d2h(context, index, dst, src, nbytes):  # noqa: ANN001, ANN202
        seen.append("c d2h")
        return 1 if "d2h" in declined else d2h_c(context, index, dst, src, nbytes)

    @_COPY
    def h2d(context, index, dst, src, nbytes):  # noqa: ANN001, ANN202
        seen.append("c h2d")
        return 1 if "h2d" in declined else h2d_c(context, index, dst, src, nbytes)

    def counted(name: str) -> Any:
        method = getattr(rt, name)

        def copy(*args: Any, **kwargs: Any) -> None:
            seen.append(f"python {name[5:]}")
            return method(*args, **kwargs)
        return copy

    def address(fn: Any) -> int:
        return ctypes.cast(fn, ctypes.c_void_p).value

    monkeypatch.setattr(rt, "copy_d2h", counted("copy_d2h"))
    monkeypatch.setattr(rt, "copy_h2d", counted("copy_h2d"))
    monkeypatch.setattr(rt, "native_copies", lambda: NativeCopies(
        address(d2h), address(h2d), table.context, keep=(d2h, h2d)))
    _K._staged = None
    try:
        assert _K.staged()
        _warm(lambda a, b: torch.hypot(a, b))
        a, b = _x(1), _x(2)
        da, db = a.to("sim"), b.to("sim")
        for declining in [set(), {"d2h"}, {"h2d"}]:
            declined.clear()
            declined.update(declining)
            seen.clear()
            with calls() as c:
                got = torch.hypot(da, db)
            assert c.served >= 1 and c.to_python == 0, (c.served, c.to_python)
            want = ["c d2h", "c d2h", "c h2d"]  # the two arguments, then the result
            for name in declining:
                want = [w for x in want for w in
                        ([x, f"python {name}"] if x == f"c {name}" else [x])]
            assert seen == want, (declining, seen)
            assert torch.equal(got.cpu(), torch.hypot(a, b))
    finally:
        monkeypatch.undo()
        _K._staged = None
        assert _K.staged()


@serves
@pytest.mark.skipif(not _STAGED or _B.runtime.native_copies() is None,
                    reason="a runtime with C copies on device-only memory (the strict sim)")
def test_a_copy_within_the_device_takes_the_runtimes_c_copy_d2d(monkeypatch) -> None:
    """``NativeCopies.copy_d2d``: a copy within the device of one span of bytes calls it
    from C++; one it declines, and every such copy of a runtime without it, is the Python
    kernel's (the runtime's ``copy_d2d`` method)."""
    rt = _B.runtime
    table = rt.native_copies()
    assert table.copy_d2d
    d2d_c = _COPY(table.copy_d2d)
    seen: list[str] = []
    declining = [False]

    @_COPY
    def d2d(context, index, dst, src, nbytes):  # noqa: ANN001, ANN202
        seen.append("c d2d")
        return 1 if declining[0] else d2d_c(context, index, dst, src, nbytes)

    method = rt.copy_d2d

    def counted(*args: Any, **kwargs: Any) -> None:
        seen.append("python d2d")
        return method(*args, **kwargs)

    def address(fn: Any) -> int:
        return ctypes.cast(fn, ctypes.c_void_p).value

    x = _x(5)
    src = x.to("sim")
    monkeypatch.setattr(rt, "copy_d2d", counted)
    try:
        for given, decline, want in [(d2d, False, ["c d2d"]),
                                     (d2d, True, ["c d2d", "python d2d"]),
                                     (None, False, ["python d2d"])]:
            monkeypatch.setattr(rt, "native_copies", lambda given=given: NativeCopies(
                table.copy_d2h, table.copy_h2d, table.context, keep=(table.keep, d2d),
                copy_d2d=0 if given is None else address(given)))
            _K._staged = None
            assert _K.staged()
            declining[0] = decline
            dst = torch.empty(8, 8, device="sim")
            seen.clear()
            with calls() as c:
                got = dst.copy_(src)
            assert got is dst and torch.equal(dst.cpu(), x) and seen == want, seen
            assert (c.served, c.handed) == ((1, 0) if want == ["c d2d"] else (0, 1))
    finally:
        monkeypatch.undo()
        _K._staged = None
        assert _K.staged()


@serves
@pytest.mark.skipif(not _STAGED, reason="device-only memory: the staged calls' host buffers")
@pytest.mark.parametrize("shape", [(8, 8), (700, 700)], ids=["tiny", "over-a-mebibyte"])
def test_warm_staged_calls_reuse_their_host_buffers(shape) -> None:
    """A warm call's host copies take the buffers the calls before it gave back (sizes up to
    a mebibyte), not new ones from the C library; its results stay the CPU's."""
    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # two spans read, one written
        return torch.hypot(a, b, out=torch.empty_like(a))

    a, b = _x(1, shape), _x(2, shape)
    da, db = a.to("sim"), b.to("sim")
    _warm(fn)
    fn(da, db)
    fresh, reused = native_hostops.staging_buffer_counts()
    for _ in range(20):
        got = fn(da, db)
    now_fresh, now_reused = native_hostops.staging_buffer_counts()
    if shape == (8, 8):
        assert now_fresh == fresh and now_reused - reused == 60, (fresh, now_fresh, reused,
                                                                  now_reused)
    else:  # larger than the kept sizes: each its own
        assert now_fresh - fresh == 60 and now_reused == reused
    assert torch.equal(got.cpu(), torch.hypot(a, b))


@serves
def test_the_learnt_path_keeps_forced_fallback_statistics_and_refusal() -> None:
    a, b = _x(1).to("sim"), _x(2).to("sim")
    _warm(lambda a, b: torch.hypot(a, b))
    with calls() as c:
        torch.hypot(a, b)
    assert c.served == 1 and c.to_python == 0
    # forced: the Python fallback runs it (and says so), C++ serves nothing
    old = fallback.set_force_fallback("hypot.*")
    try:
        with calls() as c, torchport_frames() as frames:
            got = torch.hypot(a, b)
        assert "run_cpu" in frames and c.served == 0
        assert torch.equal(got.cpu(), torch.hypot(a.cpu(), b.cpu()))
    finally:
        fallback.set_force_fallback(old)
    # recorded: every call in the statistics, on the fallback's path
    with stats.record() as rec, calls() as c:
        torch.hypot(a, b)
        torch.hypot(a, b)
    assert rec.ops["hypot.out"].calls == 2 and rec.path_of("hypot.out") == "fallback"
    assert c.served == 0
    # TORCHPORT_FALLBACK=0: refused, as on its first call
    old_enabled = fallback.set_fallback_enabled(False)
    try:
        with pytest.raises(NotImplementedError, match="TORCHPORT_FALLBACK=0"):
            torch.hypot(a, b)
    finally:
        fallback.set_fallback_enabled(old_enabled)
    # and learnt again afterwards: C++ serves
    torch.hypot(a, b)
    with calls() as c:
        torch.hypot(a, b)
    assert c.served == 1 and c.handed == 0 and c.to_python == 0


@serves
def test_a_tool_intercepting_ops_sees_the_learnt_calls() -> None:
    from torchport.ops import hooks

    a, b = _x(1).to("sim"), _x(2).to("sim")
    _warm(lambda a, b: torch.hypot(a, b))
    seen: list[tuple[str, str]] = []

    def note(call: Any, run: Any) -> Any:
        seen.append((call.name, call.path))
        return run()
    hooks.register(note)
    try:
        with calls() as c:
            torch.hypot(a, b)
    finally:
        hooks.unregister(note)
    assert ("hypot.out", "fallback") in seen and c.served == 0
    with calls() as c:
        torch.hypot(a, b)
    assert c.served == 1


@serves
@pytest.mark.parametrize("name,fn,error", [
    ("a CPU operand with dimensions",
     lambda a, b: torch.hypot(a, b.cpu()), RuntimeError),
    ("another device", lambda a, b: torch.hypot(a, b.to("sim:1")), RuntimeError),
    ("an out= on the CPU", lambda a, b: torch.hypot(a, b, out=torch.empty(8, 8)), RuntimeError),
    ("a conjugate view", lambda a, b: torch.nextafter(a, b.to(torch.complex64).conj().real),
     None),
    ("shapes that do not broadcast", lambda a, b: torch.hypot(a, b[:3, :5]), RuntimeError),
])
def test_calls_cpp_does_not_serve_are_the_python_fallbacks(name, fn, error) -> None:
    a, b = _x(1).to("sim"), _x(2).to("sim")
    _warm(lambda a, b: torch.hypot(a, b))
    _warm(lambda a, b: torch.nextafter(a, b))

    def outcome() -> tuple[Any, Any]:
        try:
            r = fn(a, b)
        except Exception as e:  # noqa: BLE001
            return type(e), str(e)
        return None, r.cpu()
    with calls() as c:
        native = outcome()
    with python_host_kernels():  # the Python fallback registered, as while intercepting
        python = outcome()
    assert native[0] is python[0] and (error is None or native[0] is not None)
    if native[0] is None:
        assert torch.equal(native[1], python[1])
    else:
        assert native[1] == python[1]
    # (the others raise above it; on device-only memory so does another device)
    if name == "an out= on the CPU" or (name == "another device" and not _STAGED):
        assert c.handed >= 1, (c.served, c.handed)


@needs_cpp
def test_the_device_fallback_is_cpps_while_cpp_serves_and_pythons_else() -> None:
    def registration() -> str:
        return next(line for line in
                    torch._C._dispatch_dump_table("aten::hypot.out").splitlines()
                    if line.startswith("PrivateUse1:"))
    assert "native_hostops.cpp" in registration()
    with python_host_kernels():
        assert "native_hostops.cpp" not in registration()
    with stats.record():
        assert "native_hostops.cpp" not in registration()
    assert "native_hostops.cpp" in registration()


def test_first_calls_warn_and_the_settings_hold_in_a_new_process() -> None:
    code = """
        import warnings, torch, torchport.sim
        from torchport.ops import native_hostops
        a, b = torch.randn(4, device="sim"), torch.randn(4, device="sim")
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            torch.hypot(a, b)
            before = native_hostops.counts()[0]
            r = torch.hypot(a, b)
            print(len(w), native_hostops.counts()[0] - before,
                  torch.equal(r.cpu(), torch.hypot(a.cpu(), b.cpu())))
    """
    out = check_python(code, env=child_env(TORCHPORT_FALLBACK_WARN="1")).split()
    served = "1" if _SERVES else "0"
    assert out == ["1", served, "True"], out
    out = check_python(code, env=child_env(TORCHPORT_FORCE_FALLBACK_OPS="hypot.*")).split()
    assert out == ["0", "0", "True"], out  # (forced ops do not warn)
    r = check_python("""
        import torch, torchport.sim
        a = torch.randn(4, device="sim")
        for _ in range(3):
            try:
                torch.hypot(a, a)
            except NotImplementedError as e:
                print("refused")
    """, env=child_env(TORCHPORT_FALLBACK="0"))
    assert r.split() == ["refused"] * 3


# ops keeping native_functions.yaml's ``device_check: ExactSame`` with a CUDA kernel: a
# 0-dim CPU operand raises CUDA's error, from the Python kernel or fallback
_EXACT_SAME = [
    ("logaddexp", lambda x: torch.logaddexp(x, torch.tensor(1.0))),
    ("clamp min", lambda x: torch.clamp(x, min=torch.tensor(0.0))),
    ("index_select", lambda x: x.index_select(0, torch.tensor(1))),
]

# ops TensorIterator serves with a 0-dim CPU operand (a CPU scalar), served in C++
_CPU_SCALARS = [
    ("mul", lambda x: x * torch.tensor(2.0)),
    ("add", lambda x: torch.tensor(2.5) + x),
    ("mul_", lambda x: x.clone().mul_(torch.tensor(0.5))),
    ("where", lambda x: torch.where(x > 0, x, torch.tensor(-1.0))),
    ("lerp weight", lambda x: torch.lerp(x, x.flip(0), torch.tensor(0.25))),
]


@pytest.mark.parametrize("name,fn", _EXACT_SAME, ids=[n for n, _ in _EXACT_SAME])
def test_a_0dim_cpu_operand_of_an_exactsame_op_raises_cudas_error(name, fn) -> None:
    x = _x(3).to("sim")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match="same device"):
            fn(x)
        with calls() as c, pytest.raises(RuntimeError, match="same device"):  # warm too
            fn(x)
    if _COMPUTES:  # C++ handed it to the Python kernel or fallback, which raised
        assert c.served == 0 and c.handed + c.to_python >= 1, (c.served, c.handed)


@needs_cpp
@pytest.mark.parametrize("name,fn", _CPU_SCALARS, ids=[n for n, _ in _CPU_SCALARS])
def test_a_0dim_cpu_operand_is_served_in_cpp(name, fn) -> None:
    x = _x(3)
    fn(x.to("sim"))
    with calls() as c:
        got = fn(x.to("sim"))
    assert torch.equal(got.cpu(), fn(x))
    assert c.served >= 1 and c.handed == 0, (c.served, c.handed)


@needs_cpp
def test_an_op_taken_out_of_the_warned_ones_warns_again() -> None:
    a = _x(1).to("sim")
    _warm(lambda a, b: torch.hypot(a, b))
    old = fallback.set_fallback_warn(True)
    try:
        fallback._WARNED.discard("hypot.out")
        with pytest.warns(fallback.FallbackWarning, match="hypot.out"):
            torch.hypot(a, a)
        with calls() as c:
            torch.hypot(a, a)
        assert c.served == 1 and c.to_python == 0
    finally:
        fallback.set_fallback_warn(old)


@pytest.mark.parametrize("out", [False, True], ids=["functional", "out"])
@pytest.mark.parametrize("left,adjoint", [(False, False), (False, True), (True, True)])
def test_a_lazy_bit_the_cpu_kernel_sets_is_stored_as_its_values(out, left, adjoint) -> None:
    # linalg_lu_solve (no sim kernel) with left=False conjugates its out= on the CPU
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 3, dtype=torch.complex64, generator=g)
    b = torch.randn(4, 3, dtype=torch.complex64, generator=g)
    if left:
        b = b.mT.contiguous()
    lu, piv = torch.linalg.lu_factor(a)

    def solve(*t: torch.Tensor) -> torch.Tensor:
        kw = {"out": torch.empty_like(t[2])} if out else {}
        return torch.linalg.lu_solve(*t, left=left, adjoint=adjoint, **kw)
    want = solve(lu, piv, b)
    dev = [t.to("sim") for t in (lu, piv, b)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        solve(*dev)
    with calls() as c:  # warm: C++ where it serves
        got = solve(*dev)
    assert torch.equal(got.cpu().resolve_conj(), want.resolve_conj())
    if _COMPUTES:
        assert c.served >= 1 and c.handed == 0 and c.to_python == 0, (c.served, c.handed)


# calls whose written bytes must be exactly the CPU's: strided in-place writes into a larger
# storage, out= into a slice, out= the CPU kernel resizes (from empty, and from a wrong size)
_WRITES = [
    ("in place, strided view", lambda d, a, b: d.__setitem__(0, 0) or d[:, ::2].hypot_(a[:, ::2])),
    ("in place, transposed", lambda d, a, b: d.t().nextafter_(b)),
    ("out= a slice", lambda d, a, b: torch.hypot(a[2:5], b[2:5], out=d[1:4])),
    ("out= strided", lambda d, a, b: torch.hypot(a[:, 1::2], b[:, ::2], out=d[:, ::2])),
    ("out= an input", lambda d, a, b: torch.hypot(d, b, out=d)),
    ("out= empty", lambda d, a, b: torch.hypot(a, b, out=d.new_empty(0))),
    ("out= resized", lambda d, a, b: torch.nextafter(a, b, out=d.new_empty(3, 2))),
    ("in place, an input twice", lambda d, a, b: d.hypot_(d)),
]


@serves
@pytest.mark.parametrize("name,fn", _WRITES, ids=[n for n, _ in _WRITES])
def test_a_warm_fallback_call_writes_what_the_cpu_writes(name, fn) -> None:
    """Every byte of the written storage, those between a view's elements and around it
    included, and the returned tensor's layout, as the CPU's (on device-only memory: the
    spans copied back are exactly the written tensors')."""
    def run(device: str) -> tuple[torch.Tensor, torch.Tensor]:
        d, a, b = (t.to(device) for t in (_x(3), _x(4), _x(5)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            r = fn(d, a, b)
        return d, r
    run("sim")  # learnt
    with calls() as c:
        d, r = run("sim")
    want_d, want_r = run("cpu")
    assert torch.equal(d.cpu(), want_d)
    assert (r.shape, r.stride(), r.storage_offset()) == \
        (want_r.shape, want_r.stride(), want_r.storage_offset())
    assert torch.equal(r.cpu(), want_r)
    assert c.served >= 1 and c.to_python == 0, (c.served, c.handed)


@serves
def test_a_fallback_call_on_a_side_stream_is_the_python_fallbacks() -> None:
    """(On device-only memory C++ orders its copies after the default stream only.)"""
    a, b = _x(1).to("sim"), _x(2).to("sim")
    _warm(lambda a, b: torch.hypot(a, b))
    s = torch.sim.Stream()
    s.wait_stream(torch.sim.current_stream())
    with torch.sim.stream(s), calls() as c:
        got = torch.hypot(a, b)
    torch.sim.current_stream().wait_stream(s)
    assert torch.equal(got.cpu(), torch.hypot(a.cpu(), b.cpu()))
    if _STAGED:
        assert c.served == 0 and c.handed >= 1


# Copies and Tensor.item on device-only memory (the core kernels C++ serves through the
# runtime's copies): (name, fn(x) -> result) with x a CPU tensor; the device's result must
# equal the CPU's bit for bit, and the host tensor a copy writes must be the one returned.
def _into_columns(x: torch.Tensor, dev: str) -> torch.Tensor:
    big = torch.arange(64.0).view(8, 8).to(dev)  # every other column written, the rest kept
    big[:, ::2].copy_(x[:, :4])
    return big


def _to_host_in_place(x: torch.Tensor, dev: str) -> torch.Tensor:
    dst = torch.full((8, 8), 7.0)
    got = dst.copy_(x.to(dev).t())
    assert got is dst
    return got


def _columns_within_a_storage(x: torch.Tensor, dev: str) -> torch.Tensor:
    d = x.to(dev)
    d[:, 1::2].copy_(d[:, ::2])  # source and destination spans overlap, their elements not
    return d


_STAGED_COPIES = [
    ("to device", lambda x, dev: x.to(dev)),
    ("to device as float64", lambda x, dev: x.to(dev, torch.float64)),
    ("int64 to device", lambda x, dev: (x * 100).long().to(dev)),
    ("to host", lambda x, dev: x.to(dev).cpu()),
    ("to host as float16", lambda x, dev: x.to(dev).to("cpu", torch.float16)),
    ("channels_last to device",
     lambda x, dev: x.view(1, 4, 4, 4).to(dev, memory_format=torch.channels_last)),
    ("strided view to host", lambda x, dev: x.to(dev).t()[::2].to("cpu", copy=True)),
    ("into strided columns", _into_columns),
    ("host destination", _to_host_in_place),
    ("0-dim to device", lambda x, dev: x[0, 0].to(dev)),
    ("broadcast", lambda x, dev: torch.empty(3, 8, 8, device=dev).copy_(x)),
    ("item float", lambda x, dev: x.to(dev)[2, 3].item()),
    ("item int", lambda x, dev: (x * 100).long().to(dev)[1, 1].item()),
    ("item bool", lambda x, dev: (x > 0).to(dev)[0, 0].item()),
    # within the device, not one span of bytes: through the host, as the Python kernel
    ("transposed within the device",
     lambda x, dev: torch.empty(8, 8, device=dev).copy_(x.to(dev).t())),
    ("cast within the device", lambda x, dev: x.to(dev).to(torch.float16)),
    ("channels_last within the device",
     lambda x, dev: torch.empty(1, 4, 4, 4, device=dev, memory_format=torch.channels_last)
     .copy_(x.view(1, 4, 4, 4).to(dev))),
    ("strided columns within one storage", _columns_within_a_storage),
    # within the device, one span of bytes: the runtime's copy_d2d in C (the strict sim's)
    ("contiguous within the device", lambda x, dev: torch.empty(8, 8, device=dev).copy_(
        x.to(dev))),
    ("rows within one storage", lambda x, dev: _within_a_storage(x.to(dev))),
]
_WITHIN_ONE_SPAN = {"contiguous within the device", "rows within one storage"}


@serves
@pytest.mark.skipif(not _STAGED, reason="device-only memory: copies through the runtime's")
@pytest.mark.parametrize("name,fn", _STAGED_COPIES, ids=[n for n, _ in _STAGED_COPIES])
def test_small_copies_and_items_on_device_only_memory_are_served_in_cpp(name, fn) -> None:
    if name in _WITHIN_ONE_SPAN and not getattr(_B.runtime.native_copies(), "copy_d2d", 0):
        pytest.skip("no copy_d2d in C (the asynchronous sim): its Python copy_d2d serves")
    x = _x(3)
    fn(x, "sim")  # (a first call may warm what it calls)
    with calls() as c, torchport_frames() as frames:
        got = fn(x, "sim")
    want = fn(x, "cpu")
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.stride() == want.stride(), (got.stride(), want.stride())
        assert torch.equal(got.cpu(), want)
    else:
        assert type(got) is type(want) and got == want
    assert c.served >= 1 and c.handed == 0 and c.to_python == 0, (c.served, c.handed)
    if not _B.runtime.asynchronous:  # no Python of torchport's but the runtime's own copies
        assert not [f for f in frames if not runtime_frame(f)], frames


def _within_a_storage(d: torch.Tensor) -> torch.Tensor:
    d = torch.empty_like(d).copy_(d)
    d[4:].copy_(d[:4])  # source and destination in one storage, one span of bytes each
    return d


@serves
@pytest.mark.skipif(not _STAGED, reason="device-only memory: copies through the runtime's")
def test_copies_cpp_leaves_to_python_behave_as_before() -> None:
    """A tensor over a MiB (copied once by the Python kernel rather than twice), a
    ``non_blocking`` copy (ordered on the stream by it), a copy while a side stream is
    current and a new tensor copied within the device take the Python kernels, with the
    same results."""
    x = _x(7)
    d = x.to("sim")
    for fn in (lambda t: t.to(torch.float32, copy=True),):  # (a new tensor: Python's)
        with calls() as c:
            got = fn(d)
        assert c.handed >= 1 and torch.equal(got.cpu(), fn(x))
    # elements of one storage that overlap, by a cast (C++'s) and as one span of bytes
    # (handed to Python): ATen's error, nothing written
    for fn in (lambda t: t.view(-1)[1:].copy_(t.view(torch.int32).view(-1)[:-1]),
               lambda t: t.view(-1)[1:].copy_(t.view(-1)[:-1])):
        with pytest.raises(RuntimeError) as cpu_error:
            fn(x.clone())
        with pytest.raises(RuntimeError) as dev_error:
            fn(d)
        assert str(dev_error.value) == str(cpu_error.value)
        assert torch.equal(d.cpu(), x)
    with warnings.catch_warnings():  # (PyTorch deprecates qint8's creation functions)
        warnings.simplefilter("ignore", UserWarning)
        q = torch.quantize_per_tensor(x, 0.05, 3, torch.qint8)  # (its own tensor type)
    with calls() as c:
        dq = q.to("sim")
    assert c.served == 0 and torch.equal(dq.cpu().int_repr(), q.int_repr())
    big = torch.randn(600, 600)
    for fn in (lambda: big.to("sim"), lambda: big.to("sim").cpu()):
        with calls() as c:
            got = fn()
        assert c.handed >= 1 and torch.equal(got.cpu(), big)
    small = _x(4)
    d = small.to("sim")
    with calls() as c:
        got = d.to("cpu", non_blocking=True)
        torch.sim.synchronize()
    assert c.handed >= 1 and torch.equal(got, small)
    s = torch.sim.Stream()
    s.wait_stream(torch.sim.current_stream())
    with torch.sim.stream(s), calls() as c:
        got = d.cpu()
        item = d[0, 0].item()
    assert c.served == 0 and c.handed >= 2
    assert torch.equal(got, small) and item == small[0, 0].item()
