"""CUDA's autocast op policy, registered for the ``AutocastPrivateUse1`` dispatch key.

PyTorch registers autocast kernels for CUDA, CPU, XPU, MPS... but none for
PrivateUse1 (not even the fallthrough for ops outside the lists, so without this
module any op under ``torch.autocast("sim")`` fails). We register, from Python,
the same categories CUDA uses (``aten/src/ATen/autocast_mode.cpp``):

* lower precision: inputs cast to the autocast dtype (matmuls, convolutions, RNN cells);
* fp32: inputs cast to float32 (pointwise ops that overflow, norms, losses);
* fp32 set-opt-dtype: reductions/softmax get ``dtype=float32`` unless given;
* fp32 append-dtype: ``norm`` redispatched to its ``dtype`` overload;
* promote: inputs cast to the widest floating type among them;
* banned: ``binary_cross_entropy`` raises, as on CUDA.

Only device tensors of a floating type other than float64 are cast (CUDA's
``is_eligible``). Where torchport's C++ library serves, ``native_autocast.cpp`` registers
the same policy with PyTorch's own lists and wrappers instead, which also cache the casts of
weights within an autocast region, as on CUDA; these Python kernels do not.
"""

from __future__ import annotations

import ctypes
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from torchport.core import compat, native

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend

KEY = "AutocastPrivateUse1"
_EXCLUDE = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)

LOWER_PRECISION_FP: tuple[str, ...] = (
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc",
    "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "convolution",
    "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linalg_vecdot",
    "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell",
    "rnn_relu_cell", "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
)
FP32: tuple[str, ...] = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar",
    "softplus", "layer_norm", "native_layer_norm", "group_norm", "frobenius_norm.dim",
    "nuclear_norm", "nuclear_norm.dim", "cosine_similarity", "poisson_nll_loss",
    "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div",
    "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
    "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d",
    "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d",
    "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa",
    "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
    "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "rms_norm",
    "linalg_matrix_sqrth",  # torch 2.14 added the op and put it on CUDA's list
)
FP32_SET_OPT_DTYPE: tuple[str, ...] = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "sum",
    "sum.dim_IntList",
)
FP32_APPEND_DTYPE: dict[str, str] = {
    "norm.Scalar": "ScalarOpt_dtype",
    "norm.ScalarOpt_dim": "ScalarOpt_dim_dtype",
}
PROMOTE: tuple[str, ...] = (
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
    "index_put", "scatter_add", "tensordot",
)
BANNED: tuple[str, ...] = ("binary_cross_entropy",)

_BCE_MESSAGE = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_"
    "logits\nor torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and "
    "BCEWithLogits are\nsafe to autocast.")


def _overload(name: str) -> torch._ops.OpOverload:
    op = compat.aten_overload(name)
    if op is None:
        raise AttributeError(f"this torch has no aten::{name}")
    return op


class _Caster:
    """Casts eligible device tensors (also inside lists) of an op's arguments."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type

    def eligible(self, t: Any) -> bool:
        return (isinstance(t, torch.Tensor) and t.device.type == self.device_type
                and t.is_floating_point() and t.dtype != torch.float64)

    def cast(self, v: Any, dtype: torch.dtype) -> Any:
        if self.eligible(v):
            return v if v.dtype == dtype else v.to(dtype)
        if isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v):
            return type(v)(self.cast(x, dtype) for x in v)
        return v

    def cast_all(self, args: tuple, kwargs: dict, dtype: torch.dtype) -> tuple[tuple, dict]:
        return (tuple(self.cast(a, dtype) for a in args),
                {k: self.cast(v, dtype) for k, v in kwargs.items()})

    def widest(self, args: tuple, kwargs: dict, start: torch.dtype) -> torch.dtype:
        """CUDA's promote type (``at::autocast::prioritize``), the inputs taken in order:
        float32 wins, float64 is ignored, and a lower-precision type other than the
        autocast one (float16 under bfloat16) raises unless a float32 came first."""
        out = start
        for v in (*args, *kwargs.values()):
            for t in (v if isinstance(v, (list, tuple)) else (v,)):
                if not self.eligible(t):
                    continue
                if out == torch.float32 or t.dtype == torch.float32:
                    out = torch.float32
                elif not (out == start and t.dtype == start):
                    raise RuntimeError("Unexpected floating ScalarType in "
                                       "at::autocast::prioritize")
        return out

    def first_eligible(self, args: tuple, kwargs: dict) -> bool:
        for v in (*args, *kwargs.values()):
            if isinstance(v, torch.Tensor):
                return self.eligible(v)
        return False


def _kernel(op: torch._ops.OpOverload, policy: str, caster: _Caster,
            extra: Any = None) -> Callable[..., Any]:
    dev = caster.device_type
    dtype_pos = None
    if policy == "fp32_set_opt_dtype":
        names = [a.name for a in op._schema.arguments]
        dtype_pos = names.index("dtype")

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if policy == "lower":
            args, kwargs = caster.cast_all(args, kwargs, torch.get_autocast_dtype(dev))
            target = op
        elif policy == "fp32":
            args, kwargs = caster.cast_all(args, kwargs, torch.float32)
            target = op
        elif policy == "promote":
            widest = caster.widest(args, kwargs, torch.get_autocast_dtype(dev))
            args, kwargs = caster.cast_all(args, kwargs, widest)
            target = op
        elif policy == "fp32_set_opt_dtype":
            target = op
            given = args[dtype_pos] if dtype_pos < len(args) else kwargs.get("dtype")
            if given is None and caster.first_eligible(args, kwargs):
                if dtype_pos < len(args):
                    args = (*args[:dtype_pos], torch.float32, *args[dtype_pos + 1:])
                else:
                    kwargs = {**kwargs, "dtype": torch.float32}
        elif policy == "fp32_append_dtype":
            target = op
            if caster.first_eligible(args, kwargs):
                target, kwargs = extra, {**kwargs, "dtype": torch.float32}
        else:  # banned
            raise RuntimeError(_BCE_MESSAGE)
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            return target(*args, **kwargs)

    kernel.__name__ = f"autocast_{policy}_{op._schema.name.split('::')[1]}"
    return kernel


def policy_table() -> dict[str, str]:
    """ATen overload name -> CUDA cast policy, for tests and documentation: the ops of the
    lists this torch has (a list may name an op a later release added)."""
    table: dict[str, str] = {}
    for names, policy in ((LOWER_PRECISION_FP, "lower"), (FP32, "fp32"),
                          (FP32_SET_OPT_DTYPE, "fp32_set_opt_dtype"),
                          (tuple(FP32_APPEND_DTYPE), "fp32_append_dtype"),
                          (PROMOTE, "promote"), (BANNED, "banned")):
        for n in names:
            if compat.aten_overload(n) is not None:
                table[n] = policy
    return table


def _registered() -> list[str]:
    """The ``aten`` overloads with a kernel for the autocast key, as the policy table
    names them."""
    return sorted(n.removeprefix("aten::") for n in
                  torch._C._dispatch_get_registrations_for_dispatch_key(KEY)
                  if n.startswith("aten::"))


def _install_native() -> bool:
    """The policy from C++ (``native_autocast.cpp``: PyTorch's own lists and wrappers, with
    CUDA's cache of weight casts), where the library is there and nothing holds the key."""
    cpp = native.load()
    if cpp is None or not hasattr(cpp, "torchport_autocast_enable"):
        return False
    if _registered():
        return False  # another plug-in's kernels: the Python policy fills the rest
    has_fallthrough = torch._C._dispatch_has_backend_fallback(
        torch._C.DispatchKey.AutocastPrivateUse1)
    error = ctypes.create_string_buffer(512)
    if not cpp.torchport_autocast_enable(int(not has_fallthrough), error, len(error)):
        warnings.warn(f"torchport: the C++ autocast policy failed to register "
                      f"({error.value.decode(errors='replace')}); autocast runs in Python",
                      RuntimeWarning, stacklevel=2)
        return False
    return True


def install(backend: DeviceBackend) -> list[str]:
    """Register the policy for ``backend``'s autocast key; return the overloads added.

    From C++ where the library serves (``TORCHPORT_NATIVE``): PyTorch's shared lists;
    then from Python the ops the C++ lists leave out (CUDA registers some outside them:
    ``linalg_matrix_sqrth`` in 2.14), or all of them without the library. Ops PyTorch (or
    another plug-in) already registered for the key are left alone, and the key gets a
    fallthrough for every other op."""
    native_served = _install_native()
    caster = _Caster(backend.name)
    lib = backend.library()
    added = []
    for name, policy in policy_table().items():
        op = _overload(name)
        qual = op._schema.name + ("." + op._schema.overload_name
                                  if op._schema.overload_name else "")
        if torch._C._dispatch_has_kernel_for_dispatch_key(qual, KEY):
            continue
        extra = None
        if policy == "fp32_append_dtype":
            extra = getattr(torch.ops.aten.norm, FP32_APPEND_DTYPE[name])
        lib.impl(name, _kernel(op, policy, caster, extra), KEY)
        added.append(name)
    if not torch._C._dispatch_has_backend_fallback(torch._C.DispatchKey.AutocastPrivateUse1):
        backend.library("_").fallback(torch.library.fallthrough_kernel, KEY)
    return _registered() if native_served else added
