"""torch.save / torch.load of device tensors, state dicts and modules (issue 2, item 10)."""


import pytest
import torch

from tests.helpers import run_python

pytestmark = pytest.mark.modes


def test_tensor_round_trip(tmp_path):
    c = torch.randn(3, 4)
    torch.save({"a": c.to("sim"), "b": c.to("sim:1")[1:]}, tmp_path / "t.pt")
    out = torch.load(tmp_path / "t.pt")
    assert out["a"].device == torch.device("sim", 0) and out["b"].device.index == 1
    assert torch.equal(out["a"].cpu(), c) and torch.equal(out["b"].cpu(), c[1:])


@pytest.mark.parametrize("where", ["cpu", "sim:1", torch.device("sim", 1), {"sim:0": "sim:1"}])
def test_map_location(tmp_path, where):
    c = torch.randn(5)
    torch.save(c.to("sim"), tmp_path / "t.pt")
    t = torch.load(tmp_path / "t.pt", map_location=where)
    expected = "cpu" if where == "cpu" else "sim:1"
    assert str(t.device) == expected and torch.equal(t.cpu(), c)


def test_cpu_checkpoint_onto_device(tmp_path):
    model = torch.nn.Linear(4, 2)
    torch.save(model.state_dict(), tmp_path / "m.pt")
    sd = torch.load(tmp_path / "m.pt", map_location="sim")
    assert all(v.device.type == "sim" for v in sd.values())
    m2 = torch.nn.Linear(4, 2).to("sim")
    m2.load_state_dict(sd)
    assert torch.equal(m2.weight.cpu(), model.weight)


def test_whole_module(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU()).to("sim")
    torch.save(model, tmp_path / "m.pt")
    m = torch.load(tmp_path / "m.pt", weights_only=False)
    assert next(m.parameters()).device.type == "sim"
    x = torch.randn(2, 3)
    assert torch.equal(m(x.to("sim")).cpu(), model(x.to("sim")).cpu())


def test_load_with_fewer_devices_is_clear(tmp_path):
    torch.save(torch.ones(2, device="sim:1"), tmp_path / "t.pt")
    code = (f"import torch, torchport.sim\n"
            f"try:\n    torch.load({str(tmp_path / 't.pt')!r})\n"
            f"except RuntimeError as e:\n    print('ERR', e)\n"
            f"print(torch.load({str(tmp_path / 't.pt')!r}, map_location='sim:0').device)")
    r = run_python(code, timeout=120, TORCHPORT_SIM_DEVICES="1")
    assert r.returncode == 0, r.stderr
    assert "ERR" in r.stdout and "map_location" in r.stdout
    assert r.stdout.strip().endswith("sim:0")


def test_backend_metadata_travels_through_a_checkpoint(tmp_path):
    from torchport.core import native

    x = torch.randn(3, device="sim:1")
    torch._utils.set_tensor_metadata(x, {"nz_format": True, "cached": False})
    if native.loaded() is None:  # no C++ hook: PyTorch drops backend entries, as elsewhere
        assert torch._utils.get_tensor_metadata(x) == {}
        return
    assert torch._utils.get_tensor_metadata(x) == {"nz_format": True, "cached": False}
    torch.save({"x": x, "plain": x.clone()}, tmp_path / "ck.pt")
    back = torch.load(tmp_path / "ck.pt")
    assert back["x"].device == torch.device("sim:1") and torch.equal(back["x"].cpu(), x.cpu())
    assert torch._utils.get_tensor_metadata(back["x"]) == {"nz_format": True, "cached": False}
    assert torch._utils.get_tensor_metadata(back["plain"]) == {}


def test_storages_come_from_pytorchs_own_constructor_with_the_cpp_allocator():
    from torchport.device import accelerator_memory

    if not accelerator_memory.installed():
        pytest.skip("no C++ allocator: torchport's Python constructor serves")
    assert "__new__" not in vars(torch.UntypedStorage)  # nothing of PyTorch's replaced
    before = torch.sim.memory_allocated(1)
    s = torch.UntypedStorage(4096, device="sim:1")
    assert s.device == torch.device("sim:1") and torch.sim.memory_allocated(1) == before + 4096
    seq = torch.UntypedStorage([1, 2, 3], device="sim")
    assert torch.empty(0, dtype=torch.uint8, device="sim").set_(seq).cpu().tolist() == [1, 2, 3]
    del s
    assert torch.sim.memory_allocated(1) == before
