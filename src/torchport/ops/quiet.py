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
