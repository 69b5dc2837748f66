"""The CPU fallback: every op without a device kernel runs on the CPU.

Registered as PrivateUse1's boxed fallback. It is the path DIPU and torch_npu
take for unsupported ops, made schema-exact by :mod:`torchport.ops.hostexec`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torchport.ops import hostexec

if TYPE_CHECKING:
    from torchport.backend import Backend


def make_fallback(backend: Backend) -> Callable[..., Any]:
    def fallback(keyset: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return hostexec.run_on_host(backend, op, args, kwargs)
    return fallback
