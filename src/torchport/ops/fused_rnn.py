"""CUDA's fused RNN cells, which ``RNN.cpp`` calls for accelerator inputs only.

``LSTM``/``GRU`` and their cells compute a cell's gates with the fused
``_thnn_fused_lstm_cell``/``_thnn_fused_gru_cell`` when the input is on CUDA, XPU or
PrivateUse1 (``input.is_cuda() || input.is_xpu() || input.is_privateuseone()``); backward
runs ``_thnn_fused_lstm_cell_backward_impl``/``_thnn_fused_gru_cell_backward`` (or the
differentiable ATen formulas when ``create_graph``). The CPU has no kernel for them. These
follow CUDA's ``RNN.cu``: argument order, optional biases, the workspace the backward reads
(LSTM: the four activated gates, ``(B, 4H)``; GRU: ``r, z, n, hx, hn + b_hn``, ``(B, 5H)``),
float16/bfloat16 computed in float32, results in the input dtype. The fused path adds the
biases after the matmuls (``((x W_ih^T + h W_hh^T) + b_ih) + b_hh``) where the CPU's
``linear`` adds each bias inside its matmul, so results match the CPU's
``nn.LSTM``/``nn.GRU`` within a few ULPs, not bit for bit -- as on CUDA. Registered for
every backend by :mod:`torchport.ops.device_routes`; they compute with ATen ops on device
tensors, so they take the device's own kernels where it has them.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _acc(t: Tensor) -> Tensor:
    """CUDA's accumulate type for the RNN kernels: float32 for float16/bfloat16."""
    return t.float() if t.dtype in _LOW_PRECISION else t


# ---- fused RNN cells ----------------------------------------------------------------
def _check_cell(name: str, input_gates: Tensor, hidden_gates: Tensor, input_bias: Tensor | None,
                hidden_bias: Tensor | None, prev: Tensor, factor: int) -> None:
    """The shape checks of CUDA's fused cells (``checkSizes`` in ``RNN.cu``)."""
    if input_gates.dim() != 2:
        raise RuntimeError(f"{name}: input_gates must be 2-D (batch, {factor} * hidden), got "
                           f"shape {tuple(input_gates.shape)}")
    if hidden_gates.shape != input_gates.shape:
        raise RuntimeError(f"{name}: hidden_gates shape {tuple(hidden_gates.shape)} must equal "
                           f"input_gates shape {tuple(input_gates.shape)}")
    gates = input_gates.size(1)
    if input_bias is not None:
        if input_bias.dim() != 1 or input_bias.numel() != gates:
            raise RuntimeError(f"{name}: input_bias must be 1-D with {gates} elements, got "
                               f"shape {tuple(input_bias.shape)}")
        if hidden_bias is None or hidden_bias.shape != input_bias.shape:
            got = None if hidden_bias is None else tuple(hidden_bias.shape)
            raise RuntimeError(f"{name}: hidden_bias shape {got} must equal input_bias shape "
                               f"{tuple(input_bias.shape)}")
    if prev.dim() != 2 or prev.numel() != input_gates.size(0) * gates // factor:
        raise RuntimeError(f"{name}: the previous state must be 2-D (batch, hidden) with "
                           f"{input_gates.size(0) * gates // factor} elements, got shape "
                           f"{tuple(prev.shape)}")


def _gate_sums(input_gates: Tensor, hidden_gates: Tensor, input_bias: Tensor | None,
               hidden_bias: Tensor | None) -> Tensor:
    """``((input + hidden) + b_ih) + b_hh`` in the accumulate type, CUDA's order (which
    reads the biases only when ``input_bias`` is given)."""
    g = _acc(input_gates) + _acc(hidden_gates)
    if input_bias is not None:
        g = g + _acc(input_bias) + _acc(hidden_bias)
    return g


def fused_lstm_cell(input_gates: Tensor, hidden_gates: Tensor, cx: Tensor,
                    input_bias: Tensor | None = None,
                    hidden_bias: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``_thnn_fused_lstm_cell``: ``(hy, cy, workspace)``, workspace = activated gates
    ``i, f, g, o`` side by side, ``(batch, 4 * hidden)``."""
    _check_cell("_thnn_fused_lstm_cell", input_gates, hidden_gates, input_bias, hidden_bias,
                cx, 4)
    dtype = input_gates.dtype
    i, f, c, o = _gate_sums(input_gates, hidden_gates, input_bias, hidden_bias).chunk(4, 1)
    i, f, c, o = i.sigmoid(), f.sigmoid(), c.tanh(), o.sigmoid()
    cy = f * _acc(cx) + i * c
    hy = o * cy.tanh()
    workspace = torch.cat([i, f, c, o], 1).to(dtype)
    return (hy.to(dtype).reshape(cx.shape).contiguous(),
            cy.to(dtype).reshape(cx.shape).contiguous(), workspace)


def fused_lstm_cell_backward_impl(grad_hy: Tensor | None, grad_cy: Tensor | None, cx: Tensor,
                                  cy: Tensor, workspace: Tensor,
                                  has_bias: bool) -> tuple[Tensor | None, ...]:
    """``_thnn_fused_lstm_cell_backward_impl``: ``(grad_gates, grad_cx, grad_bias)``; all
    undefined when neither output has a gradient, ``grad_bias`` only with biases."""
    if grad_hy is None and grad_cy is None:
        return None, None, None
    ref = grad_hy if grad_hy is not None else grad_cy
    name = "_thnn_fused_lstm_cell_backward_impl"
    if ref.dim() != 2:
        raise RuntimeError(f"{name}: gradients must be 2-D (batch, hidden), got shape "
                           f"{tuple(ref.shape)}")
    for what, t in (("grad_hy", grad_hy), ("grad_cy", grad_cy), ("cx", cx), ("cy", cy)):
        if t is not None and t.shape != ref.shape:
            raise RuntimeError(f"{name}: {what} shape {tuple(t.shape)} must be "
                               f"{tuple(ref.shape)}")
    if workspace.dim() != 2 or workspace.numel() != ref.numel() * 4:
        raise RuntimeError(f"{name}: workspace must be 2-D with {ref.numel() * 4} elements, "
                           f"got shape {tuple(workspace.shape)}")
    dtype = workspace.dtype
    i, f, c, o = _acc(workspace).chunk(4, 1)
    cx_, t = _acc(cx), _acc(cy).tanh()
    if grad_hy is not None:
        go = _acc(grad_hy)
        gog = go * t
        gcx = go * o * (1 - t * t)
        if grad_cy is not None:
            gcx = gcx + _acc(grad_cy)
    else:
        gog = torch.zeros_like(t)
        gcx = _acc(grad_cy)
    gig = gcx * c
    gfg = gcx * cx_
    gcg = gcx * i
    gcx = gcx * f
    gig = gig * (1 - i) * i
    gfg = gfg * (1 - f) * f
    gcg = gcg * (1 - c * c)
    gog = gog * (1 - o) * o
    grad_gates = torch.cat([gig, gfg, gcg, gog], 1).to(dtype)
    grad_bias = grad_gates.sum(0) if has_bias else None
    return grad_gates, gcx.to(dtype).contiguous(), grad_bias


def fused_gru_cell(input_gates: Tensor, hidden_gates: Tensor, hx: Tensor,
                   input_bias: Tensor | None = None,
                   hidden_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``_thnn_fused_gru_cell``: ``(hy, workspace)``, workspace = ``r, z, n, hx, hn + b_hn``
    side by side, ``(batch, 5 * hidden)``."""
    _check_cell("_thnn_fused_gru_cell", input_gates, hidden_gates, input_bias, hidden_bias,
                hx, 3)
    dtype = input_gates.dtype
    ir, ii, in_ = _acc(input_gates).chunk(3, 1)
    hr, hi, hn = _acc(hidden_gates).chunk(3, 1)
    if input_bias is not None:
        b1r, b1i, b1n = _acc(input_bias).chunk(3)
        b2r, b2i, b2n = _acc(hidden_bias).chunk(3)
        r = (ir + hr + b1r + b2r).sigmoid()
        z = (ii + hi + b1i + b2i).sigmoid()
        hn = hn + b2n
        n = (in_ + b1n + r * hn).tanh()
    else:
        r = (ir + hr).sigmoid()
        z = (ii + hi).sigmoid()
        n = (in_ + r * hn).tanh()
    hx2 = hx.reshape(n.shape)
    hy = n + z * (_acc(hx2) - n)
    workspace = torch.cat([r.to(dtype), z.to(dtype), n.to(dtype), hx2.to(dtype),
                           hn.to(dtype)], 1)
    return hy.to(dtype).reshape(hx.shape).contiguous(), workspace


def fused_gru_cell_backward(grad_hy: Tensor, workspace: Tensor,
                            has_bias: bool) -> tuple[Tensor | None, ...]:
    """``_thnn_fused_gru_cell_backward``: ``(grad_input_gates, grad_hidden_gates, grad_hx,
    grad_input_bias, grad_hidden_bias)``, the biases' only with biases."""
    name = "_thnn_fused_gru_cell_backward"
    if grad_hy.dim() != 2:
        raise RuntimeError(f"{name}: grad_hy must be 2-D (batch, hidden), got shape "
                           f"{tuple(grad_hy.shape)}")
    expected = (grad_hy.size(0), grad_hy.size(1) * 5)
    if tuple(workspace.shape) != expected:
        raise RuntimeError(f"{name}: workspace shape {tuple(workspace.shape)} must be "
                           f"{expected}")
    dtype = workspace.dtype
    r, z, n, hx, hn = _acc(workspace).chunk(5, 1)
    go = _acc(grad_hy)
    gz = go * (hx - n) * (1 - z) * z
    ghx = go * z
    gn = go * (1 - z) * (1 - n * n)
    ghn = gn * r
    gr = gn * hn * (1 - r) * r
    grad_input = torch.cat([gr, gz, gn], 1).to(dtype)
    grad_hidden = torch.cat([gr, gz, ghn], 1).to(dtype)
    gib = grad_input.sum(0) if has_bias else None
    ghb = grad_hidden.sum(0) if has_bias else None
    return grad_input, grad_hidden, ghx.to(dtype).contiguous(), gib, ghb
