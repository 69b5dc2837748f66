"""Host kernels (torchport.ops.hostkernels): which kind each op gets, and the sub-path each
call takes, as torchport.ops.record() reports it."""

from __future__ import annotations

import json

import pytest
import torch

import torchport.ops as ops
import torchport.sim  # noqa: F401
from torchport.backend import active_backend
from torchport.ops import hostkernels

pytestmark = pytest.mark.modes
A = torch.ops.aten
ASYNC = active_backend().runtime.asynchronous


@pytest.mark.parametrize(("op", "sync", "asynchronous"), [
    (A.add.Tensor, "functional", "launch"),
    (A.mm.default, "functional", "launch"),
    (A.add_.Tensor, "in-place", "in-place"),
    (A._fused_adamw_.default, "lists-in-place", "lists-in-place"),
    (A.cat.default, "lists", "launch"),
    (A._foreach_sqrt.default, "lists", "launch"),
    (A.zeros_like.default, "factory", "factory"),
    (A.native_dropout.default, "random", "launch"),
    (A.select.int, "view", "view"),
    (A.bernoulli_.float, "general", "drawn"),  # random in-place: the whole schema, or
    # (asynchronous) drawn by the host at the call
])
def test_each_op_gets_the_kind_its_schema_says(op: torch._ops.OpOverload, sync: str,
                                               asynchronous: str) -> None:
    assert hostkernels.kind_of(op, asynchronous=False).name == sync
    assert hostkernels.kind_of(op, asynchronous=True).name == asynchronous


def test_every_kind_is_reachable_and_documented() -> None:
    names = [k.name for k in hostkernels.KINDS]
    assert len(set(names)) == len(names) and names[-1] == "general"
    for name in names:  # the table in the package's docstring lists each kind
        assert f"\n{name} " in hostkernels.__doc__


def _subpaths(rec: ops.Recorder, name: str) -> dict[str, int]:
    return rec.subpaths_of(name)


def test_a_functional_op_learns_a_layout_once_then_computes_into_device_tensors() -> None:
    base = torch.randn(7, 9)
    xc, x = base[:, 1:], base.to("sim")[:, 1:]  # a layout no other test uses first
    with ops.record() as rec:
        for _ in range(3):
            y = torch.atan2(x, x)
    assert torch.equal(y.cpu(), torch.atan2(xc, xc))  # (the CPU's kernel for this layout)
    subs = _subpaths(rec, "atan2")
    if ASYNC:
        assert subs == {"native:launch": 3}
    else:
        assert subs.get("native:out") == 2 and sum(subs.values()) == 3
        assert set(subs) <= {"native:out", "native:trial"}


def test_other_sub_paths_name_the_branch_taken() -> None:
    x = torch.randn(6, 5).to("sim")
    mask = x > 0
    other = torch.randn(6, 5).to("sim:1")
    with ops.record() as rec:
        for _ in range(2):
            r = x[mask]  # a data-dependent shape: the CPU's result, moved
        y = x.clone()
        y.add_(1)
        with pytest.raises(RuntimeError, match="same device"):
            torch.add(x, other)  # two devices: the general path says what is wrong
        z = torch.add(x, torch.tensor(2.0))  # a CPU scalar tensor: the general path
    assert torch.equal(r.cpu(), x.cpu()[mask.cpu()])
    assert torch.equal(z.cpu(), x.cpu() + 2)
    assert torch.equal(y.cpu(), x.cpu() + 1)
    index = _subpaths(rec, "index.Tensor")
    assert index == ({"native:general": 2} if ASYNC else {"native:cpu-result": 2})
    assert _subpaths(rec, "add_.Tensor") == ({"native:launch": 1} if ASYNC
                                             else {"native:in-place": 1})
    assert _subpaths(rec, "add.Tensor") == {"native:general": 1}  # (the failed call: no row)


def test_subpaths_reach_the_table_and_json() -> None:
    x = torch.randn(3, 4).to("sim")
    with ops.record() as rec:
        torch.zeros_like(x)
        torch.zeros_like(x)
        torch.empty(2, device="sim")
    assert "native:" in rec.table()
    data = json.loads(rec.to_json())["ops"]
    assert data["zeros_like"]["subpaths"]
    assert data["empty.memory_format"]["subpaths"] == {"native:torchport": 1}  # torchport's own


def test_an_op_called_inside_another_keeps_its_own_subpath() -> None:
    # zeros_like's composite calls empty_like and zero_ on the device: each has its own row
    x = torch.randn(5, 3).to("sim").t()
    with ops.record() as rec:
        torch.zeros_like(x)
    subs = _subpaths(rec, "zeros_like")
    assert sum(subs.values()) == 1 and set(subs) <= {"native:composite", "native:fill"}
    for name, st in rec.ops.items():
        assert sum(st.subpaths.values()) == st.paths.get("native", 0), name
