"""Ops whose output layout follows the input's memory format (pooling, adaptive pooling,
upsampling, convolution, normalisation, padding...) given transposed, channels-last and
permuted inputs: the CPU's strides and values, bit for bit.

Where the CPU alone takes a kernel of its own that lays its result out otherwise, the device
follows CUDA's rule, which is the CPU's general path: ``max_pool1d`` without autograd has a
CPU-only fast path (``max_pool1d_impl``: contiguous); every other device, CUDA included,
computes it by ``max_pool1d_with_indices``, whose result follows the input's layout. That
path is the oracle there (the CPU takes it too when the input requires grad)."""

from __future__ import annotations

import pytest
import torch

F = torch.nn.functional
pytestmark = pytest.mark.modes


def mk(shape: tuple[int, ...]) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    return torch.arange(n, dtype=torch.float32).reshape(shape).mul(0.37).remainder(5)


def layouts(shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """The same values in four layouts: contiguous, last two dims transposed, channels
    last (channels innermost), and batch and channels swapped."""
    nd = len(shape)
    perm = [0, *range(2, nd), 1]
    return {
        "contiguous": mk(shape),
        "transposed": mk((*shape[:-2], shape[-1], shape[-2])).transpose(-1, -2),
        "channels_last": mk(tuple(shape[p] for p in perm)).permute(
            [perm.index(i) for i in range(nd)]),
        "batch_channels_swapped": mk((shape[1], shape[0], *shape[2:])).transpose(0, 1),
    }


def _w(*shape: int):
    return lambda x: mk(shape).to(x.device)


OPS = {  # name: (input shape, call)
    "max_pool1d": ((4, 7, 6), lambda x: F.max_pool1d_with_indices(x, 2)),
    "max_pool1d_grad": ((4, 7, 6), lambda x: F.max_pool1d(x.requires_grad_(), 2).detach()),
    "avg_pool1d": ((4, 7, 6), lambda x: F.avg_pool1d(x, 2)),
    "adaptive_avg_pool1d": ((4, 7, 6), lambda x: F.adaptive_avg_pool1d(x, 4)),
    "adaptive_max_pool1d": ((4, 7, 6), lambda x: F.adaptive_max_pool1d(x, 4, True)),
    "lp_pool1d": ((4, 7, 6), lambda x: F.lp_pool1d(x, 2, 2)),
    "upsample_nearest1d": ((4, 7, 6), lambda x: F.interpolate(x, scale_factor=2)),
    "upsample_linear1d": ((4, 7, 6), lambda x: F.interpolate(x, scale_factor=2, mode="linear")),
    "conv1d": ((4, 7, 6), lambda x: F.conv1d(x, _w(5, 7, 2)(x))),
    "reflection_pad1d": ((4, 7, 6), lambda x: F.pad(x, (1, 2), mode="reflect")),
    "replication_pad1d": ((4, 7, 6), lambda x: F.pad(x, (1, 2), mode="replicate")),
    "max_pool2d": ((2, 4, 6, 6), lambda x: F.max_pool2d(x, 2, return_indices=True)),
    "avg_pool2d": ((2, 4, 6, 6), lambda x: F.avg_pool2d(x, 3, 2, 1)),
    "adaptive_avg_pool2d": ((2, 4, 6, 6), lambda x: F.adaptive_avg_pool2d(x, 4)),
    "adaptive_max_pool2d": ((2, 4, 6, 6), lambda x: F.adaptive_max_pool2d(x, 4, True)),
    "upsample_nearest2d": ((2, 4, 6, 6), lambda x: F.interpolate(x, scale_factor=2)),
    "upsample_bilinear2d": ((2, 4, 6, 6), lambda x: F.interpolate(x, scale_factor=2,
                                                                   mode="bilinear")),
    "upsample_bicubic2d": ((2, 4, 6, 6), lambda x: F.interpolate(x, scale_factor=2,
                                                                  mode="bicubic")),
    "max_unpool2d": ((2, 4, 6, 6), lambda x: F.max_unpool2d(
        *F.max_pool2d(x, 2, return_indices=True), 2)),
    "conv2d": ((2, 4, 6, 6), lambda x: F.conv2d(x, _w(5, 4, 2, 2)(x))),
    "conv_transpose2d": ((2, 4, 6, 6), lambda x: F.conv_transpose2d(x, _w(4, 3, 2, 2)(x))),
    "batch_norm": ((2, 4, 6, 6), lambda x: F.batch_norm(x, None, None, training=True)),
    "batch_norm_eval": ((2, 4, 6, 6), lambda x: F.batch_norm(
        x, torch.zeros(4, device=x.device), torch.ones(4, device=x.device))),
    "group_norm": ((2, 4, 6, 6), lambda x: F.group_norm(x, 2)),
    "grid_sample": ((2, 4, 6, 6), lambda x: F.grid_sample(
        x, torch.zeros(2, 3, 3, 2, device=x.device), align_corners=False)),
    "max_pool3d": ((2, 3, 4, 4, 4), lambda x: F.max_pool3d(x, 2, return_indices=True)),
    "avg_pool3d": ((2, 3, 4, 4, 4), lambda x: F.avg_pool3d(x, 2)),
    "adaptive_avg_pool3d": ((2, 3, 4, 4, 4), lambda x: F.adaptive_avg_pool3d(x, 3)),
    "adaptive_max_pool3d": ((2, 3, 4, 4, 4), lambda x: F.adaptive_max_pool3d(x, 3, True)),
    "upsample_trilinear3d": ((2, 3, 4, 4, 4), lambda x: F.interpolate(x, scale_factor=2,
                                                                      mode="trilinear")),
    "conv3d": ((2, 3, 4, 4, 4), lambda x: F.conv3d(x, _w(3, 3, 2, 2, 2)(x))),
}


def _results(r) -> list[torch.Tensor]:
    return list(r) if isinstance(r, tuple) else [r]


@pytest.mark.parametrize("name", list(OPS))
def test_output_layout_follows_the_input_as_on_the_cpu(name: str) -> None:
    shape, call = OPS[name]
    for layout, x in layouts(shape).items():
        expected = _results(call(x.clone(memory_format=torch.preserve_format)))
        got = _results(call(x.to("sim")))
        for g, e in zip(got, expected, strict=True):
            assert g.device.type == "sim"
            assert (g.shape, g.stride()) == (e.shape, e.stride()), (layout, g.stride(), e.stride())
            assert torch.equal(g.cpu(), e), layout


def test_max_pool1d_follows_cudas_rule_not_the_cpus_fast_path() -> None:
    """The CPU's no-grad fast path is contiguous; the device's result (CUDA's path) has the
    layout ``max_pool1d_with_indices`` gives, and the same values."""
    x = layouts((4, 7, 6))["transposed"]
    got, fast = F.max_pool1d(x.to("sim"), 2), F.max_pool1d(x, 2)
    general = F.max_pool1d_with_indices(x, 2)[0]
    assert fast.is_contiguous() and not general.is_contiguous()
    assert got.stride() == general.stride() and torch.equal(got.cpu(), fast)
