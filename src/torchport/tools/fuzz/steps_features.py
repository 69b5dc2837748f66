"""The families of steps beyond single ops: autograd, modules with optimizers, random numbers,
serialization, a second device and another thread.

One family per method of :class:`FeatureSteps` (each returns a step, or None where nothing in
the pool fits); the draw order and weights are :mod:`.generator`'s.
"""

from __future__ import annotations

import torch

from torchport.tools.fuzz.catalog import FLOATS, INTS, SHAPES, dt
from torchport.tools.fuzz.draw import Draw
from torchport.tools.fuzz.program import Step, Var


class FeatureSteps(Draw):
    """Steps exercising the device's features around its ops."""

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
