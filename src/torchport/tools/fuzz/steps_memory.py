"""The families of steps about memory: creation and factories, views, in-place writes and copies
through them, and resizing a storage.

One family per method of :class:`MemorySteps` (each returns a step, or None where nothing in
the pool fits); the draw order and weights are :mod:`.generator`'s.
"""

from __future__ import annotations

import math

from torchport.tools.fuzz.catalog import ALL_DTYPES, FLOATS, SHAPES, dt
from torchport.tools.fuzz.draw import Draw, broadcasts
from torchport.tools.fuzz.program import Step, Var


class MemorySteps(Draw):
    """Steps that make tensors, alias them and write through the aliases."""

    def create(self) -> Step:
        n, shape = self.name(), self.rng.choice(SHAPES)
        dtype = self.rng.choice(ALL_DTYPES)
        r = self.rng.random()
        if r < 0.75:
            special = dtype in FLOATS and self.rng.random() < 0.15
            extra = ", special=True" if special else ""
            expr = f"mk({shape!r}, {dt(dtype)}, {self.seed_()}{extra}).to(dev)"
            tag = "create"
        elif r < 0.85:
            expr = f"torch.arange({self.rng.randint(0, 6)}, dtype={dt(dtype)}, device=dev)"
            tag = "factory:arange"
        elif r < 0.95:
            expr = f"torch.full({shape!r}, {self.scalar(dtype)}, dtype={dt(dtype)}, device=dev)"
            tag = "factory:full"
        else:
            expr = f"torch.zeros({shape!r}, dtype={dt(dtype)}, device=dev)"
            tag = "factory:zeros"
        return Step(tag, [f"{n} = {expr}"], [n], strides=(n,), on={n: "dev"},
                    new=[Var(n, promised=True)])

    def view(self) -> Step | None:
        v = self.pick()
        if v is None:
            return None
        x, d = self.t(v), self.t(v).dim()
        opts: list[tuple[str, str]] = [("unsqueeze", f"{v.name}.unsqueeze(0)")]
        if d <= 2:
            opts.append(("t", f"{v.name}.t()"))
        if d >= 2:
            opts += [("transpose", f"{v.name}.transpose(0, -1)"),
                     ("permute", f"{v.name}.permute({', '.join(map(str, range(d)[::-1]))})"),
                     ("diagonal", f"{v.name}.diagonal()"), ("mT", f"{v.name}.mT")]
        if d >= 1:
            opts += [("step-slice", f"{v.name}[::2]"), ("slice", f"{v.name}[1:]"),
                     ("last-step-slice", f"{v.name}[..., ::2]"),
                     ("narrow", f"{v.name}.narrow(0, 0, {max(x.shape[0] - 1, 0)})"),
                     ("last-slice", f"{v.name}[-1:]")]
            if x.shape[0]:
                opts.append(("select", f"{v.name}.select(0, -1)"))
        if 1 in x.shape or d == 0:
            shape = tuple(3 if s == 1 else s for s in x.shape)
            opts.append(("expand", f"{v.name}.expand(2, *{shape!r})"))
        if x.is_contiguous():
            opts.append(("view", f"{v.name}.view(-1)"))
        opts.append(("reshape", f"{v.name}.reshape(-1)"))
        if x.dtype.is_complex:
            opts.append(("view_as_real", f"torch.view_as_real({v.name})"))
        if d >= 1:
            opts.append(("squeeze", f"{v.name}.squeeze()"))
        kind, expr = self.rng.choice(opts)
        n = self.name()
        return Step(f"view:{kind}", [f"{n} = {expr}"], [n], strides=(n,),
                    new=[Var(n, base=v.base or v.name, promised=True)])

    def inplace(self) -> Step | None:
        v = self.pick(prefer_views=True)
        if v is None:
            return None
        x = self.t(v)
        s = self.scalar(x.dtype)
        opts = [("add_", f"{v.name}.add_({s})"), ("mul_", f"{v.name}.mul_({s})"),
                ("fill_", f"{v.name}.fill_({s})"), ("zero_", f"{v.name}.zero_()"),
                ("neg_", f"{v.name}.neg_()"), ("clamp_", f"{v.name}.clamp_(-1, 1)"),
                ("setitem-all", f"{v.name}[...] = {s}")]
        other = self.pick(lambda t: broadcasts(t.shape, x.shape))
        if other is not None:
            opts += [("copy_", f"{v.name}.copy_({other.name})"),
                     ("add_-tensor", f"{v.name}.add_({other.name})")]
        tag_kind, code = self.rng.choice(opts)
        names = self.keep_with_base(v)
        return Step(f"inplace:{tag_kind}", [code], names, strides=self.promised(names))

    def copy(self) -> Step | None:
        v = self.pick(prefer_views=True)
        if v is None:
            return None
        x = self.t(v)
        names = self.keep_with_base(v)
        r = self.rng.random()
        if r < 0.25:  # a Python number: Tensor.copy_ takes a Tensor, a number is converted
            code, tag = f"{v.name}.copy_(torch.tensor({self.scalar(x.dtype)}))", "copy:0dim-cpu"
            if self.rng.random() < 0.5:
                code, tag = f"{v.name}.copy_({self.scalar(x.dtype)})", "copy:pyscalar"
        elif r < 0.5:
            code = f"{v.name}.copy_({self.fresh(tuple(x.shape), self.dtype(), on='cpu')})"
            tag = "copy:from-cpu"
        elif r < 0.75:
            shape = tuple(x.shape[1:]) if x.dim() else ()
            code = f"{v.name}.copy_({self.fresh(shape, self.dtype())})"
            tag = "copy:broadcast"
        else:
            src = (f"{self.fresh(tuple(x.shape[::-1]), self.dtype())}.t()" if x.dim() == 2
                   else self.fresh(tuple(x.shape), self.dtype()))
            code, tag = f"{v.name}.copy_({src})", "copy:strided"
        return Step(tag, [code], names, strides=self.promised(names))

    def resize(self) -> Step | None:
        bases = {v.base for v in self.pool if v.base}
        v = self.pick(lambda t: t.is_contiguous())
        if v is None or v.base or v.fixed or v.name in bases:
            return None
        x = self.t(v)
        shape = self.rng.choice([(0,), (2,), (3, 2), (x.numel(),), (x.numel() + 3,), (2, 2, 2)])
        code = [f"{v.name}.resize_({shape!r})"]
        if math.prod(shape) > x.numel():  # grown memory is uninitialised: define it
            code.append(f"{v.name}.fill_({self.scalar(x.dtype)})")
        return Step("resize", code, [v.name], strides=(v.name,))
