"""scaled_dot_product_attention on sim takes the CPU's fused kernel: same numbers,
same gradients, bit for bit (the math path PyTorch picks for other devices rounds
differently)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import torchport.sim  # noqa: F401
from torchport.ops import FallbackWarning

pytestmark = pytest.mark.strict

F = torch.nn.functional


@pytest.mark.parametrize("mask,causal,dropout", [(None, False, 0.0), (None, True, 0.0),
                                                 ("bool", False, 0.0), ("float", False, 0.0),
                                                 (None, False, 0.5)])
def test_sdpa_matches_cpu_bitwise(mask: str | None, causal: bool, dropout: float) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3))
    m = {"bool": torch.rand(16, 16) > 0.3, "float": torch.randn(16, 16), None: None}[mask]
    qs, ks, vs = (t.detach().to("sim").requires_grad_() for t in (q, k, v))
    ms = m.to("sim") if m is not None else None
    torch.manual_seed(1)
    torch.sim.manual_seed(1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal, dropout_p=dropout)
    out_s = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=ms, is_causal=causal,
                                           dropout_p=dropout)
    if dropout:  # the CPU's fused kernel takes no dropout: both take the math path
        assert out_s.shape == out.shape and out_s.device.type == "sim"
        out_s.sum().backward()
        return
    assert type(out_s.grad_fn).__name__ == type(out.grad_fn).__name__
    assert torch.equal(out_s.cpu(), out)
    out.sum().backward()
    out_s.sum().backward()
    for a, b in ((q, qs), (k, ks), (v, vs)):
        assert torch.equal(b.grad.cpu(), a.grad)


def test_sdpa_rejects_mixed_dtypes_like_cpu() -> None:
    q = torch.randn(1, 1, 4, 8, device="sim")
    with pytest.raises(RuntimeError, match="dtype"):
        F.scaled_dot_product_attention(q, q.double(), q)


_CHOICE_CASES = [  # (q, k, v shapes, dtype, mask shape, dropout, causal): flash and math answers
    ((2, 4, 16, 8), (2, 4, 16, 8), (2, 4, 16, 8), torch.float32, None, 0.0, False),
    ((2, 4, 16, 8), (2, 4, 16, 8), (2, 4, 16, 8), torch.float32, (16, 16), 0.0, False),
    ((2, 4, 16, 8), (2, 4, 16, 8), (2, 4, 16, 8), torch.float32, None, 0.5, False),
    ((2, 4, 16, 8), (2, 4, 16, 8), (2, 4, 16, 8), torch.float64, None, 0.0, True),
    ((2, 4, 16, 8), (2, 4, 16, 8), (2, 4, 16, 6), torch.float32, None, 0.0, False),
    ((2, 4, 16, 8), (2, 2, 16, 8), (2, 2, 16, 8), torch.bfloat16, None, 0.0, False),
    ((2, 4, 0, 8), (2, 4, 0, 8), (2, 4, 0, 8), torch.float32, None, 0.0, False),
]


@pytest.mark.parametrize("case", _CHOICE_CASES)
def test_fused_sdp_choice_answers_as_on_cpu_from_metadata(case: tuple) -> None:
    from torchport import ops
    from torchport.ops import hostviews
    qs, ks, vs, dtype, mshape, dropout, causal = case
    cpu = [torch.randn(s).to(dtype) for s in (qs, ks, vs)]
    mask = torch.randn(mshape).to(dtype) if mshape else None
    want = torch.ops.aten._fused_sdp_choice(*cpu, mask, dropout, causal)
    dev = [t.to("sim") for t in cpu]
    dmask = mask.to("sim") if mask is not None else None
    hostviews.clear()
    with ops.record() as rec:
        got = torch.ops.aten._fused_sdp_choice(*dev, dmask, dropout, causal)
    assert got == want
    assert rec.path_of("_fused_sdp_choice") == "native"
    assert set(rec.ops) == {"_fused_sdp_choice"}
    assert not hostviews.cached()  # the memory was never viewed


def test_with_the_library_pytorchs_own_attention_makes_the_cpus_choice() -> None:
    # the CPU's choice fills PyTorch's dispatch stub for the device (native_attention.cpp):
    # no kernel of torchport's on the autograd key, no Python call per attention
    import sys

    from torchport.core import native

    ours = torch._C._dispatch_has_kernel_for_dispatch_key(
        "aten::scaled_dot_product_attention", "AutogradPrivateUse1")
    if native.loaded() is None:
        assert ours  # the Python kernel makes the choice
        return
    assert not ours
    q = torch.randn(2, 4, 16, 8)
    qs = q.to("sim").requires_grad_()
    called: list[str] = []

    def note(frame, event, arg) -> None:  # noqa: ANN001
        if event == "call" and frame.f_code.co_filename.endswith("sim/attention.py"):
            called.append(frame.f_code.co_name)
    sys.setprofile(note)
    try:
        out = F.scaled_dot_product_attention(qs, qs, qs, is_causal=True)
    finally:
        sys.setprofile(None)
    assert called == []
    assert type(out.grad_fn).__name__ == "ScaledDotProductFlashAttentionForCpuBackward0"
    assert torch.equal(out.detach().cpu(), F.scaled_dot_product_attention(q, q, q, is_causal=True))


@pytest.mark.parametrize("layer", ["encoder", "mha", "mha-masked"])
def test_the_inference_fast_paths_of_attention_layers_run_natively_as_on_the_cpu(
        layer: str) -> None:
    """``nn.TransformerEncoderLayer`` and ``nn.MultiheadAttention`` in eval mode under
    ``no_grad`` take PyTorch's fused fast path on the device (``_transformer_encoder_layer_fwd``,
    ``_native_multi_head_attention``, as on CUDA): the sim computes it with the CPU's
    kernels, with no fallback warning, bit for bit."""
    torch.manual_seed(0)
    x = torch.randn(3, 7, 16)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[0, 5:] = True
    m = (torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.1, batch_first=True)
         if layer == "encoder" else torch.nn.MultiheadAttention(16, 4, batch_first=True)).eval()

    def run(mod: torch.nn.Module, t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        if layer == "encoder":
            return mod(t, src_key_padding_mask=p)
        return mod(t, t, t, key_padding_mask=p if layer == "mha-masked" else None)[0]

    ms = copy.deepcopy(m).to("sim")
    with torch.no_grad():
        want = run(m, x, pad)
        with warnings.catch_warnings():
            warnings.simplefilter("error", FallbackWarning)
            with torchport.ops.record() as rec:
                got = run(ms, x.to("sim"), pad.to("sim"))
    fast = ("_transformer_encoder_layer_fwd" if layer == "encoder"
            else "_native_multi_head_attention")
    assert rec.path_of(fast) == "native", rec.table()
    assert got.device.type == "sim"
    assert torch.equal(got.cpu(), want)
