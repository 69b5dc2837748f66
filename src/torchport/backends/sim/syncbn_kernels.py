"""SyncBatchNorm's kernels for sim: the ops ATen only implements for CUDA.

``torch.nn.SyncBatchNorm`` accepts any PrivateUse1 device, but its autograd
function (``torch/nn/modules/_functions.py``) calls five ops that have CUDA kernels
only: ``batch_norm_stats``, ``batch_norm_gather_stats_with_counts``,
``batch_norm_elemt``, ``batch_norm_backward_reduce`` and
``batch_norm_backward_elemt``. The CPU fallback cannot serve them (there is no CPU
kernel to fall back to), so a device must provide them. Here each is a composition
of ordinary ATen ops called on the device tensors themselves, so it runs on the
device's own kernels; a vendor with fused kernels declares them the same way.

Statistics are computed in float32 for reduced-precision inputs, as the CUDA
kernels do (their ``acc_type``).
"""

from __future__ import annotations

import torch

from torchport.ops import KernelSet

Tensor = torch.Tensor

__all__ = ["make_syncbn_kernels"]


def _acc(t: Tensor) -> Tensor:
    """Reduced-precision floats accumulate in float32 (CUDA's acc_type)."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _reduce_dims(t: Tensor) -> list[int]:
    """Every dimension but the channel dimension 1."""
    return [0, *range(2, t.dim())]


def _per_channel(v: Tensor, like: Tensor) -> Tensor:
    """A ``[C]`` vector shaped to broadcast over ``like``'s channel dimension."""
    return v.reshape([1, -1] + [1] * (like.dim() - 2))


def make_syncbn_kernels() -> KernelSet:
    """The five SyncBatchNorm ops (functional overloads), built from ordinary ATen ops."""
    ks = KernelSet("sim-syncbn")

    @ks.kernel("batch_norm_stats.default")
    def batch_norm_stats(input: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        """Per-channel mean and 1/sqrt(biased var + eps) of this rank's batch."""
        x = _acc(input)
        var, mean = torch.var_mean(x, dim=_reduce_dims(x), correction=0)
        return mean, torch.rsqrt(var + eps)

    @ks.kernel("batch_norm_gather_stats_with_counts.default")
    def batch_norm_gather_stats_with_counts(
            input: Tensor, mean: Tensor, invstd: Tensor, running_mean: Tensor | None,
            running_var: Tensor | None, momentum: float, eps: float,
            counts: Tensor) -> tuple[Tensor, Tensor]:
        """Merge the ranks' ``[W, C]`` statistics weighted by their counts; update running
        statistics with the unbiased variance, as BatchNorm on the whole batch would."""
        c = counts.to(mean.dtype).reshape(-1, 1)
        n = c.sum()
        g_mean = (mean * c).sum(0) / n
        var_i = torch.reciprocal(invstd * invstd) - eps  # each rank's biased variance
        g_var = ((var_i + (mean - g_mean) ** 2) * c).sum(0) / n
        g_invstd = torch.rsqrt(g_var + eps)
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_((g_mean * momentum).to(running_mean.dtype))
        if running_var is not None:
            unbiased = g_var * (n / (n - 1))
            running_var.mul_(1 - momentum).add_((unbiased * momentum).to(running_var.dtype))
        return g_mean, g_invstd

    @ks.kernel("batch_norm_elemt.default")
    def batch_norm_elemt(input: Tensor, weight: Tensor | None, bias: Tensor | None,
                         mean: Tensor, invstd: Tensor, eps: float) -> Tensor:
        """Normalise with given statistics, then scale and shift."""
        scale = invstd if weight is None else invstd * _acc(weight)
        shift = -mean * scale
        if bias is not None:
            shift = shift + _acc(bias)
        out = _acc(input) * _per_channel(scale, input) + _per_channel(shift, input)
        return out.to(input.dtype)

    @ks.kernel("batch_norm_backward_reduce.default")
    def batch_norm_backward_reduce(
            grad_out: Tensor, input: Tensor, mean: Tensor, invstd: Tensor,
            weight: Tensor | None, input_g: bool, weight_g: bool,
            bias_g: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Local sums of dy and dy*(x-mean), and the weight/bias gradients. All four are
        always returned (the caller drops what it did not ask for)."""
        dims = _reduce_dims(input)
        dy = _acc(grad_out)
        xmu = _acc(input) - _per_channel(mean, input)
        sum_dy = dy.sum(dims)
        sum_dy_xmu = (dy * xmu).sum(dims)
        wdtype = weight.dtype if weight is not None else mean.dtype
        return (sum_dy, sum_dy_xmu, (sum_dy_xmu * invstd).to(wdtype), sum_dy.to(wdtype))

    @ks.kernel("batch_norm_backward_elemt.default")
    def batch_norm_backward_elemt(grad_out: Tensor, input: Tensor, mean: Tensor,
                                  invstd: Tensor, weight: Tensor | None, sum_dy: Tensor,
                                  sum_dy_xmu: Tensor, count: Tensor) -> Tensor:
        """Input gradient from the globally reduced sums (``count``: every rank's count)."""
        n = count.to(mean.dtype).sum()
        dy_mean = sum_dy / n
        xmu_scale = sum_dy_xmu / n * invstd * invstd
        gscale = invstd if weight is None else invstd * _acc(weight)
        xmu = _acc(input) - _per_channel(mean, input)
        g = (_acc(grad_out) - _per_channel(dy_mean, input)
             - xmu * _per_channel(xmu_scale, input)) * _per_channel(gscale, input)
        return g.to(input.dtype)

    return ks
