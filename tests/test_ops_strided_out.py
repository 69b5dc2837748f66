"""``out=`` tensors that are not contiguous get the values CUDA writes into them.

Several of PyTorch's CPU kernels write their output as if it were contiguous: given a
strided ``out`` of the right size they scatter wrong values (op_db marks
``avg_pool3d``'s ``test_out`` an expected failure on the CPU alone; CUDA's kernels
address the output through its strides). On the device these overloads compute into
contiguous results that are copied in, on every path (the host kernels, the CPU
fallback), in every memory mode. The reference is the CPU's own result for a
contiguous ``out``.
"""

import pytest
import torch

from torchport.ops.plan import STRIDE_BLIND_OUT

pytestmark = pytest.mark.modes

A = torch.ops.aten


def _cases():
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    x5, x4 = r(2, 3, 4, 6, 6), r(2, 3, 6, 6)
    long0 = {"indices": torch.empty(0, dtype=torch.long)}
    return {  # name -> (out= overload, args, out argument names, other out= tensors)
        "aten::avg_pool3d.out": (A.avg_pool3d.out, (x5, [2, 2, 2]), "out", {}),
        "aten::avg_pool3d_backward.grad_input": (
            A.avg_pool3d_backward.grad_input,
            (r(2, 3, 2, 3, 3), x5, [2, 2, 2], [2, 2, 2], [0, 0, 0], False, True, None),
            "grad_input", {}),
        "aten::adaptive_avg_pool3d.out": (A.adaptive_avg_pool3d.out, (x5, [2, 3, 3]), "out", {}),
        "aten::adaptive_avg_pool3d_backward.grad_input": (
            A.adaptive_avg_pool3d_backward.grad_input, (r(2, 3, 2, 3, 3), x5), "grad_input", {}),
        "aten::adaptive_max_pool3d.out": (A.adaptive_max_pool3d.out, (x5, [2, 3, 3]), "out",
                                          long0),
        "aten::fractional_max_pool3d.output": (
            A.fractional_max_pool3d.output,
            (x5, [2, 2, 2], [2, 3, 3], torch.rand(2, 3, 3, generator=g)), "output", long0),
        "aten::col2im.out": (A.col2im.out, (r(2, 12, 25), [6, 6], [2, 2], [1, 1], [0, 0],
                                            [1, 1]), "out", {}),
        "aten::im2col.out": (A.im2col.out, (x4, [2, 2], [1, 1], [0, 0], [1, 1]), "out", {}),
        "aten::slow_conv_transpose2d.out": (A.slow_conv_transpose2d.out,
                                            (x4, r(3, 4, 2, 2), [2, 2]), "out", {}),
        "aten::slow_conv_transpose3d.out": (A.slow_conv_transpose3d.out,
                                            (x5, r(3, 4, 2, 2, 2), [2, 2, 2]), "out", {}),
    }


CASES = _cases()


def test_every_stride_blind_overload_is_tested():
    assert set(CASES) == STRIDE_BLIND_OUT


def _sim(v):
    return v.to("sim") if isinstance(v, torch.Tensor) else v


def _strided(shape, dtype, device):
    """A tensor of ``shape`` whose last dimension steps by 2 (not contiguous)."""
    return torch.full((*shape[:-1], shape[-1] * 2), 7.0, device=device).to(dtype)[..., ::2]


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_strided_out_gets_the_contiguous_result(name):
    op, args, out_name, others = CASES[name]
    ref = op(*args, **{out_name: torch.empty(0)}, **others)
    refs = list(ref) if isinstance(ref, tuple) else [ref]
    names = [out_name, *others]
    outs = {n: _strided(t.shape, t.dtype, "sim") for n, t in zip(names, refs, strict=True)}
    strides = {n: o.stride() for n, o in outs.items()}
    got = op(*map(_sim, args), **outs)
    gots = list(got) if isinstance(got, tuple) else [got]
    for n, g, r in zip(names, gots, refs, strict=True):
        assert g is outs[n]  # the out= tensor itself, its strides kept
        assert g.stride() == strides[n]
        assert torch.equal(g.cpu(), r), f"{name}: {n}"


@pytest.mark.parametrize("name", ["aten::avg_pool3d.out", "aten::adaptive_max_pool3d.out"])
def test_contiguous_and_resized_outs_are_laid_out_as_on_the_cpu(name):
    op, args, out_name, others = CASES[name]
    for make in (lambda t, d: torch.empty_like(t, device=d),  # contiguous, the right size
                 lambda t, d: torch.empty(0, dtype=t.dtype, device=d),  # resized
                 lambda t, d: _strided((3,), t.dtype, d)):  # the wrong size: resized too
        ref = op(*args, **{out_name: torch.empty(0)}, **others)
        refs = list(ref) if isinstance(ref, tuple) else [ref]
        names = [out_name, *others]
        cpu_outs = {n: make(t, "cpu") for n, t in zip(names, refs, strict=True)}
        sim_outs = {n: make(t, "sim") for n, t in zip(names, refs, strict=True)}
        op(*args, **cpu_outs)
        op(*map(_sim, args), **sim_outs)
        for n in names:
            assert sim_outs[n].shape == cpu_outs[n].shape
            assert sim_outs[n].stride() == cpu_outs[n].stride()
            assert torch.equal(sim_outs[n].cpu(), cpu_outs[n]), f"{name}: {n}"
