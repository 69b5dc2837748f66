"""torch.sim mirrors torch.cuda; registration; visible devices (issue 2, items 3, 9)."""

import contextlib
import types

import pytest
import torch

import torchport
from tests.helpers import mode_independent, run_python
from torchport.backends.sim.runtime import SimRuntime
from torchport.core import native

pytestmark = pytest.mark.modes


def test_module_is_real_and_registered():
    assert isinstance(torch.sim, types.ModuleType)
    import torch.sim as again  # noqa: F401  (importable by name)
    assert torch._C._get_privateuse1_backend_name() == "sim"
    assert torch.sim.is_available() and torch.sim.device_count() == 2


def test_reimport_is_harmless():
    import importlib

    import torchport.sim as s
    importlib.reload(s)
    assert torchport.active_backend() is s.BACKEND
    assert s.BACKEND.register() is s.BACKEND


def test_second_backend_is_clear_error():
    other = torchport.Backend("npu", SimRuntime(num_devices=1, memory=1 << 20))
    with pytest.raises(torchport.BackendError, match="already owns PrivateUse1"):
        other.register()


def test_current_device_and_context_managers():
    assert torch.sim.current_device() == 0
    with torch.sim.device(1):
        assert torch.sim.current_device() == 1
        assert torch.empty(1, device="sim").device.index == 1
    assert torch.sim.current_device() == 0
    t = torch.ones(1, device="sim:1")
    with torch.sim.device_of(t):
        assert torch.sim.current_device() == 1
    torch.sim.set_device("sim:1")
    try:
        assert torch.zeros(1, device="sim").device.index == 1
    finally:
        torch.sim.set_device(0)


@pytest.mark.skipif(native.load() is None, reason=f"no C++ library: {native.UNAVAILABLE}")
def test_a_device_without_an_index_is_the_current_device():
    # PyTorch resolves "sim" for these through the C++ device guard (PyTorch's Python one
    # answers 0); CUDA's answers the current device, which every one of them must give.
    x = torch.arange(3.0)
    makers = {
        "Tensor.to(str)": lambda: x.to("sim"),
        "Tensor.to(device)": lambda: x.to(torch.device("sim")),
        "Tensor.to(device=)": lambda: x.to(device="sim", dtype=torch.float64),
        "Module.to": lambda: torch.nn.Linear(3, 3).to("sim").weight,
        "new_tensor": lambda: x.new_tensor([0.0, 1.0, 2.0], device="sim"),
        "tensor": lambda: torch.tensor([0.0, 1.0, 2.0], device="sim"),
        "as_tensor": lambda: torch.as_tensor(x, device="sim"),
        "asarray": lambda: torch.asarray([0.0, 1.0, 2.0], device="sim"),
        "empty": lambda: torch.empty(3, device="sim"),
    }
    for current in (1, 0):
        torch.sim.set_device(current)
        try:
            for name, make in makers.items():
                assert make().device == torch.device("sim", current), name
            for default in ("block", "set_default_device"):  # the device PyTorch adds
                ctx = torch.device("sim") if default == "block" else contextlib.nullcontext()
                if default == "set_default_device":
                    torch.set_default_device("sim")
                try:
                    with ctx:
                        for made in (torch.tensor([1.0]), torch.as_tensor([1.0]),
                                     torch.ones(1)):
                            assert made.device == torch.device("sim", current), default
                finally:
                    torch.set_default_device(None)
            assert torch.tensor([1.0]).device.type == "cpu"
            on = torch.ones(2, device=f"sim:{current}")
            assert on.to("sim") is on  # already there: no copy
            assert x.to("sim:0").device.index == 0  # an explicit index is kept
            assert torch.equal(x.to("sim").cpu(), x)
        finally:
            torch.sim.set_device(0)


def test_properties():
    p = torch.sim.get_device_properties(0)
    assert p.total_memory == 8 << 30 and "sim" in torch.sim.get_device_name(0)
    assert torch.sim.get_device_capability() == (p.major, p.minor)
    torch.sim.synchronize()
    torch.sim.synchronize(1)


def test_properties_have_every_field_of_cudas():
    """Code written for CUDA reads any field of ``_CudaDeviceProperties`` (inductor's cache
    key reads ``gcnArchName`` on a build without CUDA), so the device's properties have
    them all, with CUDA's types."""
    import ast
    import pathlib

    stub = pathlib.Path(torch.__file__).parent / "_C" / "__init__.pyi"
    tree = ast.parse(stub.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef)
               and n.name == "_CudaDeviceProperties")
    fields = {n.target.id: ast.unparse(n.annotation) for n in cls.body
              if isinstance(n, ast.AnnAssign)}
    assert len(fields) > 10
    p = torch.sim.get_device_properties(0)
    for name, kind in fields.items():
        value = getattr(p, name)
        assert isinstance(value, str if kind == "str" else int), (name, value)
    assert p.gcnArchName == p.name


def test_invalid_device_index():
    with pytest.raises(RuntimeError, match="invalid device ordinal 7"):
        torch.empty(2, device="sim:7")
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.sim.set_device(5)
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.sim.get_device_properties(3)


def test_rng_functions():
    torch.sim.manual_seed(123)
    a = torch.randn(5, device="sim").cpu()
    torch.sim.manual_seed(123)
    b = torch.randn(5, device="sim").cpu()
    assert torch.equal(a, b)
    assert torch.sim.initial_seed() == 123
    cpu_state = torch.get_rng_state()
    state = torch.sim.get_rng_state()
    x = torch.rand(3, device="sim").cpu()
    torch.sim.set_rng_state(state)
    assert torch.equal(torch.rand(3, device="sim").cpu(), x)
    assert torch.equal(torch.get_rng_state(), cpu_state)  # the CPU generator did not move
    torch.manual_seed(7)  # seeds the device too
    assert torch.sim.initial_seed() == 7
    states = torch.sim.get_rng_state_all()
    assert len(states) == 2
    torch.sim.seed()
    torch.sim.seed_all()
    torch.sim.manual_seed_all(3)
    torch.sim.set_rng_state_all(states)


def test_autograd_on_every_device_index():
    for i in (0, 1):
        x = torch.randn(4, 3, device=f"sim:{i}", requires_grad=True)
        (x * x).sum().backward()
        assert x.grad.device.index == i
        assert torch.allclose(x.grad.cpu(), 2 * x.detach().cpu())


def test_visible_devices_select_and_renumber():
    r = run_python("import torch, torchport.sim as s\n"
                   "print(torch.sim.device_count(), s.BACKEND.visible)",
                   TORCHPORT_SIM_DEVICES="4", TORCHPORT_VISIBLE_DEVICES="3,1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["2", "[3,", "1]"]


@mode_independent
def test_sim_settings_from_environment():
    r = run_python("import torch, torchport.sim; print(torch.sim.device_count(), "
                   "torch.sim.get_device_properties(0).total_memory)",
                   TORCHPORT_SIM_DEVICES="3", TORCHPORT_SIM_MEMORY="512MiB")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["3", str(512 << 20)]
    bad = run_python("import torchport.sim", TORCHPORT_SIM_MEMORY="lots")
    assert bad.returncode != 0 and "TORCHPORT_SIM_MEMORY" in bad.stderr


@pytest.mark.skipif(native.load() is None, reason=f"no C++ library: {native.UNAVAILABLE}")
def test_one_current_device_for_torchport_and_torch_accelerator():
    assert torch.accelerator.current_accelerator() == torch.device("sim")
    try:
        torch.accelerator.set_device_index(1)
        assert torch.sim.current_device() == 1 and torch.ones(1, device="sim").device.index == 1
        torch.sim.set_device(0)
        assert torch.accelerator.current_device_index() == 0
        with torch.accelerator.device_index(1):
            assert torch.sim.current_device() == 1
            assert torch.tensor([1.0], device="sim").device.index == 1
        assert torch.sim.current_device() == 0
        with pytest.raises(RuntimeError, match="invalid device ordinal"):
            torch.accelerator.set_device_index(torch.sim.device_count())
    finally:
        torch.sim.set_device(0)


@pytest.mark.skipif(native.load() is None, reason=f"no C++ library: {native.UNAVAILABLE}")
def test_the_current_device_is_per_thread():
    import threading
    seen = {}

    def work() -> None:
        seen["start"] = torch.sim.current_device()
        torch.sim.set_device(1)
        seen["tensor"] = torch.tensor([1.0], device="sim").device.index

    torch.sim.set_device(1)
    try:
        t = threading.Thread(target=work)
        t.start()
        t.join()
        assert seen == {"start": 0, "tensor": 1}
        torch.sim.set_device(0)
        t = threading.Thread(target=work)
        t.start()
        t.join()
        assert torch.sim.current_device() == 0 and torch.tensor([1.0], device="sim").device.index == 0
    finally:
        torch.sim.set_device(0)


# The names the feature layers add to torch.<device> (torchport.features, device_module.add).
FEATURE_NAMES = {"Stream", "Event", "StreamContext", "current_stream", "default_stream",
                 "set_stream", "stream", "amp", "init_device_from_env", "ipc_collect"}


def test_public_names_are_the_declared_ones():
    from torchport.device import device_module
    public = {n for n in dir(torch.sim) if not n.startswith("_")}
    assert public == set(torch.sim.__all__)
    assert set(torch.sim.__all__) == set(device_module.EXPORTS) | FEATURE_NAMES
    private = {n for n in dir(torch.sim) if n.startswith("_") and not n.startswith("__")}
    assert private == {*device_module.PYTORCH_PRIVATE, "_stream_state"}
    assert not hasattr(torch.sim, "_index")  # make_device_module's own helper stays inside


def test_declared_names_mirror_torch_cuda():
    from torchport.device import device_module
    ours = {"backend", "get_amp_supported_dtype", "init_device_from_env"}
    names = set(device_module.EXPORTS) | FEATURE_NAMES | set(device_module.PYTORCH_PRIVATE)
    assert names - ours <= set(dir(torch.cuda)), sorted(names - ours - set(dir(torch.cuda)))
    for name in names - ours - {"OutOfMemoryError", "amp", "default_generators"}:
        assert callable(getattr(torch.sim, name)) == callable(getattr(torch.cuda, name)), name


def test_a_feature_adds_names_through_add_only():
    from torchport.device import device_module
    mod = types.ModuleType("torch.fake")
    mod.__all__ = ["is_available"]
    device_module.add(mod, thing=1, _state=2)
    assert mod.__all__ == ["is_available", "thing"] and mod._state == 2
