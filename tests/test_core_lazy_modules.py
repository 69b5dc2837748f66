"""Lazy modules moved to the device before their first call, as ``model.to("cuda")`` does.

Their ``UninitializedParameter``s hide their metadata from Python (``.shape`` raises),
so a Python ``_to_copy`` kernel that read it failed where PyTorch's C++ kernels do not.
"""

import copy

import pytest
import torch

pytestmark = pytest.mark.modes


def test_lazy_linear_moves_to_the_device_then_materialises_there():
    m = torch.nn.LazyLinear(2).to("sim")
    assert isinstance(m.weight, torch.nn.UninitializedParameter)
    assert m.weight.device.type == "sim"
    x = torch.randn(4, 3)
    y = m(x.to("sim"))
    assert m.weight.device.type == "sim" and m.weight.shape == (2, 3)
    assert not isinstance(m.weight, torch.nn.UninitializedParameter)
    ref = torch.nn.Linear(3, 2)  # the CPU oracle with the device's parameters
    ref.load_state_dict({k: v.cpu() for k, v in m.state_dict().items()})
    assert y.device.type == "sim"
    torch.testing.assert_close(y.cpu(), ref(x), rtol=0, atol=0)


def test_lazy_conv_takes_dtype_and_device_before_its_first_call():
    m = torch.nn.LazyConv2d(4, 3).to("sim").to(torch.float64)
    cpu = copy.deepcopy(m).cpu()
    assert all(isinstance(p, torch.nn.UninitializedParameter) for p in cpu.parameters())
    x = torch.randn(1, 2, 5, 5, dtype=torch.float64)
    y = m(x.to("sim"))
    assert y.shape == (1, 4, 3, 3) and y.dtype == torch.float64 and y.device.type == "sim"
    assert m.weight.dtype == torch.float64 and m.weight.device.type == "sim"
    ref = torch.nn.Conv2d(2, 4, 3).to(torch.float64)
    ref.load_state_dict({k: v.cpu() for k, v in m.state_dict().items()})
    torch.testing.assert_close(y.cpu(), ref(x), rtol=0, atol=0)


@pytest.mark.parametrize("build", ["linear", "conv"])
def test_lazy_modules_under_the_python_view_kernels(build):
    # the view kernels torchport's Python serves (no C++ library, or while ops are
    # intercepted) meet the uninitialized parameters too (Tensor.to's alias of one)
    from tests.helpers import python_host_kernels
    from torchport.backend import active_backend
    views = active_backend().view_kernels
    views.use(False)
    try:
        with python_host_kernels():
            if build == "linear":
                test_lazy_linear_moves_to_the_device_then_materialises_there()
            else:
                test_lazy_conv_takes_dtype_and_device_before_its_first_call()
    finally:
        views.use(True)
