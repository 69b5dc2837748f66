"""Same-device copies: one span of bytes never goes through the host (the runtime's
``copy_d2d``, in C where it gives one), a vendor kernel set may take over ``copy_``, and a
declaration torchport ignores says so; a backend module that cannot be imported is named
with the fix."""

import pytest
import torch

import torchport
from torchport.ops import Decline, KernelSet, native_hostops

pytestmark = pytest.mark.modes


@pytest.fixture
def copies(monkeypatch):
    """Counts the sim runtime's copies."""
    rt = torchport.sim.runtime
    counts = {"copy_h2d": 0, "copy_d2h": 0, "copy_d2d": 0}
    for name in counts:
        orig = getattr(rt, name)

        def counted(*a, _n=name, _o=orig, **k):
            counts[_n] += 1
            return _o(*a, **k)
        monkeypatch.setattr(rt, name, counted)
    return counts


def test_a_same_device_copy_of_plain_bytes_is_one_runtime_copy(copies):
    x = torch.randn(64, 33)
    a, b = x.to("sim"), torch.empty(64, 33, device="sim")
    for k in copies:
        copies[k] = 0
    served = native_hostops.counts()[0]
    b.copy_(a)
    a.copy_(a)  # the same elements: nothing to copy
    rt = torchport.sim.runtime
    if rt.host_addressable:  # the host's views of the device memory
        assert copies == {"copy_h2d": 0, "copy_d2h": 0, "copy_d2d": 0}
    elif getattr(rt.native_copies(), "copy_d2d", 0):  # its copy within the device in C,
        # called by C++ (tests/test_native_fallback.py counts that one call)
        assert copies == {"copy_h2d": 0, "copy_d2h": 0, "copy_d2d": 0}
        assert native_hostops.counts()[0] - served == 2
    else:  # device-only memory: a copy on the device, in stream order
        assert copies == {"copy_h2d": 0, "copy_d2h": 0, "copy_d2d": 1}
    assert torch.equal(b.cpu(), x)


def test_a_vendor_copy_kernel_is_offered_same_device_copies():
    seen = []
    ks = KernelSet("copies")

    @ks.kernel("copy_")
    def copy_(dst, src, non_blocking=False):
        seen.append((dst.dtype, src.dtype, dst.device == src.device))
        raise Decline("the core copy does it")

    @ks.kernel("_to_copy")
    def to_copy(self, *, dtype=None, **kwargs):
        seen.append(("_to_copy", dtype))
        raise Decline("the core kernel does it")

    backend = torchport.sim.BACKEND
    try:
        assert {"copy_", "_to_copy"} <= set(backend.add_kernels(ks))
        x = torch.randn(5, 6)
        d = x.to("sim")
        del seen[:]
        h = d.to(torch.float16)                                       # _to_copy, then copy_
        e = torch.empty(6, 5, device="sim").copy_(d.t())              # a strided copy
        assert seen == [("_to_copy", torch.float16), (torch.float16, torch.float32, True),
                        (torch.float32, torch.float32, True)]
        del seen[:]
        host = d.to("cpu")  # a copy to the host: the vendor's _to_copy is asked, copy_ is not
        assert seen == [("_to_copy", torch.float32)]
        assert torch.equal(h.cpu(), x.half()) and torch.equal(e.cpu(), x.t())
        assert torch.equal(host, x)
    finally:
        backend.remove_kernels(ks)


def test_an_ignored_declaration_warns():
    ks = KernelSet("late")
    ks.kernel("set_.source_Tensor")(lambda *a, **k: None)  # torchport's own
    ks.kernel("add.Tensor")(lambda *a, **k: None)     # the sim's kernel came first
    backend = torchport.sim.BACKEND
    try:
        with pytest.warns(UserWarning) as caught:
            assert backend.add_kernels(ks) == []
        text = " | ".join(str(w.message) for w in caught)
        assert "'set_.source_Tensor' is ignored" in text and "'add.Tensor' is ignored" in text
    finally:
        backend.remove_kernels(ks)


def test_a_backend_that_cannot_be_imported_is_named_with_the_fix():
    import typer

    from torchport.tools.run import load_backend

    with pytest.raises(typer.BadParameter, match=r"-b examples\.walk\.backend \(importable"):
        load_backend("examples/walk/backend.py")
    with pytest.raises(typer.BadParameter, match="no module nosuch.backend can be imported from"):
        load_backend("nosuch.backend")
