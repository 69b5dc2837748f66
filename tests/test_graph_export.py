"""Exported programs on the device: ``torch.export.export`` of a model on the sim, Core
ATen decompositions, ``torch.export.save``/``load`` and ``.module()(x)``, every op native
(``torchport.ops.record()``), equal to eager and the CPU bit for bit; and
``torchport.graph.export.load(f, device)`` onto a device the program was not saved from.
"""

from __future__ import annotations

import io
import textwrap
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.export.pt2_archive._package import PT2ArchiveReader, PT2ArchiveWriter

import torchport.graph
from tests.helpers import check_python
from torchport import ops

pytestmark = pytest.mark.modes


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():  # pytree's LeafSpec deprecation, from torch.export
        warnings.simplefilter("ignore", FutureWarning)
        yield


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.pool, self.fc = nn.MaxPool2d(2), nn.Linear(8 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.bn(self.conv(x))))
        return torch.log_softmax(self.fc(x.flatten(1)), -1)


class Block(nn.Module):
    """A pre-norm transformer block: attention (scaled_dot_product_attention), GELU MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(16), nn.LayerNorm(16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class Positions(nn.Module):
    """A device written into the graph (``torch.arange(..., device=x.device)``) and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("bias", torch.arange(4.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + self.bias + torch.arange(x.shape[0], device=x.device)[:, None]


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "mlp": (_mlp, (3, 8)), "cnn": (CNN, (2, 3, 8, 8)), "block": (Block, (2, 5, 16)),
}


def _export(model: nn.Module, x: torch.Tensor, **kw) -> torch.export.ExportedProgram:
    return torch.export.export(model, (x,), **kw).run_decompositions()  # Core ATen


def _name(op: torch._ops.OpOverload) -> str:
    """The op statistics' name of an overload (``add.Tensor``, ``relu``)."""
    base = op._schema.name.split("::")[1]
    return base if op._overloadname == "default" else f"{base}.{op._overloadname}"


def _run_native(ep: torch.export.ExportedProgram, x: torch.Tensor) -> torch.Tensor:
    """``ep.module()(x)`` on the device: every op of the graph runs a device kernel
    (native) or is a view, none falls back to the CPU."""
    graph_ops = {n.target for n in ep.graph.nodes if n.op == "call_function"
                 and isinstance(n.target, torch._ops.OpOverload)}  # not getitem
    assert all(torch.Tag.core in op.tags for op in graph_ops), graph_ops
    with ops.record() as rec:
        y = ep.module()(x)
    paths = {name: set(s.paths) for name, s in rec.ops.items()}
    assert all(p <= {"native", "view"} for p in paths.values()), paths
    assert {_name(op) for op in graph_ops} - {"as_strided"} <= set(paths), paths
    return y


@pytest.mark.parametrize("name", sorted(MODELS))
def test_export_save_load_run_natively(name: str, tmp_path: Path) -> None:
    make, shape = MODELS[name]
    cpu = make().eval()
    model = make().eval().to("sim")
    model.load_state_dict(cpu.state_dict())
    x = torch.randn(shape)
    ep = _export(model, x.to("sim"))
    torch.export.save(ep, tmp_path / "m.pt2")
    loaded = torch.export.load(tmp_path / "m.pt2")
    assert all(t.device == torch.device("sim", 0) for t in loaded.state_dict.values())
    y = _run_native(loaded, x.to("sim"))
    assert y.device == torch.device("sim", 0)
    # the same program on the CPU, bit for bit
    assert torch.equal(y.detach().cpu(), _export(cpu, x).module()(x).detach())
    eager = model(x.to("sim")).detach().cpu()  # with gradients: no fused inference path
    assert torch.equal(eager, cpu(x).detach())
    if name == "block":  # eager attention is one fused kernel; the program, its decomposition
        torch.testing.assert_close(y.detach().cpu(), eager)
    else:
        assert torch.equal(y.detach().cpu(), eager)


def test_on_the_second_device_and_moved(tmp_path: Path) -> None:
    cpu = Positions()
    model = Positions().to("sim:1")
    model.load_state_dict(cpu.state_dict())
    x = torch.randn(3, 4)
    want = cpu(x).detach()
    torch.export.save(_export(model, x.to("sim:1")), tmp_path / "m.pt2")
    loaded = torch.export.load(tmp_path / "m.pt2")
    y = _run_native(loaded, x.to("sim:1"))
    assert y.device == torch.device("sim", 1) and torch.equal(y.detach().cpu(), want)
    assert torch.sim.current_device() == 0
    moved = torchport.graph.export.load(tmp_path / "m.pt2", device="sim:0")
    assert {t.device for t in moved.state_dict.values()} == {torch.device("sim", 0)}
    assert moved.example_inputs[0][0].device == torch.device("sim", 0)
    y = _run_native(moved, x.to("sim:0"))
    assert y.device == torch.device("sim", 0) and torch.equal(y.detach().cpu(), want)
    # a program exported on the CPU, loaded onto the device
    torch.export.save(_export(cpu, x), tmp_path / "cpu.pt2")
    on_sim = torchport.graph.export.load(tmp_path / "cpu.pt2", device="sim:1")
    y = _run_native(on_sim, x.to("sim:1"))
    assert y.device == torch.device("sim", 1) and torch.equal(y.detach().cpu(), want)
    # a mapping moves the devices it names only
    back = torchport.graph.export.load(tmp_path / "m.pt2", device={"sim:0": "cpu"})
    assert {t.device for t in back.state_dict.values()} == {torch.device("sim", 1)}


def test_dynamic_batch(tmp_path: Path) -> None:
    cpu = _mlp()
    model = _mlp().to("sim")
    model.load_state_dict(cpu.state_dict())
    batch = torch.export.Dim("batch")
    ep = _export(model, torch.randn(3, 8, device="sim"), dynamic_shapes=({0: batch},))
    torch.export.save(ep, tmp_path / "m.pt2")
    loaded = torch.export.load(tmp_path / "m.pt2").module()
    for n in (1, 7):
        x = torch.randn(n, 8)
        assert torch.equal(loaded(x.to("sim")).detach().cpu(), cpu(x).detach())


def _save_as_cuda(ep: torch.export.ExportedProgram) -> io.BytesIO:
    """What ``torch.export.save`` writes for this program on a CUDA machine: the devices
    of the graph and the weights ``cuda``, the example inputs' storages tagged ``cuda:0``."""
    entry = (0, lambda s: f"cuda:{s.device.index}" if s.device.type == "sim" else None,
             lambda s, loc: None)
    saved = io.BytesIO()
    torch.serialization._package_registry.insert(0, entry)
    try:
        torch.export.save(ep, saved)
    finally:
        torch.serialization._package_registry.remove(entry)
    saved.seek(0)
    reader, out = PT2ArchiveReader(saved), io.BytesIO()
    with PT2ArchiveWriter(out) as writer:
        for name in reader.get_file_names():
            if not name.startswith(".data/"):
                data = reader.read_bytes(name)
                if name.endswith(".json"):
                    data = data.replace(b'{"type": "sim"', b'{"type": "cuda"')
                writer.write_bytes(name, data)
    assert b'"cuda"' in PT2ArchiveReader(io.BytesIO(out.getvalue())).read_bytes(
        "models/model.json")
    return out


def test_a_program_exported_on_cuda_loads_onto_the_device() -> None:
    cpu = Positions()
    model = Positions().to("sim")
    model.load_state_dict(cpu.state_dict())
    x = torch.randn(3, 4)
    archive = _save_as_cuda(_export(model, x.to("sim"))).getvalue()
    with pytest.raises(Exception):  # noqa: B017  (PyTorch's own: no CUDA in this build)
        torch.export.load(io.BytesIO(archive))
    loaded = torchport.graph.export.load(io.BytesIO(archive), device={"cuda:0": "sim:1"})
    y = _run_native(loaded, x.to("sim:1"))
    assert y.device == torch.device("sim", 1) and torch.equal(y.detach().cpu(), cpu(x).detach())


def test_load_onto_a_missing_device_is_named(tmp_path: Path) -> None:
    torch.export.save(_export(_mlp().to("sim"), torch.randn(2, 8, device="sim")),
                      tmp_path / "m.pt2")
    with pytest.raises(torch.AcceleratorError, match="invalid device ordinal 7"):
        torchport.graph.export.load(tmp_path / "m.pt2", device="sim:7")
    with pytest.raises(RuntimeError, match="Invalid device string"):
        torchport.graph.export.load(tmp_path / "m.pt2", device="sim:x")


def test_saved_on_a_device_this_machine_lacks(tmp_path: Path) -> None:
    model = Positions().to("sim:1")
    x = torch.randn(3, 4)
    torch.export.save(_export(model, x.to("sim:1")), tmp_path / "m.pt2")
    torch.save((x, model(x.to("sim:1")).detach().cpu()), tmp_path / "io.pt")
    code = textwrap.dedent(f"""
        import logging, torch, torchport.sim, torchport.graph
        logging.disable(logging.WARNING)
        x, want = torch.load({str(tmp_path / "io.pt")!r})
        assert torch.sim.device_count() == 1
        try:  # PyTorch's own load recreates the weights on sim:1
            torch.export.load({str(tmp_path / "m.pt2")!r})
            raise AssertionError("loaded onto a missing device")
        except RuntimeError as e:
            assert "deserializing" in str(e), e
        ep = torchport.graph.export.load({str(tmp_path / "m.pt2")!r}, device="sim")
        y = ep.module()(x.to("sim"))
        assert y.device == torch.device("sim", 0) and torch.equal(y.detach().cpu(), want)
        print("ok")
    """)
    assert "ok" in check_python(code, TORCHPORT_SIM_DEVICES="1")
