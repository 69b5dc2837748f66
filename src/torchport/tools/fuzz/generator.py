"""Random programs from a seed: a curated op table over a pool of tensors.

A program is a list of :class:`Step`\\ s, each a few lines of Python source under
``with rec.step(...)`` (see :mod:`.prelude`), so it prints as a standalone script. The
generator runs each step on the CPU as it writes it (the CPU is the oracle anyway): the pool
then holds real tensors, so later steps pick operands whose shapes and dtypes fit, and a step
that raised on the CPU adds nothing to the pool (it stays in the program: the device must
raise the same). Everything is drawn from ``random.Random(f"{seed}/{index}")``: one seed and
index, one program, in every process.
"""

from __future__ import annotations

import math
import random
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from torchport.tools.fuzz import prelude

FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
INTS = (torch.int64, torch.int32, torch.int8, torch.uint8)
ALL_DTYPES = FLOATS + (torch.complex64,) + INTS + (torch.bool,)
SHAPES = [(), (), (0,), (1,), (3,), (5,), (2, 3), (3, 4), (4, 1), (1, 4), (2, 0, 3),
          (2, 3, 4), (3, 1, 2), (4, 4)]


def dt(d: torch.dtype) -> str:
    """The source text of a dtype: ``torch.float32``."""
    return str(d)


@dataclass
class Var:
    """A tensor of the pool: its name, the pool tensor it is a view of, and whether PyTorch
    promises its strides (views, ``.to``, ``clone``: compared; other results: not)."""

    name: str
    base: str | None = None
    promised: bool = False
    fixed: bool = False  # storage not resizable on the CPU (torch.load from bytes)


@dataclass
class Step:
    """One step of a program: source lines run under ``rec.step``; ``keep`` names what is
    recorded after them; ``tag`` classifies it (``family:variant``, matched by the
    known-open list); ``new`` are the pool tensors it adds when the CPU ran it."""

    tag: str  # family:variant@dtype (the first operand's dtype, where there is one)
    code: list[str]
    keep: list[str]
    exact: bool = True
    strides: tuple[str, ...] = ()
    expect: str | None = None
    on: dict[str, str] = field(default_factory=dict)
    new: list[Var] = field(default_factory=list)

    def render(self, k: int) -> str:
        """The step as source text (unindented), numbered ``k``."""
        args = [str(k), repr(self.tag)]
        if not self.exact:
            args.append("exact=False")
        if self.strides:
            args.append(f"strides={tuple(self.strides)!r}")
        if self.expect:
            args.append(f"expect={self.expect!r}")
        if self.on:
            args.append(f"on={self.on!r}")
        keep = ", ".join(f"{n}={n}" for n in self.keep)
        body = [*self.code, f"rec.keep({keep})"]
        return f"with rec.step({', '.join(args)}):\n" + textwrap.indent("\n".join(body), "    ")


@dataclass
class Program:
    """A generated program: ``seed``/``index`` name it, ``steps`` are its source."""

    seed: int
    index: int
    steps: list[Step]

    @property
    def name(self) -> str:
        return f"{self.seed}/{self.index}"

    def source(self) -> str:
        """``def program(dev, dev1, rec): ...``: what the workers and a repro run."""
        body = "\n".join(s.render(k) for k, s in enumerate(self.steps)) or "pass"
        return "def program(dev, dev1, rec):\n" + textwrap.indent(body, "    ") + "\n"

    def subset(self, keep: list[int]) -> Program:
        """The program with only the steps at ``keep`` (the minimiser's trials)."""
        return Program(self.seed, self.index, [self.steps[i] for i in keep])

    def script(self, title: str = "", mode: str = "default") -> str:
        """A standalone script: runs the program on the CPU and on sim, exits 1 with the
        differences listed while they exist."""
        env = {"default": "", "strict": "TORCHPORT_SIM_STRICT=1 ",
               "async": "TORCHPORT_SIM_ASYNC=1 "}.get(mode, "")
        head = (f'"""{title or "Fuzz program"}\n\nFrom `python -m torchport.tools.fuzz` '
                f"(seed/program {self.name}, mode {mode}). Runs the program below on the CPU "
                f"and on sim,\nthen compares them step by step; exits 1 listing the "
                f"differences while any remain:\n\n    {env}python {{this file}}\n\nThe "
                f"helpers are torchport.tools.fuzz.prelude's, as the fuzzer's own.\n\"\"\"\n")
        body = "from torchport.tools.fuzz.prelude import *  # noqa: F403 (check, mk, torch...)\n"
        main = textwrap.dedent("""
            if __name__ == "__main__":
                import torchport.sim  # noqa: F401
                found = check(program)
                for d in found:
                    print(f"step {d['k']} [{d['tag']}] {d['kind']}: {d['detail']}")
                raise SystemExit(1 if found else 0)
            """)
        return head + body + "\n\n# ---- the program " + "-" * 70 + "\n" + self.source() + main


# ---- the generator ----------------------------------------------------------------------

class _Gen:
    """Builds one program, running each step on the CPU as it goes."""

    def __init__(self, seed: int, index: int, exclude: Callable[[str], bool]) -> None:
        self.rng = random.Random(f"{seed}/{index}")
        self.seed, self.number, self.exclude = seed, index, exclude
        self.rec = prelude.Recorder("cpu", "cpu")
        self.ns: dict[str, Any] = {k: getattr(prelude, k) for k in dir(prelude)
                                   if not k.startswith("__")}
        self.ns.update(dev="cpu", dev1="cpu", rec=self.rec, torch=torch)
        self.pool: list[Var] = []
        self.steps: list[Step] = []
        self.counter = 0
        self.subject: torch.dtype | None = None  # the dtype of the step's first operand

    # ---- helpers ----
    def name(self, prefix: str = "t") -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def t(self, v: Var) -> torch.Tensor:
        return self.ns[v.name]

    def pick(self, pred: Callable[[torch.Tensor], bool] = lambda t: True,
             prefer_views: bool = False) -> Var | None:
        cands = [v for v in self.pool if isinstance(self.ns.get(v.name), torch.Tensor)
                 and pred(self.ns[v.name])]
        if prefer_views and self.rng.random() < 0.6:
            views = [v for v in cands if v.base]
            cands = views or cands
        v = self.rng.choice(cands) if cands else None
        if v is not None and self.subject is None:
            self.subject = self.t(v).dtype
        return v

    def seed_(self) -> int:
        return self.rng.randrange(10**6)

    def fresh(self, shape: tuple[int, ...], dtype: torch.dtype, on: str = "dev") -> str:
        expr = f"mk({tuple(shape)!r}, {dt(dtype)}, {self.seed_()})"
        return expr if on == "cpu" else f"{expr}.to({on})"

    def dtype(self, allowed: tuple[torch.dtype, ...] = ALL_DTYPES) -> torch.dtype:
        if self.rng.random() < 0.1:  # now and then one the op may refuse: same error?
            return self.rng.choice(ALL_DTYPES)
        return self.rng.choice(allowed)

    def scalar(self, dtype: torch.dtype) -> str:
        if dtype == torch.bool:
            return self.rng.choice(["True", "False", "1"])
        if dtype in INTS:
            return self.rng.choice(["2", "3", "1", "-1" if dtype != torch.uint8 else "5"])
        if dtype.is_complex and self.rng.random() < 0.3:
            return "(1.5-2j)"
        return self.rng.choice(["2.5", "-0.5", "2", "0.0", "3"])

    def peek(self, expr: str) -> Any:
        """``expr`` evaluated on the CPU pool, or None where it raises."""
        try:
            return eval(expr, self.ns)  # noqa: S307 - our own generated text
        except Exception:  # noqa: BLE001
            return None

    def keep_with_base(self, v: Var) -> list[str]:
        names = [v.name]
        if v.base and v.base in self.ns and v.base != v.name:
            names.append(v.base)
        return names

    def promised(self, names: list[str]) -> tuple[str, ...]:
        by = {v.name: v for v in self.pool}
        return tuple(n for n in names if n in by and by[n].promised)

    # ---- running ----
    def emit(self, step: Step) -> bool:
        """Append ``step`` and run it on the CPU; whether it succeeded there."""
        k = len(self.steps)
        self.steps.append(step)
        try:
            exec(step.render(k), self.ns)  # noqa: S102 - our own generated text
        except Exception:  # noqa: BLE001 - outside the step's block: keep the program
            self.steps.pop()
            return False
        ok = self.rec.steps[-1]["error"] is None
        if ok and not step.expect:
            self.pool.extend(step.new)
        elif step.expect:  # the device raises: nothing it made exists there
            for v in step.new:
                self.ns.pop(v.name, None)
        return ok

    def build(self) -> Program:
        for _ in range(self.rng.randint(2, 4)):
            self.emit(self.create())
        kinds = [(self.create, 1.5), (self.view, 3), (self.inplace, 3), (self.unary, 3),
                 (self.binary, 4), (self.out, 2), (self.index, 3), (self.reduce, 3),
                 (self.linalg, 1.5), (self.autograd, 1.5), (self.module, 0.6),
                 (self.random, 1), (self.serialize, 0.7), (self.device1, 0.8),
                 (self.thread, 0.8), (self.resize, 0.7), (self.join, 1), (self.item, 1),
                 (self.copy, 1.2)]
        fns, weights = zip(*kinds, strict=True)
        target, tries = self.rng.randint(5, 20), 0
        while len(self.steps) < target + 4 and tries < 200:
            tries += 1
            self.subject = None
            step = self.rng.choices(fns, weights)[0]()
            if step is not None and self.subject is not None and "@" not in step.tag:
                step.tag += "@" + str(self.subject).removeprefix("torch.")
            if step is None or self.exclude(step.tag):
                continue
            self.emit(step)
        self.final()
        return Program(self.seed, self.number, self.steps)

    def final(self) -> None:
        """Every pool tensor at the end: views and bases written through each other."""
        live = [v for v in self.pool if isinstance(self.ns.get(v.name), torch.Tensor)]
        if live:
            names = [v.name for v in live]
            self.emit(Step("final", [], names, exact=False, strides=self.promised(names)))

    # ---- the op table: each builder returns a step, or None where nothing fits ----
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
        other = self.pick(lambda t: _broadcasts(t.shape, x.shape))
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

    def unary(self) -> Step | None:
        v = self.pick()
        if v is None:
            return None
        x, n = self.t(v), self.name()
        F = "torch.nn.functional"
        exact_ops = ["neg", "abs", "relu", "floor", "ceil", "round", "sign", "bitwise_not",
                     "logical_not", "isnan", "square", "trunc", "frac", "sgn", "signbit",
                     "nan_to_num", "isfinite", "positive", "conj_physical"]
        close_ops = ["exp", "log", "sqrt", "sin", "tanh", "sigmoid", "reciprocal", "erf",
                     "expm1", "log1p", "rsqrt", "angle", "atan"]
        r = self.rng.random()
        promised, strides = False, ()
        if r < 0.45:
            op = self.rng.choice(exact_ops)
            code, tag, exact = f"{n} = torch.{op}({v.name})", f"unary:{op}", True
        elif r < 0.75:
            op = self.rng.choice(close_ops)
            code, tag, exact = f"{n} = torch.{op}({v.name})", f"unary:{op}", False
        elif r < 0.85:
            op = self.rng.choice(["softshrink", "hardshrink", "gelu", "silu", "softplus",
                                  "elu", "leaky_relu", "hardtanh", "relu6", "mish"])
            code, exact = f"{n} = {F}.{op}({v.name})", op in ("softshrink", "hardshrink",
                                                               "hardtanh", "relu6")
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

    BINARY_EXACT = ["add", "sub", "mul", "div", "remainder", "maximum", "minimum", "eq", "lt",
                    "ge", "ne", "logical_and", "logical_xor", "bitwise_and", "bitwise_or",
                    "bitwise_xor", "bitwise_left_shift", "bitwise_right_shift", "copysign",
                    "heaviside", "fmod", "floor_divide", "fmax", "true_divide"]
    BINARY_CLOSE = ["logaddexp", "atan2", "pow", "hypot", "xlogy"]
    OPERATORS = ["+", "-", "*", "/", "//", "%", "**", "<<", ">>", "&", "|", "^", "==", "<"]

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
            o = self.pick(lambda t: _broadcasts(t.shape, x.shape) or
                          _broadcasts(x.shape, t.shape))
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
            op = self.rng.choice(self.BINARY_EXACT + self.BINARY_CLOSE)
            exact = op not in self.BINARY_CLOSE
            code = f"{n} = torch.{op}({v.name}, {other})"
            family = "shift" if "shift" in op else op
        else:
            op = self.rng.choice(self.OPERATORS)
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

    REDUCTIONS_EXACT = ["max", "min", "argmax", "argmin", "amax", "amin", "mode", "median",
                        "all", "any", "count_nonzero", "aminmax", "nanmedian", "sort", "topk",
                        "histc"]
    REDUCTIONS_CLOSE = ["sum", "mean", "prod", "var", "std", "nansum", "cumsum", "logsumexp",
                        "cumprod", "norm"]

    def reduce(self) -> Step | None:
        v = self.pick()
        if v is None:
            return None
        x, n = self.t(v), self.name()
        op = self.rng.choice(self.REDUCTIONS_EXACT + self.REDUCTIONS_CLOSE)
        exact = op in self.REDUCTIONS_EXACT
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
            expr = f"torch.{op}({v.name}, {dim}{'' if needs_dim else f', keepdim={kd}'})"
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

    def autograd(self) -> Step | None:
        v = self.pick(lambda t: t.dtype in (torch.float32, torch.float64))
        if v is None:
            return None
        leaf, loss, grad = self.name(), self.name("loss"), self.name("g")
        y = leaf
        chain = []
        for _ in range(self.rng.randint(1, 3)):
            op = self.rng.choice(["sin", "exp", "sq", "tanh", "relu", "pow", "slice", "t",
                                  "cumsum", "softmax", "inplace", "expand", "logsumexp",
                                  "where", "mean", "index"])
            chain.append(op)
            y = {"sin": f"{y}.sin()", "exp": f"({y} * 0.1).exp()", "sq": f"({y} * {y})",
                 "tanh": f"{y}.tanh()", "relu": f"{y}.relu()", "pow": f"{y}.pow(2)",
                 "slice": f"{y}.reshape(-1)[::2]", "t": f"{y}.reshape(-1, 1).t()",
                 "cumsum": f"{y}.reshape(-1).cumsum(0)",
                 "softmax": f"torch.nn.functional.softmax({y}.reshape(-1), 0)",
                 "inplace": f"{y}.clone().mul_(2)", "expand": f"{y}.expand(2, *{y}.shape)",
                 "logsumexp": f"{y}.reshape(-1).logsumexp(0)",
                 "where": f"torch.where({y} > 0, {y}, {y} * 0.1)", "mean": f"{y}.mean()",
                 "index": f"{y}.reshape(-1)[torch.tensor([0, 0], device=dev)]"}[op]
        code = [f"{leaf} = {v.name}.detach().clone().requires_grad_(True)",
                f"{loss} = ({y}).sum()", f"{loss}.backward()", f"{grad} = {leaf}.grad"]
        return Step("autograd", code, [loss, grad], exact=False)

    def module(self) -> Step:
        m, o, x, n, loss = (self.name(p) for p in ("m", "opt", "x", "t", "loss"))
        kind = self.rng.choice(["Linear", "Conv2d", "BatchNorm2d", "LayerNorm"])
        make, shape = {"Linear": ("torch.nn.Linear(4, 3)", (5, 4)),
                       "Conv2d": ("torch.nn.Conv2d(2, 3, 3, padding=1)", (2, 2, 5, 5)),
                       "BatchNorm2d": ("torch.nn.BatchNorm2d(2)", (3, 2, 4, 4)),
                       "LayerNorm": ("torch.nn.LayerNorm(4)", (3, 4))}[kind]
        opt, opt_tag = self.rng.choice([
            ("torch.optim.SGD({p}, lr=0.1, momentum=0.9)", "SGD-momentum"),
            ("torch.optim.SGD({p}, lr=0.1)", "SGD"),
            ("torch.optim.Adam({p}, lr=0.01)", "Adam"),
            ("torch.optim.AdamW({p}, lr=0.01, weight_decay=0.1)", "AdamW")])
        double = self.rng.random() < 0.2
        code = [f"torch.manual_seed({self.seed_()})",
                f"{m} = {make}{'.double()' if double else ''}.to(dev)",
                f"{o} = {opt.format(p=f'{m}.parameters()')}",
                f"{x} = {self.fresh(shape, torch.float64 if double else torch.float32)}",
                f"for _ in range({self.rng.randint(1, 3)}):",
                f"    {o}.zero_grad()",
                f"    {loss} = {m}({x}).square().mean()",
                f"    {loss}.backward()",
                f"    {o}.step()",
                f"{n} = [p.detach() for p in {m}.parameters()] + list({m}.buffers())"]
        return Step(f"module:{kind}+{opt_tag}", code, [loss, n], exact=False)

    def random(self) -> Step | None:
        n = self.name()
        shape = self.rng.choice(SHAPES)
        op = self.rng.choice(["rand", "randn", "randint", "dropout", "randperm", "uniform_",
                              "bernoulli", "normal"])
        dtype = self.rng.choice([torch.float32, torch.float64])
        if op in ("rand", "randn"):
            expr = f"torch.{op}({shape!r}, dtype={dt(dtype)}, device=dev)"
        elif op == "randint":
            expr = f"torch.randint(0, 10, {shape!r}, device=dev)"
        elif op == "dropout":
            v = self.pick(lambda t: t.dtype in FLOATS)
            if v is None:
                return None
            expr = f"torch.nn.functional.dropout({v.name}, 0.5, training=True)"
        elif op == "randperm":
            expr = f"torch.randperm({self.rng.randint(0, 9)}, device=dev)"
        elif op == "uniform_":
            expr = f"torch.empty({shape!r}, device=dev).uniform_(-1, 1)"
        elif op == "bernoulli":
            expr = f"torch.bernoulli(torch.full({shape!r}, 0.3, device=dev))"
        else:
            expr = f"torch.normal(torch.zeros({shape!r}, device=dev), 2.0)"
        code = [f"torch.manual_seed({self.seed_()})", f"{n} = {expr}"]
        # exact: the sim generator gives a CPU generator's numbers (docs/streams-rng-amp.md)
        return Step(f"rng:{op}", code, [n], on={n: "dev"}, new=[Var(n)])

    def serialize(self) -> Step | None:
        v = self.pick(lambda t: t.dim() >= 1)
        if v is None:
            return None
        a, b, same = self.name(), self.name(), self.name("s")
        where = self.rng.choice(["dev", "cpu"])
        load = "torch.load(buf)" if where == "dev" else "torch.load(buf, map_location='cpu')"
        code = ["import io", "buf = io.BytesIO()",
                f"torch.save({{'a': {v.name}, 'b': {v.name}[::2]}}, buf)", "buf.seek(0)",
                f"d = {load}", f"{a}, {b} = d['a'], d['b']",
                f"{same} = {a}.untyped_storage().data_ptr() == "
                f"{b}.untyped_storage().data_ptr()"]
        role = "dev" if where == "dev" else "cpu"
        return Step(f"serialize:{where}", code, [a, b, same], strides=(a, b),
                    on={a: role, b: role},
                    new=[Var(a, promised=True, fixed=True)] if where == "dev" else [])

    def device1(self) -> Step | None:
        v = self.pick(lambda t: t.dtype in FLOATS + INTS)
        if v is None:
            return None
        a, b, c = self.name(), self.name(), self.name()
        kind = self.rng.choice(["to", "context", "copy"])
        if kind == "to":
            code = [f"{a} = {v.name}.to(dev1)", f"{b} = ({a} * 2 + 1).sum(-1)",
                    f"{c} = {b}.to(dev)"]
            on = {a: "dev1", b: "dev1", c: "dev"}
        elif kind == "context":
            code = ["with torch.device(dev1):",
                    f"    {a} = torch.ones({tuple(self.t(v).shape)!r}, dtype={dt(self.t(v).dtype)})",
                    f"    {b} = {a} + {v.name}.to(dev1)", f"{c} = {b}.cpu()"]
            on = {a: "dev1", b: "dev1", c: "cpu"}
            return Step("device1:context", code, [a, b, c], on=on)
        else:
            code = [f"{a} = torch.zeros_like({v.name}, device=dev1)", f"{a}.copy_({v.name})",
                    f"{b} = {a}.t() if {a}.dim() == 2 else {a}[::2]",
                    f"{c} = torch.empty_like({b}, device=dev).copy_({b})"]
            on = {a: "dev1", c: "dev"}
        return Step(f"device1:{kind}", code, [a, b, c], on=on, new=[Var(c)])

    def thread(self) -> Step | None:
        v = self.pick(lambda t: t.dtype in FLOATS)
        if v is None:
            return None
        n = self.name()
        expr = self.rng.choice([f"({v.name} + 1).cumsum(-1) if {v.name}.dim() else {v.name} + 1",
                                f"torch.sort({v.name}.reshape(-1))[0]",
                                f"{v.name}.to(dev1).sum().to(dev)",
                                f"{v.name}.float().exp().mean()"])
        return Step("thread", [f"{n} = in_thread(lambda: {expr})"], [n], exact=False,
                    new=[Var(n)])

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


def _broadcasts(src: torch.Size | tuple[int, ...], dst: torch.Size | tuple[int, ...]) -> bool:
    """Whether ``src`` broadcasts to ``dst`` (``dst`` unchanged)."""
    try:
        return tuple(torch.broadcast_shapes(tuple(src), tuple(dst))) == tuple(dst)
    except RuntimeError:
        return False


def generate(seed: int, index: int, exclude: Callable[[str], bool] = lambda tag: False
             ) -> Program:
    """Program ``index`` of ``seed``; steps whose tag ``exclude`` accepts are not drawn."""
    return _Gen(seed, index, exclude).build()
