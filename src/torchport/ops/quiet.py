"""CPU kernels run for torchport's own purposes, their warnings kept from the user.

The op layer runs CPU kernels to learn something (a refusal on stand-ins, an ``out=``
trial, an aliasing check) whose warnings are not the user's. Inside a device kernel a
C++ warning (``TORCH_WARN``) is not a Python warning yet: it goes to the user's outer call,
which shows it when it returns, past any ``warnings.catch_warnings``. Running the code
inside a PyTorch Python binding that calls back (``Tensor.apply_``) makes them Python
warnings at that binding, where they can be recorded or dropped.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch


def warnings_of(fn: Callable[[], Any]) -> list:
    """The warnings ``fn`` gives, those of C++ included; none reaches the user. An
    exception ``fn`` raises is raised as it was."""
    def element(_: float) -> float:
        fn()
        return 0.0
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.zeros(1).apply_(element)
    return seen


def silently(fn: Callable[[], Any]) -> Any:
    """``fn()``, with no warning of it reaching the user (C++ ones included)."""
    result: list = []
    warnings_of(lambda: result.append(fn()))
    return result[0]


# How a Python reference's out= wrapper words the resize warning (``torch._prims_common.
# wrappers``): its own text, not the one of the C++ kernels (``at::native::resize_output``).
_PYTHON_RESIZED = "An output with one or more elements was resized since it had shape torch.Size("


def is_python_resize_warning(w: Any) -> bool:
    """Is ``w`` (a recorded warning) a Python reference's ``out=`` resize warning?"""
    return str(w.message).startswith(_PYTHON_RESIZED)


def resize_warnings(old: Any, new: Any) -> list:
    """The warnings PyTorch's own ``resize_output`` gives an ``out=`` of shape ``old``
    resized to ``new`` (none where it had no elements or keeps its shape), as the CPU's and
    CUDA's kernels give them: C++'s text, told by C++ (on a meta stand-in)."""
    stand = torch.empty(tuple(old), device="meta")
    meta = torch.device("meta")
    return warnings_of(lambda: torch.ops.aten._resize_output_(stand, list(new), meta))


def warn_resized(old: Any, new: Any, stacklevel: int = 2) -> None:
    """Warn as PyTorch's ``resize_output`` does for an ``out=`` of shape ``old`` resized to
    ``new`` (:func:`resize_warnings`)."""
    for w in resize_warnings(old, new):
        warnings.warn(w.message, w.category, stacklevel=stacklevel + 1)
