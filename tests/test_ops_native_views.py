"""View ops served by PyTorch's C++ view kernels, and by the Python ones when asked."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import python_views_serve, run_python
from torchport import ops
from torchport.backend import active_backend
from torchport.core import native
from torchport.ops import native_views

pytestmark = pytest.mark.skipif(native.load() is None,
                                reason=f"no C++ library here: {native.UNAVAILABLE or 'off'}")


def _privateuse1_kernel(name: str) -> str:
    table = torch._C._dispatch_dump_table(name).splitlines()
    return next(line for line in table if line.startswith("PrivateUse1:"))


def test_the_cpp_kernels_serve_every_op_they_name():
    assert active_backend().view_kernels.native
    assert native.load().torchport_native_views_enable() == len(native_views.OPS)
    for name in native_views.OPS:
        assert "native_views.cpp" in _privateuse1_kernel(f"aten::{name}"), name
    # the composite views run PyTorch's composite kernel, not a Python one
    assert "CompositeExplicitAutograd" in _privateuse1_kernel("aten::select.int")


def test_views_match_the_cpu_and_share_memory():
    c = torch.randn(4, 6, 2, dtype=torch.complex64)
    d = c.to("sim")
    cases = [lambda t: t.t() if t.dim() == 2 else t.permute(2, 0, 1), lambda t: t[1:3, ::2],
             lambda t: t.view(8, 6), lambda t: t.unfold(1, 2, 2), torch.view_as_real,
             lambda t: t.select(1, 3).unsqueeze(0).expand(3, 4, 2),
             lambda t: t.as_strided((3, 3), (2, 5), 1), lambda t: t.diagonal(0, 0, 1)]
    for f in cases:
        v, w = f(d), f(c)
        assert v.device == d.device and v.shape == w.shape and v.stride() == w.stride()
        assert v.storage_offset() == w.storage_offset()
        assert v.untyped_storage().data_ptr() == d.untyped_storage().data_ptr()
        assert torch.equal(v.cpu(), w)
    with pytest.raises(RuntimeError) as cpu_error:
        c.view(5, 5)
    with pytest.raises(RuntimeError) as error:
        d.view(5, 5)
    assert str(error.value) == str(cpu_error.value)


def test_python_kernels_serve_while_ops_are_recorded():
    views = active_backend().view_kernels
    x = torch.randn(4, 6, device="sim")
    with ops.record() as rec:
        assert not views.native
        assert "native_views.cpp" not in _privateuse1_kernel("aten::view")
        y = x.t()[1:3].reshape(8)
    assert views.native and "native_views.cpp" in _privateuse1_kernel("aten::view")
    assert {"slice.Tensor", "as_strided"} <= set(rec.ops)
    assert torch.equal(y.cpu(), x.cpu().t()[1:3].reshape(8))


def test_a_backends_own_view_kernel_is_never_overridden():
    r = run_python("import torch\n"
                   "from torchport import ops\n"
                   "from torchport.backend import Backend\n"
                   "from torchport.backends.sim import SimRuntime\n"
                   "calls = []\n"
                   "ks = ops.KernelSet('own-view')\n"
                   "@ks.kernel('view')\n"
                   "def view(x, size):\n"
                   "    calls.append(tuple(size))\n"
                   "    return torch.ops.aten.view.default.redispatch(\n"
                   "        torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), x, size)\n"
                   "b = Backend('npu', SimRuntime(), [ks]).register()\n"
                   "with ops.record():\n"
                   "    pass\n"
                   + python_views_serve("b", "npu") +
                   "assert calls == [(2, 3)], calls\n"
             "print('ok')", TORCHPORT_FALLBACK_WARN="0")
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr
    assert "Overriding a previously registered kernel" not in r.stderr
