"""The fuzzer's program model: a :class:`Program` is a list of :class:`Step`\\ s of source text.

Apart from the drawing (:mod:`.generator`) because the runner, the minimiser, the command
line and the tests print, cut and rebuild programs without drawing any: this module needs
neither torch nor a random generator.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field


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

    def script(self, title: str = "", mode: str = "default", backend: str | None = None) -> str:
        """A standalone script: runs the program on the CPU and on sim (on ``backend``'s
        device ``mode``, within tolerance, where given), exits 1 with the differences
        listed while they exist."""
        env = {"default": "", "strict": "TORCHPORT_SIM_STRICT=1 ",
               "async": "TORCHPORT_SIM_ASYNC=1 "}.get(mode, "")
        head = (f'"""{title or "Fuzz program"}\n\nFrom `python -m torchport.tools.fuzz` '
                f"(seed/program {self.name}, mode {mode}). Runs the program below on the CPU "
                f"and on {'the device' if backend else 'sim'},\nthen compares them step by step; "
                f"exits 1 listing the differences while any remain:\n\n    {env}python "
                f"{{this file}}\n\nThe helpers are torchport.tools.fuzz.prelude's, as the fuzzer's own.\n\"\"\"\n")
        body = "from torchport.tools.fuzz.prelude import *  # noqa: F403 (check, mk, torch...)\n"
        load, call = ["import torchport.sim  # noqa: F401"], "check(program)"
        if backend:  # another backend's device, compared within tolerance
            load = ["from torchport.tools.run import load_backend", "",
                    f"device = load_backend({backend!r}).name"]
            call = "check(program, device, tolerant=True)"
        main = "\n".join([
            "", "", 'if __name__ == "__main__":', *(f"    {ln}" if ln else "" for ln in load),
            f"    found = {call}",
            "    for d in found:",
            "        print(f\"step {d['k']} [{d['tag']}] {d['kind']}: {d['detail']}\")",
            "    raise SystemExit(1 if found else 0)", ""])
        return head + body + "\n\n# ---- the program " + "-" * 70 + "\n" + self.source() + main
