"""The sim accelerator's kernels.

The sim "chip" computes with ATen's CPU kernels on its own memory, reached
through :meth:`SimRuntime.device_tensor` -- zero-copy in both memory modes, the
way a real kernel addresses its device's memory. A real vendor would put its
kernel library calls here; the declarations are the same.
"""

from __future__ import annotations

import torch

from torchport.ops import KernelSet
from torchport.ops.plan import plan_for
from torchport.ops.quantized import LOW_BIT_KERNELS

# Op families the sim runs natively: what common models use (issue: core ops).
MODEL_OPS = [
    # elementwise
    "add", "sub", "rsub", "mul", "div", "neg", "abs", "exp", "exp2", "expm1", "log", "log2",
    "log10", "log1p", "sqrt", "rsqrt", "reciprocal", "pow", "sign", "sgn", "floor", "ceil",
    "round", "trunc", "frac", "remainder", "fmod", "sin", "cos", "tan", "asin", "acos",
    "atan", "atan2", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh", "erf", "erfc", "erfinv",
    "sigmoid", "logit", "relu", "leaky_relu", "elu", "gelu", "silu", "mish", "hardtanh",
    "hardsigmoid", "hardswish", "softplus", "clamp", "clamp_min", "clamp_max", "where",
    "maximum", "minimum", "fmax", "fmin", "lerp", "addcmul", "addcdiv", "masked_fill",
    "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not", "logical_and", "logical_or",
    "logical_xor", "logical_not", "eq", "ne", "lt", "le", "gt", "ge", "isnan", "isinf",
    "isneginf", "isposinf",
    "nan_to_num", "fill", "fill_", "zero_", "clone", "sigmoid_backward", "tanh_backward",
    "threshold_backward", "gelu_backward", "silu_backward", "leaky_relu_backward",
    "elu_backward", "hardtanh_backward", "softplus_backward", "hardswish_backward",
    "hardsigmoid_backward", "mish_backward", "logit_backward",
    # reductions (sum.default, the whole-tensor sum, is a PyTorch composite calling
    # sum.dim_IntList: left to it, x.sum() reaches the device as sum.dim_IntList, whose
    # out= is a real CPU kernel, as on CUDA; sum.default's own out= is a generated copy)
    "sum.dim_IntList", "sum.IntList_out", "mean", "prod", "amax", "amin", "max", "min",
    "argmax", "argmin", "var", "std", "var_mean", "std_mean", "logsumexp", "norm", "linalg_vector_norm", "all", "any",
    "cumsum", "cumprod", "sort", "topk", "count_nonzero",
    # linear algebra, convolution
    "mm", "bmm", "addmm", "addmv", "mv", "dot", "baddbmm", "addbmm", "convolution",
    "convolution_backward", "_convolution", "_unsafe_index",
    # softmax, norms
    "_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data",
    "native_layer_norm", "native_layer_norm_backward",
    # attention: the same fused kernel as the CPU picks (attention.py answers
    # _fused_sdp_choice as the CPU does), so that a transformer computes the CPU's
    # numbers at the CPU's speed
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward", "native_batch_norm",
    "native_batch_norm_backward", "_native_batch_norm_legit",
    "_native_batch_norm_legit_no_training", "native_group_norm", "native_group_norm_backward",
    "_fused_rms_norm",
    # the inference fast paths of nn.TransformerEncoderLayer and nn.MultiheadAttention
    # (eval mode, no grad), which PyTorch takes on the device as on CUDA
    "_transformer_encoder_layer_fwd", "_native_multi_head_attention",
    "_transform_bias_rescale_qkv", "_masked_softmax", "_masked_softmax_backward",
    # embedding, indexing, shape
    "embedding", "embedding_dense_backward", "index_select", "index", "index_fill", "index_put",
    "index_put_", "_index_put_impl_", "index_add", "index_copy", "gather", "scatter",
    "scatter_add", "scatter_reduce", "masked_scatter", "masked_select", "nonzero", "cat",
    "constant_pad_nd", "reflection_pad2d", "replication_pad2d", "flip", "roll", "repeat",
    "tril", "triu", "arange", "one_hot", "bucketize", "searchsorted", "unique_dim",
    "_unique2", "new_zeros", "new_ones", "new_full", "full", "zeros_like",
    "ones_like", "full_like", "scalar_tensor",
    # backward of views (their composite kernels would enter Python four times: zeros,
    # zero_, the view, copy_)
    "select_backward", "slice_backward", "diagonal_backward",
    # pooling, losses
    "max_pool2d_with_indices", "max_pool2d_with_indices_backward", "avg_pool2d",
    "avg_pool2d_backward", "_adaptive_avg_pool2d", "_adaptive_avg_pool2d_backward",
    "adaptive_max_pool2d", "upsample_nearest2d", "upsample_bilinear2d",
    # the 1-d and 3-d layers' backward (a 3-d CNN's training step), padding, fractional pools
    "_adaptive_avg_pool3d_backward", "avg_pool3d_backward", "max_pool3d_with_indices_backward",
    "adaptive_max_pool2d_backward", "adaptive_max_pool3d", "adaptive_max_pool3d_backward",
    "fractional_max_pool2d", "fractional_max_pool2d_backward", "fractional_max_pool3d",
    "fractional_max_pool3d_backward", "reflection_pad1d_backward", "reflection_pad2d_backward",
    "reflection_pad3d_backward", "replication_pad1d_backward", "replication_pad2d_backward",
    "replication_pad3d_backward", "upsample_nearest3d_backward", "_embedding_bag_backward",
    "rrelu_with_noise",
    # (not hardshrink or replication_pad1d: the tests' examples of a decomposed op and of a
    # kernel a test adds)
    "nll_loss_forward", "nll_loss_backward", "nll_loss2d_forward", "nll_loss2d_backward",
    "mse_loss", "mse_loss_backward", "l1_loss", "smooth_l1_loss", "smooth_l1_loss_backward",
    "huber_loss", "huber_loss_backward", "binary_cross_entropy",
    "binary_cross_entropy_backward", "binary_cross_entropy_with_logits",
    # random
    "bernoulli", "bernoulli_", "normal", "normal_", "uniform_", "random_", "exponential_",
    "native_dropout", "native_dropout_backward", "randperm", "multinomial", "rand", "randn",
    "randint",
    # optimizer support (the fused optimizers: torch.optim's fused=True, the Trainer's
    # default AdamW; their CPU kernels compute what CPU optimizers with fused=True do)
    "_amp_foreach_non_finite_check_and_unscale_", "_amp_update_scale_",
    "_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_",
]

# The rest of the Core ATen opset (overloads tagged torch.Tag.core with a backend
# slot), so that an exported program runs without the CPU fallback. (``_to_copy``
# is a torchport core kernel: it crosses devices, which a host op cannot
# express.)
CORE_OPS = [
    "_adaptive_avg_pool3d", "_cdist_forward", "_embedding_bag", "_fft_c2r", "_fft_r2c",
    "_pdist_forward", "avg_pool3d", "col2im", "copy", "grid_sampler_2d",
    "max_pool3d_with_indices", "reflection_pad1d", "reflection_pad3d", "replication_pad3d",
    "select_scatter", "slice_scatter",
    # views: metadata only, registered to skip the boxed fallback's dispatch
    "alias", "as_strided", "diagonal", "expand", "permute", "select.int", "slice.Tensor",
    "split_with_sizes", "squeeze", "unsqueeze", "view",
]


# Ops whose decomposition computes in the input dtype with other rounding than the
# CPU kernel (float16/bfloat16 results off by a few ULPs: addr, linalg_cross, batch
# norm, interpolation): run natively so that the device matches the CPU exactly. Also
# the FFT and the rest of the interpolation family, forward and backward.
EXACT_OPS = [
    "addr", "linalg_cross", "_batch_norm_with_update", "_batch_norm_no_update",
    "batch_norm_backward", "upsample_nearest1d", "upsample_nearest3d", "upsample_linear1d",
    "upsample_bicubic2d", "upsample_trilinear3d", "_upsample_bilinear2d_aa",
    "_upsample_bicubic2d_aa", "upsample_nearest2d_backward", "upsample_linear1d_backward",
    "upsample_bilinear2d_backward", "upsample_bicubic2d_backward",
    "upsample_trilinear3d_backward", "_fft_c2c",
    # CPU kernels whose torch._decomp decomposition rounds otherwise (found by comparing
    # the device with the CPU bit for bit over op_db's samples, and each decomposition
    # with its CPU kernel), with the backward the CPU pairs with them. Not logaddexp:
    # the sim keeps one decomposed op, so that the decomposition path stays exercised.
    "log_sigmoid_forward", "log_sigmoid_backward", "multi_margin_loss",
    "multi_margin_loss_backward", "multilabel_margin_loss_forward",
    "multilabel_margin_loss_backward", "_weight_norm_interface",
    "_weight_norm_interface_backward", "renorm", "trace", "special_entr", "special_i0e",
    "special_log_ndtr", "special_xlog1py", "xlogy", "sinc", "linspace", "_addmm_activation",
    "softshrink", "softshrink_backward",
]


def _foreach_ops() -> list[str]:
    # from the schema registry: dir(torch.ops.aten) lists only the packets loaded so far
    return sorted({s.name.split("::")[1] for s in torch._C._jit_get_all_schemas()
                   if s.name.startswith("aten::_foreach_")})


def _with_inplace(names: list[str]) -> list[str]:
    """Each family with its in-place twin (``add`` -> ``add_``), a separate ATen name.

    Not for view families: ``squeeze_``/``t_`` change the tensor's own metadata, which
    PyTorch's kernels do on the device tensor itself (they stay on the view path)."""
    out = []
    for n in names:
        out.append(n)
        if "." in n or n.endswith("_") or not hasattr(torch.ops.aten, n + "_"):
            continue
        packet = getattr(torch.ops.aten, n)
        if not any(plan_for(getattr(packet, o)).is_view for o in packet.overloads()):
            out.append(n + "_")
    return out


def make_low_bit_kernels(device_view) -> KernelSet:
    """The int8/int4 matmuls (``torchport.ops.LOW_BIT_KERNELS``): the CPU's kernels on the
    chip's memory, so they compute exactly what the CPU computes. A vendor declares its own
    kernels for the same overloads."""
    ks = KernelSet("sim-low-bit")
    ks.host_ops(list(LOW_BIT_KERNELS), to_cpu=device_view)
    return ks


def make_kernels(device_view) -> KernelSet:
    ks = KernelSet("sim")
    ks.host_ops(_with_inplace(MODEL_OPS + CORE_OPS + EXACT_OPS) + _foreach_ops(),
                to_cpu=device_view)
    ks.sparse_host_ops(to_cpu=device_view)  # sparse ops: ATen's CPU sparse kernels too
    ks.quantized_host_ops(to_cpu=device_view)  # and its quantized ones
    return ks
