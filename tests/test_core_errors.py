"""Bad input gets a clear exception and leaves inputs intact (issue 2, item 11)."""


import pytest
import torch

from tests.helpers import mode_independent, run_python

pytestmark = pytest.mark.modes


def test_mixing_devices():
    a = torch.ones(3, device="sim:0")
    b = torch.ones(3, device="sim:1")
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        a + b
    with pytest.raises(RuntimeError, match="sim:0 and cpu"):
        a + torch.ones(3)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.special.bessel_j0(a, out=torch.empty(3, device="sim:1"))
    assert torch.equal(a.cpu(), torch.ones(3)) and torch.equal(b.cpu(), torch.ones(3))
    assert (a + torch.tensor(2.0)).device.type == "sim"  # CPU scalars are fine, as on CUDA


def test_failed_op_leaves_inputs_intact():
    a = torch.arange(6.0, device="sim").view(2, 3)
    with pytest.raises(RuntimeError):
        a.view(4, 4)
    with pytest.raises(RuntimeError):
        a @ torch.ones(2, 2, device="sim")
    with pytest.raises(RuntimeError):
        a.add_(torch.ones(4, device="sim"))
    assert torch.equal(a.cpu(), torch.arange(6.0).view(2, 3))


@mode_independent
def test_unsupported_dtype_declared_by_runtime():
    code = """
import torch
from torchport.backends.sim import SimRuntime, make_backend
make_backend(SimRuntime(unsupported_dtypes={torch.float64})).register()
x = torch.ones(2, device="sim")
for make in (lambda: x.to(torch.float64), lambda: x.sum(dtype=torch.float64),
             lambda: torch.ones(2, dtype=torch.float64).to("sim"),
             lambda: x.repeat(300000).to(torch.float64),  # large: adopted where allowed
             lambda: torch.cumsum(x, 0, dtype=torch.float64)):
    try:
        make()
        print("NO ERROR")
    except TypeError as e:
        print("ERR", e)
print(x.cpu().tolist(), torch.sim.get_amp_supported_dtype())
from torchport.core import native
if native.loaded() is not None:
    cap = torch.accelerator.get_device_capability()["supported_dtypes"]
    print("CAP", torch.float64 in cap, torch.qint8 in cap, torch.float32 in cap)
"""
    r = run_python(code, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("ERR sim does not support torch.float64") == 5, r.stdout
    assert "[1.0, 1.0]" in r.stdout
    assert "CAP" not in r.stdout or "CAP False True True" in r.stdout  # quantized: supported


@pytest.mark.parametrize("make", [
    lambda d: torch.empty(-1, device=d),
    lambda d: torch.empty((3, -1), device=d),
    lambda d: torch.zeros((2, -3), device=d),
    lambda d: torch.empty_strided((3, 2), (1, -1), device=d),
    lambda d: torch.empty_strided((0, 2), (1, -1), device=d),
    lambda d: torch.empty_strided((3,), (1, 1), device=d),
    lambda d: torch.empty_strided((1 << 40, 1 << 40), (1 << 40, 1), device=d),
    lambda d: torch.ones(2, device=d).new_empty((-1,)),
], ids=["1d", "2d", "zeros", "negative-stride", "empty-negative-stride", "stride-rank",
        "overflow", "new_empty"])
def test_impossible_sizes_and_strides_raise_the_cpus_error(make) -> None:
    before = torch.sim.memory_allocated()
    try:
        expected = make("cpu")
    except RuntimeError as e:
        with pytest.raises(RuntimeError) as got:
            make("sim")
        assert str(got.value).split("\n")[0] == str(e).split("\n")[0]
    else:
        assert make("sim").shape == expected.shape
    assert torch.sim.memory_allocated() == before  # nothing taken, nothing leaked


@mode_independent
@pytest.mark.parametrize("env, message", [
    ({"TORCHPORT_VISIBLE_DEVICES": "5"},
     "invalid device ordinal 0; 0 sim device(s) are visible (TORCHPORT_VISIBLE_DEVICES=5)"),
    ({"TORCHPORT_SIM_DEVICES": "abc"}, "TORCHPORT_SIM_DEVICES='abc' is not a device count"),
])
def test_bad_device_settings_are_named(env: dict, message: str) -> None:
    r = run_python("import torch, torchport.sim\ntorch.ones(2, device='sim')", timeout=120,
                   **env)
    assert r.returncode == 1 and message in r.stderr.strip().splitlines()[-1], r.stderr
