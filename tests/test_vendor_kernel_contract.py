"""The kernel contract of docs/vendor-guide.md: a vendor's kernel gets tensors without
conjugate or negative bits unless it declares ``math_bits=True`` (an ``out=`` or in-place
argument carrying one is written through its bits), ``zero_`` reaches a declared ``fill_``
kernel, and a declared ``copy_`` kernel serves every same-device copy it takes (one span of
bytes too). Run on the discrete recipe (examples/discrete_recipe/) in a child interpreter
with kernels added that read device memory as it lies, bits ignored, as a kernel written
without the contract does; CPU PyTorch is the oracle."""

import subprocess
import sys

import pytest

from tests.helpers import ROOT, child_env

pytestmark = pytest.mark.vendor

CHILD = r'''
import torch
import torchport
import examples.discrete_recipe.backend as recipe
from torchport.ops import KernelSet, native_overloads, record

calls = {"fill_": 0, "vdot": []}
ks = KernelSet("bits-ignored")
KINDS = [torch.float32, torch.complex64]


@ks.out_kernel("mm.out", dtypes=KINDS)          # reads memory as it lies: no conj
def mm_out(self, mat2, *, out):
    return recipe._launch(out, torch.mm, self, mat2)


@ks.out_kernel("bmm.out", dtypes=KINDS)
def bmm_out(self, mat2, *, out):
    return recipe._launch(out, torch.bmm, self, mat2)


@ks.kernel("clone")                              # a raw copy of the bytes: no neg, no conj
def clone(self, memory_format=None):
    return recipe._launch(torch.empty_like(self), lambda s, out: out.copy_(s), self)


@ks.out_kernel("vdot.out", dtypes=KINDS, math_bits=True)   # declares it reads the bits
def vdot_out(self, other, *, out):
    bits = self.is_conj(), other.is_conj()
    calls["vdot"].append(bits)
    return recipe._launch(out, lambda a, b, out: torch.vdot(a.conj() if bits[0] else a,
                                                           b.conj() if bits[1] else b, out=out),
                          self, other)


@ks.kernel("fill_.Scalar")
def fill_(self, value):
    calls["fill_"] += 1
    return recipe._launch(self, lambda out: out.fill_(value))


torchport.current_backend().add_kernels(ks)
g = torch.Generator().manual_seed(0)


def ints(*shape, dtype=torch.complex64):  # small integers: every product and sum exact
    return torch.randint(-4, 5, shape, generator=g).to(dtype) + (
        1j * torch.randint(-4, 5, shape, generator=g) if dtype.is_complex else 0)


def same(name, got, want):
    got = got.cpu()
    assert torch.equal(got.resolve_conj().resolve_neg(), want.resolve_conj().resolve_neg()), \
        (name, got, want)


a, b, c = ints(3, 4), ints(4, 5), ints(2, 3, 4)
da, db, dc = a.to("recipe"), b.to("recipe"), c.to("recipe")
same("mm of a conjugate view", torch.mm(da.t().conj().t(), db), torch.mm(a.conj(), b))
same("mm with a conjugate right operand", da @ db.conj(), a @ b.conj())
same("bmm of a conjugate view", torch.bmm(dc.conj(), dc.transpose(1, 2)),
     torch.bmm(c.conj(), c.transpose(1, 2)))
o, do = torch.zeros(5, 3, dtype=torch.complex64), torch.zeros(5, 3, dtype=torch.complex64,
                                                            device="recipe")
torch.mm(b.t(), a.t(), out=o.conj())
torch.mm(db.t(), da.t(), out=do.conj())           # an out= carrying the bit: written through it
same("mm into a conjugate out=", do, o)
r = torch.randn(4, 5, generator=g)
same("clone of a negative view", torch._neg_view(r.to("recipe")).clone(), torch._neg_view(r).clone())
same("clone of the imaginary part of a conjugate", dc.conj().imag.clone(), c.conj().imag.clone())
same("clone of a conjugate view", dc.conj().clone(), c.conj().clone())
same("vdot, bits declared", torch.vdot(da[0].conj(), db[:, 0]), torch.vdot(a[0].conj(), b[:, 0]))
assert calls["vdot"] == [(True, False)], calls["vdot"]
print("bits ok")

x = torch.randn(6, 7, generator=g)
d = x.to("recipe")
calls["fill_"] = 0
with record() as rec:
    d.zero_()
assert calls["fill_"] == 1 and rec.path_of("zero_") == "native", (calls, rec.table())
assert native_overloads()["zero_"].derived_from == "fill_.Scalar"
same("zero_", d, torch.zeros(6, 7))
i = torch.arange(5).to("recipe")
i.zero_()                                          # a dtype the fill_ kernel takes too
assert calls["fill_"] == 2
same("zero_ int64", i, torch.zeros(5, dtype=torch.int64))
print("zero_ ok")

copies = {"copy_d2d": 0, "launch": 0}
for name in copies:
    def counted(*a, _name=name, _orig=getattr(recipe.runtime, name), **k):
        copies[_name] += 1
        return _orig(*a, **k)
    setattr(recipe.runtime, name, counted)
e = torch.empty(6, 7, device="recipe")
x2 = x * 2
d = x.to("recipe")
copies.update(copy_d2d=0, launch=0)
with record() as rec:
    e.copy_(d)                                     # dense, same dtype: one span of bytes
assert copies == {"copy_d2d": 0, "launch": 1}, copies   # the copy_ kernel's launch
assert rec.path_of("copy_") == "native", rec.table()
same("dense same-device copy", e, x)
f = d.clone()
copies.update(copy_d2d=0, launch=0)
f.copy_(d * 2)
assert copies["copy_d2d"] == 0, copies
same("copy after a kernel", f, x2)
print("copy_ ok")
'''


def test_kernels_get_resolved_bits_zero_reaches_fill_and_copy_serves_dense_copies(tmp_path):
    script = tmp_path / "contract_child.py"
    script.write_text(CHILD)
    r = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True,
                       env=child_env(drop=("TORCHPORT_SIM_ASYNC", "TORCHPORT_SIM_STRICT",
                                           "TORCHPORT_AUTOLOAD"),
                                     importable=True, OMP_NUM_THREADS="1"),
                       timeout=300)
    out = r.stdout + r.stderr[-3000:]
    assert r.returncode == 0, out
    assert "bits ok" in r.stdout and "zero_ ok" in r.stdout and "copy_ ok" in r.stdout, out


def test_a_zero_kernel_declared_after_fill_serves_zero():
    """The reference backend declares ``fill_.Scalar`` before ``zero_``: its own ``zero_``
    serves, not one derived from ``fill_``."""
    r = subprocess.run([sys.executable, "-c", (
        "import torch, torchport.backends.reference\n"
        "from torchport.ops import native_overloads, record\n"
        "d = native_overloads()['zero_']\n"
        "assert d.name == 'zero_' and d.derived_from is None, d\n"
        "t = torch.ones(5, device='ref')\n"
        "with record() as rec:\n"
        "    t.zero_()\n"
        "assert rec.path_of('zero_') == 'native' and t.sum().item() == 0, rec.table()\n"
        "print('own zero_')\n")], cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=child_env(drop=("TORCHPORT_SIM_ASYNC", "TORCHPORT_SIM_STRICT", "TORCHPORT_AUTOLOAD"),
                      importable=True, OMP_NUM_THREADS="1"))
    assert r.returncode == 0 and "own zero_" in r.stdout, r.stdout + r.stderr[-3000:]
