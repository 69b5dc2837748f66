"""Scaled dot-product attention as the CPU computes it.

PyTorch picks SDPA's fused kernel per device type through a C++ stub that a Python
backend cannot fill, so on any PrivateUse1 device ``scaled_dot_product_attention``
takes the math path (a dozen ops, other rounding, several times the memory). The
sim computes with the CPU's kernels, so it makes the CPU's choice: it asks
``_fused_sdp_choice`` and runs the CPU's fused flash kernel when the CPU would. The
kernel sits on the autograd key, because ``scaled_dot_product_attention`` decomposes
above the backend; the flash op it calls has its own derivative, so backward is the
CPU's too.

The CPU's selection rules read shapes, strides, dtypes and flags, never data, so
``_fused_sdp_choice`` runs PyTorch's CPU kernel on the device tensors themselves
(as view ops do): no host views, no host op, in both memory modes.

With torchport's C++ library the choice fills PyTorch's own stub instead
(``native_attention.cpp``): PyTorch's ``scaled_dot_product_attention`` then makes the
CPU's choice for the device itself, with no Python call, and the autograd kernel here is
not registered.
"""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend

from torchport.core import native
from torchport.ops import KernelSet

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_CHOICE = torch.ops.aten._fused_sdp_choice.default
_FLASH = int(SDPBackend.FLASH_ATTENTION)
_CPU_KS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


def fused_sdp_choice(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                     is_causal: bool = False, *, scale: float | None = None,
                     enable_gqa: bool = False) -> int:
    """The fused kernel the CPU would pick for these arguments (an ``SDPBackend`` value)."""
    return _CHOICE.redispatch(_CPU_KS, query, key, value, attn_mask, dropout_p, is_causal,
                              scale=scale, enable_gqa=enable_gqa)


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, *, scale: float | None = None,
                                 enable_gqa: bool = False) -> torch.Tensor:
    choice = fused_sdp_choice(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                              enable_gqa=enable_gqa)
    if choice != _FLASH:
        return _SDPA.decompose(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                               enable_gqa=enable_gqa)
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # as the CPU converts it
        attn_mask = torch.where(attn_mask.logical_not(), float("-inf"),
                                torch.zeros((), dtype=query.dtype, device=query.device))
    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    return out


def cpu_choice_in_cpp() -> bool:
    """Make PyTorch's attention stub give the CPU's choice for the device, where the C++
    library is there (``native_attention.cpp``); whether it does."""
    cpp = native.load()
    enable = getattr(cpp, "torchport_attention_cpu_choice", None) if cpp is not None else None
    return enable is not None and enable(1) == 1


def make_attention_kernels() -> KernelSet:
    ks = KernelSet("sim-attention")
    ks.kernel("_fused_sdp_choice")(fused_sdp_choice)
    if not cpu_choice_in_cpp():
        ks.autograd_kernel("scaled_dot_product_attention")(scaled_dot_product_attention)
    return ks
