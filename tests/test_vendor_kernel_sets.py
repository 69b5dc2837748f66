"""Kernel sets added after registration (``Backend.add_kernels``) and withdrawn
(``Backend.remove_kernels``): the overloads they took go back to the paths they took before.
CPU PyTorch is the oracle."""

from __future__ import annotations

import pytest
import torch

import torchport
from tests.conftest import chip_view
from tests.helpers import privateuse1_registrations
from torchport import ops

pytestmark = pytest.mark.modes

_B = torchport.sim.BACKEND


def test_a_kernel_set_added_after_registration_is_withdrawn_whole():
    """``Backend.remove_kernels``: every overload a set added after registration took (an
    out= kernel served from C++ and its derived overload, the override of a core kernel, a
    view kernel, host-op kernels) takes the path it took before, with the CPU's results and
    the dispatcher's registrations as they were; the set can be added and withdrawn again."""
    calls: list[str] = []
    ks = ops.KernelSet("test-withdrawn")

    @ks.out_kernel("logaddexp.out", dtypes=[torch.float32])
    def logaddexp_out(self, other, *, out):
        calls.append("logaddexp")
        out.zero_()  # a wrong result: the test sees whether it still serves
        return out

    @ks.kernel("copy_")
    def copy_(dst, src, non_blocking=False):
        calls.append("copy_")
        raise ops.Decline("the core copy does it")

    @ks.kernel("unfold")
    def unfold(self, dimension, size, step):
        calls.append("unfold")
        raise ops.Decline("torchport's view kernel does it")

    hosted = ops.KernelSet("test-withdrawn-host")
    hosted.host_ops(["logaddexp2"], to_cpu=chip_view)

    a, b = torch.randn(4, 5), torch.randn(4, 5)
    da, db = a.to("sim"), b.to("sim")
    names = ("aten::logaddexp", "aten::logaddexp.out", "aten::logaddexp2", "aten::copy_",
             "aten::unfold")

    def state():
        calls.clear()
        with ops.record() as rec:
            r = torch.logaddexp(da, db), torch.logaddexp2(da, db)
            u = da.unfold(1, 2, 1)
            torch.empty(4, 5, device="sim").copy_(da)
        torch.testing.assert_close(r[0].cpu(), torch.logaddexp(a, b))  # (decomposed)
        torch.testing.assert_close(r[1].cpu(), torch.logaddexp2(a, b))
        assert torch.equal(u.cpu(), a.unfold(1, 2, 1))
        torch.logaddexp(da, db)  # and from C++, outside the recording
        return ({n: privateuse1_registrations(n) for n in names},
                {n: rec.path_of(n) for n in ("logaddexp.out", "logaddexp2")},
                _B.view_kernels.native, _B.host_op_kernels.native,
                set(ops.native_overloads()) & {"logaddexp", "logaddexp.out", "logaddexp2",
                                               "copy_", "unfold"})

    before = state()
    assert calls == [] and before[1]["logaddexp.out"] == "decomposed"
    for _ in range(2):
        assert set(_B.add_kernels(ks)) == {"logaddexp.out", "logaddexp", "copy_", "unfold"}
        assert set(_B.add_kernels(hosted)) == {"logaddexp2", "logaddexp2.out"}
        try:
            calls.clear()
            assert not torch.logaddexp(da, db).cpu().any()
            assert calls == ["logaddexp"]
            assert torch.equal(da.unfold(1, 2, 1).cpu(), a.unfold(1, 2, 1))
            torch.empty(4, 5, device="sim").copy_(da)
            assert calls[1:] == ["unfold", "copy_"]
            assert not _B.view_kernels.native  # the vendor's view kernel is asked
            with ops.record() as rec:
                torch.logaddexp2(da, db)
            assert rec.path_of("logaddexp2") == "native"
        finally:
            _B.remove_kernels(hosted)
            _B.remove_kernels(ks)
        assert state() == before and calls == []
    with pytest.raises(ValueError, match="add it with add_kernels first"):
        _B.remove_kernels(ks)
    with pytest.raises(ValueError, match="a set given at registration stays"):
        _B.remove_kernels(_B.kernel_sets[0])
