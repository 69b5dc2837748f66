"""A vendor's out= kernels called from C++ (ops/native_vendor.py): the three overloads served
without a Python entry, the calls left to Python, and C kernels (torchport_kernel.h) given
the same arguments from C++ and through ctypes. CPU PyTorch is the oracle."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

import torchport
from tests.conftest import chip_view
from torchport import ops
from torchport.core import native
from torchport.ops import c_kernels, native_vendor

_B = torchport.sim.BACKEND
needs_cpp = pytest.mark.skipif(native.loaded() is None,
                               reason="the C++ library is not built here")


@pytest.fixture(scope="module")
def logaddexp_calls():
    """A vendor out= kernel of logaddexp (the sim has none), counting its calls, declining
    inputs with more than 6 dimensions."""
    calls: list[tuple] = []
    ks = ops.KernelSet("test-vendor-calls")

    @ks.out_kernel("logaddexp.out", dtypes=[torch.float32, torch.float64])
    def logaddexp_out(self, other, *, out):
        if out.dim() > 6:
            raise ops.Decline("more than 6 dimensions")
        calls.append((tuple(self.shape), tuple(other.shape), tuple(out.shape), out.stride()))
        views = chip_view(self), chip_view(other), chip_view(out)
        torchport.launch(out, lambda: torch.logaddexp(*views[:2], out=views[2]), "logaddexp")
        return out

    assert set(_B.add_kernels(ks)) == {"logaddexp.out", "logaddexp"}
    yield calls
    _B.remove_kernels(ks)


def _served() -> int:
    return native_vendor.counts()[0]


@needs_cpp
def test_functional_and_out_calls_are_served_from_cpp(logaddexp_calls):
    a, b = torch.randn(4, 1), torch.randn(1, 5)
    da, db = a.to("sim"), b.to("sim")
    torch.logaddexp(da, db)  # the layout's first call asks the planner
    out = torch.empty(4, 5, device="sim")
    torch.logaddexp(da, db, out=out)
    logaddexp_calls.clear()
    before = _served()
    r = torch.logaddexp(da, db)
    r2 = torch.logaddexp(da, db, out=out)
    assert _served() - before == 2 and len(logaddexp_calls) == 2
    assert r2 is out
    assert torch.equal(r.cpu(), torch.logaddexp(a, b)) and torch.equal(out.cpu(), r.cpu())
    c = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)  # the meta's strides
    dc = c.to("sim")
    for _ in range(2):
        r = torch.logaddexp(dc, dc)
    assert r.stride() == torch.logaddexp(c, c).stride() and torch.equal(r.cpu(), torch.logaddexp(c, c))


@needs_cpp
def test_calls_cpp_leaves_to_python_behave_as_before(logaddexp_calls):
    a = torch.randn(3, 4)
    d = a.to("sim")
    # an out= to resize: the CPU's warning and shape, every time
    for _ in range(2):
        out = torch.empty(2, device="sim")
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            torch.logaddexp(d, d, out=out)
        assert out.shape == (3, 4) and torch.equal(out.cpu(), torch.logaddexp(a, a))
        assert any("resized" in str(x.message) for x in w)
    # an out= that is an input, at the broadcast shape: fine, as on the CPU
    e = d.clone()
    torch.logaddexp(e, d, out=e)
    assert torch.equal(e.cpu(), torch.logaddexp(a, a))
    # an out= that is an input to resize: the CPU's error, nothing written
    small, big = torch.randn(4), torch.randn(3, 4)
    with pytest.raises(RuntimeError) as cpu_error:
        torch.logaddexp(big, small, out=small)
    ds = small.to("sim")
    with pytest.raises(RuntimeError) as error:
        torch.logaddexp(big.to("sim"), ds, out=ds)
    assert str(error.value) == str(cpu_error.value) and torch.equal(ds.cpu(), small)
    # a non-contiguous out=
    o = torch.empty(4, 3, device="sim").t()
    torch.logaddexp(d, d, out=o)
    assert torch.equal(o.cpu(), torch.logaddexp(a, a))
    # a dtype the kernel does not declare: its next path, also once the layout was planned
    h = a.half()
    for _ in range(2):
        r = torch.logaddexp(h.to("sim"), h.to("sim"))
        assert torch.equal(r.cpu(), torch.logaddexp(h, h))
    # declined by the kernel from C++: the next path
    x = torch.randn(1, 1, 1, 1, 1, 1, 2)
    dx = x.to("sim")
    torch.logaddexp(dx, dx)
    declined = native_vendor.counts()[2]
    r = torch.logaddexp(dx, dx)
    assert native_vendor.counts()[2] == declined + 1
    assert torch.equal(r.cpu(), torch.logaddexp(x, x))
    # a meta kernel's error, every time, in the CPU kernel's words
    with pytest.raises(RuntimeError) as cpu:
        torch.logaddexp(torch.randn(3), torch.randn(4))
    for _ in range(2):
        with pytest.raises(RuntimeError) as dev:
            torch.logaddexp(torch.randn(3, device="sim"), torch.randn(4, device="sim"))
        assert str(dev.value) == str(cpu.value)


@pytest.mark.parametrize("python", [False, True], ids=["cpp", "python"])
@pytest.mark.parametrize("form", ["functional", "out"])
def test_a_0dim_cpu_operand_of_a_device_checked_op_raises_cudas_error(logaddexp_calls, python,
                                                                      form):
    """``logaddexp``'s CUDA registration compares its tensors' devices (device_check
    ExactSame): a 0-dim CPU operand raises CUDA's device error before a vendor's kernel runs,
    as on an op without one (the kernel is never given a CPU tensor it did not ask for)."""
    x = torch.randn(4, device="sim")
    kw = {"out": torch.empty(4, device="sim")} if form == "out" else {}
    logaddexp_calls.clear()
    with contextlib.ExitStack() as stack:
        if python:
            stack.enter_context(native_vendor.python_only())
        for _ in range(2):
            with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
                torch.logaddexp(x, torch.tensor(1.0), **kw)
    assert logaddexp_calls == []


def test_a_plain_kernel_of_a_device_checked_op_gets_no_cpu_operand():
    """The same for a plain kernel (``kernel("logaddexp2")``): CUDA's error, not the call."""
    calls: list[int] = []
    ks = ops.KernelSet("test-vendor-plain")

    @ks.kernel("logaddexp2", dtypes=[torch.float32])
    def logaddexp2(self, other):
        calls.append(1)
        return torch.empty_like(self)

    _B.add_kernels(ks)
    try:
        x = torch.randn(4, device="sim")
        with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
            torch.logaddexp2(x, torch.tensor(1.0))
        assert calls == []
        torch.logaddexp2(x, x)
        assert calls == [1]
    finally:
        _B.remove_kernels(ks)


@needs_cpp
def test_intercepted_ops_take_the_python_kernels(logaddexp_calls):
    a = torch.randn(5).to("sim")
    torch.logaddexp(a, a)
    before = native_vendor.counts()
    with ops.record() as rec:
        r = torch.logaddexp(a, a)
    after = native_vendor.counts()
    assert after[0] == before[0] and after[1] == before[1] + 1
    assert rec.path_of("logaddexp") == "native"
    with native_vendor.python_only():
        torch.logaddexp(a, a)
    assert native_vendor.counts()[0] == after[0]
    torch.logaddexp(a, a)
    assert native_vendor.counts()[0] == after[0] + 1
    assert torch.equal(r.cpu(), torch.logaddexp(a.cpu(), a.cpu()))


# ---- a C kernel ------------------------------------------------------------------------

_C_SOURCE = r"""
#include <math.h>
#include <stdio.h>
#include <string.h>
#include "torchport_kernel.h"

static char described[4096];
static int fault;
void set_fault(int on) { fault = on; }
const char* describe(void) { return described; }

static void note(const TorchportCall* c) {
  size_t n = 0;
  n += snprintf(described + n, sizeof described - n, "abi=%d device=%d stream=%lld;", c->abi,
                c->device, (long long)c->stream);
  for (int i = 0; i < c->nargs; ++i) {
    const TorchportArg* a = &c->args[i];
    n += snprintf(described + n, sizeof described - n, "%s:%d", a->name, a->kind);
    if (a->kind == TORCHPORT_ARG_TENSOR) {
      const DLTensor* t = &a->tensor;
      n += snprintf(described + n, sizeof described - n, " dev=%d/%d dtype=%d/%d/%d nd=%d",
                    t->device.device_type, t->device.device_id, t->dtype.code, t->dtype.bits,
                    t->dtype.lanes, t->ndim);
      for (int d = 0; d < t->ndim; ++d)
        n += snprintf(described + n, sizeof described - n, " %lldx%lld",
                      (long long)t->shape[d], (long long)t->strides[d]);
    } else if (a->kind == TORCHPORT_ARG_INT || a->kind == TORCHPORT_ARG_BOOL) {
      n += snprintf(described + n, sizeof described - n, " %lld", (long long)a->i);
    } else if (a->kind == TORCHPORT_ARG_FLOAT) {
      n += snprintf(described + n, sizeof described - n, " %g", a->f[0]);
    }
    n += snprintf(described + n, sizeof described - n, ";");
  }
}

/* copysign.out(self, other, *, out): float32, broadcasting, any strides, up to 8 dims */
int copysign_out(const TorchportCall* c) {
  note(c);
  if (c->abi != TORCHPORT_KERNEL_ABI || c->nargs != 3) return TORCHPORT_ERROR;
  const DLTensor* x = &c->args[0].tensor;
  const DLTensor* y = &c->args[1].tensor;
  const DLTensor* o = &c->args[2].tensor;
  if (o->ndim > 8) return TORCHPORT_DECLINE;
  if (fault) {
    snprintf(c->error, c->error_size, "device fault injected on device %d", c->device);
    return TORCHPORT_ERROR;
  }
  long long n = 1, idx[8] = {0};
  for (int d = 0; d < o->ndim; ++d) n *= o->shape[d];
  for (long long k = 0; k < n; ++k) {
    long long r = k, ox = 0, oy = 0, oo = 0;
    for (int d = o->ndim - 1; d >= 0; --d) {
      idx[d] = r % o->shape[d];
      r /= o->shape[d];
    }
    for (int d = 0; d < o->ndim; ++d) {
      int dx = d - (o->ndim - x->ndim), dy = d - (o->ndim - y->ndim);
      if (dx >= 0 && x->shape[dx] != 1) ox += idx[d] * x->strides[dx];
      if (dy >= 0 && y->shape[dy] != 1) oy += idx[d] * y->strides[dy];
      oo += idx[d] * o->strides[d];
    }
    ((float*)o->data)[oo] = copysignf(((const float*)x->data)[ox], ((const float*)y->data)[oy]);
  }
  return TORCHPORT_OK;
}
"""


@pytest.fixture(scope="module")
def c_library(tmp_path_factory):
    """The C kernel above, compiled, declared for copysign.out (float32)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    if not _B.host_address_is_device_address or _B.runtime.asynchronous:
        pytest.skip("the test's C kernel computes on the host at the device address, now")
    d = tmp_path_factory.mktemp("ckernel")
    src = d / "copysign.c"
    src.write_text(_C_SOURCE)
    lib = d / "libcopysign.so"
    include = Path(torch.__file__).parent / "include"
    subprocess.run([cc, "-O1", "-shared", "-fPIC", f"-I{c_kernels.HEADER.parent}",
                    f"-I{include}", str(src), "-o", str(lib), "-lm"], check=True)
    so = ctypes.CDLL(str(lib))
    so.describe.restype = ctypes.c_char_p
    ks = ops.KernelSet("test-c-kernel")
    ks.c_out_kernel("copysign.out", so.copysign_out, dtypes=[torch.float32])
    assert set(_B.add_kernels(ks)) == {"copysign.out", "copysign.Tensor", "copysign_.Tensor"}
    yield so
    _B.remove_kernels(ks)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_c_kernel_computes_as_the_cpu_from_cpp_and_python(c_library):
    a = torch.randn(4, 1) * 3
    b = torch.randn(1, 5)
    b[0, 0] = -0.0
    da, db = a.to("sim"), b.to("sim")
    want = torch.copysign(a, b)
    seen = []
    for python in (False, True):
        with native_vendor.python_only() if python else _nothing():
            torch.copysign(da, db)
            before = _served() if native.loaded() else 0
            r = torch.copysign(da, db)
            assert torch.equal(r.cpu(), want)
            seen.append(c_library.describe().decode())
            out = torch.empty(4, 5, device="sim")
            assert torch.copysign(da, db, out=out) is out and torch.equal(out.cpu(), want)
            seen.append(c_library.describe().decode())
            e = torch.randn(4, 5) * 2
            de = e.to("sim")
            assert de.copysign_(db) is de and torch.equal(de.cpu(), torch.copysign(e, b))
            seen.append(c_library.describe().decode())
            if native.loaded() is not None:
                assert (_served() - before == 3) != python
    assert seen[:3] == seen[3:]  # the same arguments from C++ and through ctypes
    assert "self:1 dev=12/0 dtype=2/32/1 nd=2 4x1 1x1;" in seen[0]
    assert "out:1 dev=12/0 dtype=2/32/1 nd=2 5x1 1x1;" not in seen[0]  # out: 4x5 contiguous
    assert "out:1 dev=12/0 dtype=2/32/1 nd=2 4x5 5x1;" in seen[0]
    assert seen[0].startswith("abi=1 device=0 stream=0;")
    # strided and transposed inputs, a CPU scalar tensor (given as a kDLCPU tensor)
    s = torch.randn(6, 8)
    ds = s.to("sim")
    got = torch.copysign(ds[::2, 1::3].t(), torch.tensor(-1.0))
    assert torch.equal(got.cpu(), torch.copysign(s[::2, 1::3].t(), torch.tensor(-1.0)))
    assert "other:1 dev=1/0 dtype=2/32/1 nd=0;" in c_library.describe().decode()


def test_c_kernel_declines_errors_and_dtypes(c_library):
    x = torch.randn(1, 1, 1, 1, 1, 1, 1, 1, 1, 2)  # 9 dimensions: declined
    dx = x.to("sim")
    ndx = -dx
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU fallback's
        torch.copysign(dx, ndx)  # (a layout's first call asks the planner)
        declined = native_vendor.counts()[2]
        r = torch.copysign(dx, ndx)
        if native.loaded() is not None:
            assert native_vendor.counts()[2] == declined + 1  # declined from C++
        assert torch.equal(r.cpu(), torch.copysign(x, -x))
        with ops.record() as rec:  # through ctypes
            r = torch.copysign(dx, ndx)
    assert torch.equal(r.cpu(), torch.copysign(x, -x))
    assert rec.ops["copysign.Tensor"].declined == 1
    d64 = torch.randn(3, dtype=torch.float64)  # not declared: the next path
    assert torch.equal(torch.copysign(d64.to("sim"), -d64.to("sim")).cpu(),
                       torch.copysign(d64, -d64))
    a = torch.randn(3, 3)
    da = a.to("sim")
    c_library.set_fault(1)
    try:
        for python in (False, True):
            with native_vendor.python_only() if python else _nothing():
                for _ in range(2):
                    with pytest.raises(RuntimeError, match=r"^copysign.out: the vendor's C kernel "
                                       r"failed: device fault injected on device 0$"):
                        da.copysign_(-da.abs())
                    assert torch.equal(da.cpu(), a)  # nothing written
    finally:
        c_library.set_fault(0)


def test_c_kernel_gets_the_side_streams_handle(c_library):
    a = torch.randn(3).to("sim")
    s = torch.sim.Stream()
    with torch.sim.stream(s):
        for python in (False, True):
            with native_vendor.python_only() if python else _nothing():
                torch.copysign(a, a)
                assert f"stream={s.handle.handle_id};" in c_library.describe().decode()
    assert s.handle.handle_id != 0


def test_c_kernel_declarations_are_checked():
    ks = ops.KernelSet("test-c-bad")
    with pytest.raises(TypeError, match="expected a ctypes function"):
        ks.c_out_kernel("copysign.out", lambda c: 0)
    with pytest.raises(ValueError, match="argument 'generator' of type Generator"):
        c_kernels.CKernel(ops.declarations.CFunction(1), torch.ops.aten.bernoulli.out, _B)

