"""The sim backend covers the Core ATen opset (``torch.Tag.core``) natively.

Every core overload that reaches a backend (it has no CompositeImplicitAutograd
kernel, which would decompose it above the backend) must be a native sim kernel
(:func:`torchport.ops.native_overloads`) or a torchport core kernel
(:func:`torchport.ops.registry.core_overloads`), so that an exported program never
takes the CPU fallback.
"""

import pytest
import torch

import torchport.sim  # noqa: F401  (registers the device)
from torchport.ops import native_overloads
from torchport.ops.registry import _has_backend_slot, core_overloads

pytestmark = pytest.mark.strict

# Core overloads with a backend slot that the sim may leave to another path, with
# the reason. Empty: every one is native.
EXCEPTIONS: dict[str, str] = {}


def _core_overloads() -> dict[str, torch._ops.OpOverload]:
    """Every ATen overload tagged core, by name (``"add.Tensor"``, ``"mm"``)."""
    found: dict[str, torch._ops.OpOverload] = {}
    for schema in torch._C._jit_get_all_schemas():
        if not schema.name.startswith("aten::"):
            continue
        base, overload = schema.name[len("aten::"):], schema.overload_name
        packet = getattr(torch.ops.aten, base, None)
        if packet is None:
            continue
        try:
            op = getattr(packet, overload or "default")
        except (AttributeError, RuntimeError):
            continue
        if torch.Tag.core in op.tags:
            found[base + ("." + overload if overload else "")] = op
    return found


def test_core_opset_is_found():
    # PyTorch 2.13 tags 193 overloads core; a much smaller number means the scan broke.
    assert len(_core_overloads()) >= 180


def test_every_core_overload_with_a_backend_slot_is_native():
    native, core = native_overloads(), core_overloads()
    missing = sorted(name for name, op in _core_overloads().items()
                     if _has_backend_slot(op) and name not in native and name not in core
                     and name not in EXCEPTIONS)
    assert not missing, f"core ATen overloads not native on sim: {missing}"


def test_exceptions_are_still_needed():
    native, core = native_overloads(), core_overloads()
    stale = [n for n in EXCEPTIONS if n in native or n in core]
    assert not stale, f"listed as exceptions but native now: {stale}"
