"""The families of steps that compute: elementwise ops, ``out=``, indexing, reductions, linear
algebra, joins and reading values back to Python.

One family per method of :class:`ComputeSteps` (each returns a step, or None where nothing in
the pool fits); the ops drawn by name are :mod:`.catalog`'s tables, the draw order and
weights :mod:`.generator`'s.
"""

from __future__ import annotations

import torch

from torchport.tools.fuzz.catalog import (
    ACTIVATIONS,
    ACTIVATIONS_EXACT,
    ALL_DTYPES,
    BINARY_CLOSE,
    BINARY_EXACT,
    FLOATS,
    INTS,
    OPERATORS,
    REDUCTIONS_CLOSE,
    REDUCTIONS_EXACT,
    UNARY_CLOSE,
    UNARY_EXACT,
    ZERO_STRIDE_MEDIAN,
    cuda_checks_devices,
    dt,
)
from torchport.tools.fuzz.draw import Draw, broadcasts
from torchport.tools.fuzz.program import Step, Var


class ComputeSteps(Draw):
    """Steps computing new tensors (or writing by index) from the pool's."""

    def unary(self) -> Step | None:
        v = self.pick()
        if v is None:
            return None
        x, n = self.t(v), self.name()
        F = "torch.nn.functional"
        r = self.rng.random()
        promised, strides = False, ()
        if r < 0.45:
            op = self.rng.choice(UNARY_EXACT)
            code, tag, exact = f"{n} = torch.{op}({v.name})", f"unary:{op}", True
        elif r < 0.75:
            op = self.rng.choice(UNARY_CLOSE)
            code, tag, exact = f"{n} = torch.{op}({v.name})", f"unary:{op}", False
        elif r < 0.85:
            op = self.rng.choice(ACTIVATIONS)
            code, exact = f"{n} = {F}.{op}({v.name})", op in ACTIVATIONS_EXACT
            tag = f"unary:{op}"
            if op == "softshrink" and x.numel() == 1:
                tag = "softshrink:one-element"
        else:  # conversions: .to(dtype) keeps strides for non-overlapping dense inputs
            kind = self.rng.choice(["to", "to", "clone", "contiguous"])
            if kind == "to":
                code = f"{n} = {v.name}.to({dt(self.rng.choice(ALL_DTYPES))})"
            else:
                code = f"{n} = {v.name}.{kind}()"
            expanded = any(st == 0 and sz > 1 for st, sz in zip(x.stride(), x.shape,
                                                                 strict=True))
            tag = f"{'to-dtype' if kind == 'to' else kind}{':expanded' if expanded else ''}"
            exact, promised, strides = True, True, (n,)
        return Step(tag, [code], [n], exact=exact, strides=strides,
                    new=[Var(n, promised=promised)])

    def binary(self) -> Step | None:
        v = self.pick()
        if v is None:
            return None
        x, n = self.t(v), self.name()
        r = self.rng.random()
        expect = None
        kinds = ["tensor", "tensor", "fresh", "scalar", "scalar", "cpu0dim", "cpu-tensor"]
        kind = self.rng.choice(kinds)
        if kind == "tensor":
            o = self.pick(lambda t: broadcasts(t.shape, x.shape) or
                          broadcasts(x.shape, t.shape))
            other = o.name if o else self.scalar(x.dtype)
            kind = "tensor" if o else "scalar"
        elif kind == "fresh":
            shape = tuple(x.shape[1:]) if x.dim() and self.rng.random() < 0.5 else tuple(x.shape)
            other = self.fresh(shape, self.dtype())
        elif kind == "scalar":
            other = self.scalar(self.rng.choice([x.dtype, x.dtype, torch.float32, torch.int64]))
        elif kind == "cpu0dim":
            other = f"torch.tensor({self.scalar(x.dtype)})"
        else:  # a CPU tensor with elements beside a device tensor: CUDA raises
            if x.dim() == 0:
                return None
            other = self.fresh(tuple(x.shape), x.dtype, on="cpu")
            expect = "RuntimeError"
        if r < 0.75:
            op = self.rng.choice(BINARY_EXACT + BINARY_CLOSE)
            exact = op not in BINARY_CLOSE
            code = f"{n} = torch.{op}({v.name}, {other})"
            family = "shift" if "shift" in op else op
            if kind == "cpu0dim" and cuda_checks_devices(op):
                expect = "RuntimeError"  # CUDA's registration takes no CPU tensor here
        else:
            op = self.rng.choice(OPERATORS)
            exact = op != "**"
            left = kind in ("scalar",) and self.rng.random() < 0.4
            code = f"{n} = {other} {op} {v.name}" if left else f"{n} = {v.name} {op} {other}"
            family = "shift" if op in ("<<", ">>") else f"op{op}"
            if left:
                kind = "scalar-left"
        tag = f"{family}:{kind}"
        if family == "shift" and kind.startswith("scalar"):
            tag = "shift:scalar"
        if expect:
            tag = f"mixed-device:{family}"
        return Step(tag, [code], [n], exact=exact, expect=expect,
                    new=[] if expect else [Var(n)])

    def out(self) -> Step | None:
        v = self.pick(lambda t: t.dtype in FLOATS + INTS)
        if v is None:
            return None
        x = self.t(v)
        forms = [("add", f"torch.add({v.name}, {self.scalar(x.dtype)}, out={{o}})", True),
                 ("mul", f"torch.mul({v.name}, {v.name}, out={{o}})", True),
                 ("neg", f"torch.neg({v.name}, out={{o}})", True),
                 ("exp", f"torch.exp({v.name}, out={{o}})", False)]
        if x.dim():
            forms += [("sum", f"torch.sum({v.name}, 0, out={{o}})", False),
                      ("cumsum", f"torch.cumsum({v.name}, 0, out={{o}})", False)]
            if x.shape[0]:
                forms.append(("index_select", f"torch.index_select({v.name}, 0, "
                              f"torch.tensor([0, -1], device=dev), out={{o}})", True))
        if x.dim() == 2 and x.dtype in FLOATS[:2]:
            forms.append(("mm", f"torch.mm({v.name}, {v.name}.t(), out={{o}})", False))
        op, template, exact = self.rng.choice(forms)
        ref = self.peek(template.replace(", out={o}", ""))
        if not isinstance(ref, torch.Tensor):
            return None
        o, n = self.name("o"), self.name()
        kind = self.rng.choice(["right", "right", "wrong-shape", "empty", "dtype",
                                "cpu0dim", "cpu", "noncontiguous"])
        expect = None
        shape, dtype = tuple(ref.shape), ref.dtype
        if kind == "right":
            make = f"torch.empty({shape!r}, dtype={dt(dtype)}, device=dev)"
        elif kind == "wrong-shape":
            make = f"torch.zeros(({max(ref.numel() + 2, 2)},), dtype={dt(dtype)}, device=dev)"
        elif kind == "empty":
            make = f"torch.empty(0, dtype={dt(dtype)}, device=dev)"
        elif kind == "dtype":
            make = f"torch.empty({shape!r}, dtype={dt(self.rng.choice(ALL_DTYPES))}, device=dev)"
        elif kind == "cpu0dim":  # CUDA: "Expected out tensor to have device cuda:0"
            make, expect = f"torch.tensor(0, dtype={dt(dtype)})", "RuntimeError"
        elif kind == "cpu":
            make, expect = f"torch.empty({shape!r}, dtype={dt(dtype)})", "RuntimeError"
            if not shape:
                kind = "cpu0dim"
        else:
            if len(shape) != 2:
                return None
            make = f"torch.empty({shape[::-1]!r}, dtype={dt(dtype)}, device=dev).t()"
        code = [f"{o} = {make}", f"{n} = {template.format(o=o)}", f"same = {n} is {o}"]
        return Step(f"out:{kind}", code, [o, n, "same"], exact=exact, expect=expect,
                    new=[] if expect else [Var(n)])

    def _idx(self, size: int, count: int, negative: bool = True) -> str:
        vals = [self.rng.randrange(-size if negative else 0, size) for _ in range(count)]
        return f"torch.tensor({vals!r}, dtype=torch.int64, device=dev)"

    def index(self) -> Step | None:
        v = self.pick(lambda t: t.dim() >= 1 and t.shape[0] > 0, prefer_views=True)
        if v is None:
            return None
        x, n = self.t(v), self.name()
        d = self.rng.randrange(x.dim())
        size = x.shape[d]
        s = self.scalar(x.dtype)
        kind = self.rng.choice(["getitem-int", "getitem-tensor", "getitem-cpu-index",
                                "getitem-mask", "setitem", "setitem-mask", "setitem-tensor",
                                "index_select", "index_fill_", "index_add_", "gather",
                                "scatter", "scatter-value", "masked_fill", "nonzero",
                                "where"])
        names, new, strides, exact = [n], [Var(n)], (), True
        if kind == "getitem-int":
            code = [f"{n} = {v.name}[{self.rng.randrange(-x.shape[0], x.shape[0])}]"]
            new, strides = [Var(n, base=v.base or v.name, promised=True)], (n,)
        elif kind == "getitem-tensor":
            code = [f"{n} = {v.name}[{self._idx(x.shape[0], 3)}]"]
        elif kind == "getitem-cpu-index":  # CUDA moves a CPU index to the device
            code = [f"{n} = {v.name}[torch.tensor([0, -1])]"]
        elif kind == "getitem-mask":
            code = [f"{n} = {v.name}[{v.name} != 0]"] if x.dtype != torch.bool else \
                [f"{n} = {v.name}[{v.name}]"]
        elif kind.startswith("setitem"):
            if kind == "setitem":
                code = [f"{v.name}[{self.rng.randrange(-x.shape[0], x.shape[0])}] = {s}"]
            elif kind == "setitem-mask":
                code = [f"{v.name}[{self.fresh(tuple(x.shape), torch.bool)}] = {s}"]
            else:
                code = [f"{v.name}[{self._idx(x.shape[0], 2, negative=False)}] = "
                        f"{self.fresh(tuple(x.shape[1:]), x.dtype)}"]
            names, new = self.keep_with_base(v), []
            strides = self.promised(names)
        elif kind == "index_select":
            code = [f"{n} = torch.index_select({v.name}, {d}, {self._idx(size, 3)})"] if size \
                else None
        elif kind == "index_fill_":
            if not size:
                return None
            neg = self.rng.random() < 0.4
            vals = [self.rng.randrange(-size, 0) if neg else self.rng.randrange(size)]
            code = [f"{v.name}.index_fill_({d}, torch.tensor({vals!r}, device=dev), {s})"]
            names, new = self.keep_with_base(v), []
            strides = self.promised(names)
            if neg:
                return Step("index_fill:negative", code, names, strides=strides)
        elif kind == "index_add_":
            if not size:
                return None
            shape = list(x.shape)
            shape[d] = 2
            code = [f"{v.name}.index_add_({d}, {self._idx(size, 2)}, "
                    f"{self.fresh(tuple(shape), x.dtype)})"]
            names, new, exact = self.keep_with_base(v), [], False
            strides = self.promised(names)
        elif kind in ("gather", "scatter", "scatter-value"):
            if not size or 0 in x.shape:
                return None
            shape = list(x.shape)
            shape[d] = self.rng.randint(1, 3)
            idx = f"(mk({tuple(shape)!r}, torch.int64, {self.seed_()}) % {size}).to(dev)"
            if kind == "gather":
                code = [f"{n} = torch.gather({v.name}, {d}, {idx})"]
            elif kind == "scatter":
                code = [f"{n} = torch.scatter({v.name}, {d}, {idx}, "
                        f"{self.fresh(tuple(shape), x.dtype)})"]
            else:
                code = [f"{n} = {v.name}.scatter({d}, {idx}, {s})"]
        elif kind == "masked_fill":
            code = [f"{n} = {v.name}.masked_fill({self.fresh(tuple(x.shape), torch.bool)}, {s})"]
        elif kind == "nonzero":
            code = [f"{n} = torch.nonzero({v.name})"]
        else:
            code = [f"{n} = torch.where({v.name} != 0, {v.name}, {s})"] if \
                x.dtype != torch.bool else [f"{n} = torch.where({v.name})"]
        if code is None:
            return None
        return Step(f"index:{kind}", code, names, exact=exact, strides=strides, new=new)

    def reduce(self) -> Step | None:
        v = self.pick()
        if v is None:
            return None
        x, n = self.t(v), self.name()
        op = self.rng.choice(REDUCTIONS_EXACT + REDUCTIONS_CLOSE)
        exact = op in REDUCTIONS_EXACT
        d = x.dim()
        dim = self.rng.randrange(-max(d, 1), max(d, 1)) if self.rng.random() < 0.7 else None
        kd = self.rng.random() < 0.4
        needs_dim = op in ("cumsum", "cumprod", "logsumexp")
        if op == "histc":
            expr = f"torch.histc({v.name}, bins=4)"
        elif op == "topk":
            if dim is None:
                dim = -1
            k = min(2, x.shape[dim] if d else 1)
            expr = f"torch.topk({v.name}, {k}, dim={dim})"
        elif op == "sort":
            expr = f"torch.sort({v.name}, dim={-1 if dim is None else dim})"
        elif op == "mode" and dim is None:
            expr = f"torch.mode({v.name})"
        elif op == "count_nonzero":
            expr = f"torch.count_nonzero({v.name}{'' if dim is None else f', {dim}'})"
        elif dim is None and not needs_dim:
            expr = f"torch.{op}({v.name})"
        else:
            if dim is None:
                dim = -1
            operand = v.name
            if op in ZERO_STRIDE_MEDIAN and d and x.stride(dim) == 0 and x.shape[dim] > 1:
                operand += ".contiguous()"  # the CPU kernel reads wrong memory there
            expr = f"torch.{op}({operand}, {dim}{'' if needs_dim else f', keepdim={kd}'})"
        tag = f"reduce:{op}"
        if op == "mode" and d == 1 and dim in (None, -1):
            tag = "mode:1d-lastdim"
        elif dim is None and not needs_dim:
            tag += ":all"
        return Step(tag, [f"{n} = {expr}"], [n], exact=exact)

    def linalg(self) -> Step | None:
        n = self.name()
        dtype = self.rng.choice([torch.float32, torch.float32, torch.float64, torch.complex64,
                                 torch.bfloat16])
        a, b, c = (self.rng.randint(0, 4) if self.rng.random() < 0.15 else self.rng.randint(1, 4)
                   for _ in range(3))
        op = self.rng.choice(["mm", "matmul", "bmm", "addmm", "norm", "norm-dim", "dot",
                              "mv", "outer", "@-transposed", "pool-mm"])
        f = self.fresh
        if op == "mm":
            expr = f"torch.mm({f((a, b), dtype)}, {f((b, c), dtype)})"
        elif op == "matmul":
            expr = f"torch.matmul({f((2, a, b), dtype)}, {f((b, c), dtype)})"
        elif op == "bmm":
            expr = f"torch.bmm({f((2, a, b), dtype)}, {f((2, b, c), dtype)})"
        elif op == "addmm":
            expr = (f"torch.addmm({f((c,), dtype)}, {f((a, b), dtype)}, {f((b, c), dtype)}, "
                    f"beta=0.5, alpha=2)")
        elif op == "norm":
            v = self.pick(lambda t: t.dtype.is_floating_point or t.dtype.is_complex)
            expr = f"torch.linalg.norm({v.name if v else f((a, b), dtype)})"
        elif op == "norm-dim":
            expr = f"torch.linalg.norm({f((a, b), dtype)}, dim=-1)"
        elif op == "dot":
            expr = f"torch.dot({f((a,), dtype)}, {f((a,), dtype)})"
        elif op == "mv":
            expr = f"torch.mv({f((a, b), dtype)}, {f((b,), dtype)})"
        elif op == "outer":
            expr = f"torch.outer({f((a,), dtype)}, {f((b,), dtype)})"
        elif op == "@-transposed":
            expr = f"{f((b, a), dtype)}.t() @ {f((c, b), dtype)}.t()"
        else:
            v = self.pick(lambda t: t.dim() == 2 and t.dtype in FLOATS)
            if v is None:
                return None
            k = self.t(v).shape[1]
            expr = f"{v.name} @ {f((k, c), self.t(v).dtype)}"
        return Step(f"linalg:{op}", [f"{n} = {expr}"], [n], exact=False, new=[Var(n)])

    def join(self) -> Step | None:
        v = self.pick(lambda t: t.dim() >= 1)
        if v is None:
            return None
        x, n = self.t(v), self.name()
        other = self.pick(lambda t: t.shape[1:] == x.shape[1:] and t.dim() == x.dim())
        o = other.name if other else self.fresh(tuple(x.shape), self.dtype())
        kind = self.rng.choice(["cat", "stack", "where", "flip", "roll", "repeat"])
        expr = {"cat": f"torch.cat([{v.name}, {o}])",
                "stack": f"torch.stack([{v.name}, {v.name}])",
                "where": f"torch.where({self.fresh(tuple(x.shape), torch.bool)}, {v.name}, {o})",
                "flip": f"torch.flip({v.name}, [0])", "roll": f"torch.roll({v.name}, 1, 0)",
                "repeat": f"{v.name}.repeat(2, *([1] * {v.name}.dim()))"}[kind]
        return Step(f"join:{kind}", [f"{n} = {expr}"], [n], new=[Var(n)])

    def item(self) -> Step | None:
        v = self.pick()
        if v is None:
            return None
        n = self.name("p")
        kind = self.rng.choice(["item", "tolist", "bool", "sum-item"])
        expr = {"item": f"{v.name}.reshape(-1)[0].item()", "tolist": f"{v.name}.tolist()",
                "bool": f"bool(({v.name} != 0).any())", "sum-item": f"{v.name}.sum().item()"}[kind]
        return Step(f"item:{kind}", [f"{n} = {expr}"], [n], exact=kind != "sum-item")
