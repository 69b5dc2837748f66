"""The fuzzer draws layout-following ops (pooling, upsampling, convolution, normalisation)
on permuted inputs and compares their strides with the CPU's."""

from __future__ import annotations

import copy
from typing import Any

import pytest

import torchport.sim  # noqa: F401
from torchport.tools.fuzz import prelude
from torchport.tools.fuzz.generator import LAYOUT_FOLLOWING, Program, generate

pytestmark = pytest.mark.tools


def test_layout_following_steps_are_drawn_compared_by_strides_and_agree() -> None:
    steps = [s for i in range(150) for s in generate(0, i).steps
             if s.tag.startswith("layout-follow:")]
    assert len({s.tag.split("@")[0] for s in steps}) >= 12
    assert all(s.strides for s in steps)
    assert any(".permute(" in s.code[0] and "[0, 1" not in s.code[0] for s in steps)
    ns: dict[str, Any] = {k: getattr(prelude, k) for k in dir(prelude) if not k.startswith("__")}
    exec(Program(0, 0, steps).source(), ns)  # noqa: S102
    cpu = prelude.run(ns["program"], "cpu", "cpu")
    dev = prelude.run(ns["program"], "sim", "sim:1")
    assert prelude.compare_traces(cpu, dev) == []
    # a result laid out otherwise is a difference
    planted = copy.deepcopy(dev)
    step = next(s for s in planted["steps"] if s["error"] is None)
    value = next(v for v in step["values"].values() if isinstance(v, dict) and "stride" in v)
    value["stride"] = tuple(reversed(value["stride"]))
    assert [d["kind"] for d in prelude.compare_traces(cpu, planted)] == ["stride"]
    assert sum(len(v) for v in LAYOUT_FOLLOWING.values()) >= 19
