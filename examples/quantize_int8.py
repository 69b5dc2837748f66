"""Int8 inference on the sim device with torchao, checked against the CPU bit for bit.

    pip install -e '.[quant]'        # torchao 0.18.0 (pinned to this torch: no other torch)
    .venv/bin/python examples/quantize_int8.py

A small MLP is quantized twice, on the CPU and on the device, with torchao's
``Int8WeightOnlyConfig`` (int8 weights, float activations: ``mm`` of the float activations
with the int8 weights, then the per-row scales) and ``Int8DynamicActivationInt8WeightConfig``
(activations quantized per row at run time, then an int8 x int8 -> int32 matmul:
``aten._int_mm``, the device's int8 kernel, then the scales). Then it also quantizes a
tensor with PyTorch's own quantized dtypes on the device (``torch.quantize_per_tensor``).
It prints, for each, whether the device's output equals the CPU's and the path each
matmul took on the device (``native``: the device's kernel; ``fallback``: the CPU).
"""

from __future__ import annotations

import warnings

import torch

import torchport.ops as tops
import torchport.sim  # noqa: F401  (registers the sim device)

CONFIGS = ("Int8WeightOnlyConfig", "Int8DynamicActivationInt8WeightConfig")


def small_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                               torch.nn.Linear(128, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 10))


def run(config_name: str, x: torch.Tensor) -> bool:
    """Quantize a model on the CPU and a copy on the device; True if outputs are equal."""
    import torchao.quantization as tq

    torch.manual_seed(0)
    cpu = small_model().eval()
    dev = small_model().eval()
    dev.load_state_dict(cpu.state_dict())
    dev = dev.to("sim")  # quantized where it lives: torchao's ops run on the device
    tq.quantize_(cpu, getattr(tq, config_name)())
    tq.quantize_(dev, getattr(tq, config_name)())
    with torch.no_grad(), tops.record() as rec:
        y_dev = dev(x.to("sim"))
    with torch.no_grad():
        y_cpu = cpu(x)
    same = torch.equal(y_dev.cpu(), y_cpu)
    paths = {n: rec.path_of(n) for n in ("mm", "_int_mm") if rec.path_of(n)}
    print(f"{config_name}: weight {type(dev[0].weight).__name__}, device == CPU: {same}, "
          f"paths {paths}")
    return same


def pytorch_quantized(x: torch.Tensor) -> bool:
    """PyTorch's quantized tensors on the device: quantize, views, dequantize."""
    d = torch.quantize_per_tensor(x.to("sim"), 0.02, 3, torch.quint8)
    c = torch.quantize_per_tensor(x, 0.02, 3, torch.quint8)
    same = torch.equal(d.flatten().int_repr().cpu(), c.flatten().int_repr()) \
        and torch.equal(d.t().dequantize().cpu(), c.t().dequantize())
    print(f"quantize_per_tensor on {d.device}: {d.dtype}, scale {d.q_scale()}, "
          f"device == CPU: {same}")
    return same


def main() -> int:
    # PyTorch's quantized kernels (quantize, int_repr, dequantize) run as the CPU's on the
    # device's memory through the fallback, which warns once per op: expected here
    warnings.filterwarnings("ignore", category=tops.FallbackWarning)
    torch.manual_seed(1)
    x = torch.randn(16, 64)
    ok = pytorch_quantized(x)
    try:
        import torchao  # noqa: F401
    except ImportError:
        print("torchao is not installed: pip install -e '.[quant]'")
        return 0 if ok else 1
    for name in CONFIGS:
        ok = run(name, x) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
