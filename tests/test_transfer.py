"""Runtime transfer: unmodified CUDA code on the sim device (torchport.transfer, torchport run).

Transfer patches global torch state, so every test enables it through the ``xfer``
fixture, which disables it again; examples run in-process under the fixture, and
only what needs a fresh interpreter (env var, DDP ranks) runs in subprocesses.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import runpy
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

from tests.helpers import child_env, example_values, free_port, run_gloo_reference, save_as_cuda

pytestmark = pytest.mark.tools

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "cuda"
_ORIG_ZEROS = torch.zeros
_ORIG_CUDA_AVAILABLE = torch.cuda.is_available
_ORIG_TO, _ORIG_TENSOR = torch.Tensor.to, torch.tensor  # PyTorch's own


@pytest.fixture
def argv_path(monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))


def _run_example(name: str, args: list[str], capsys, transfer: bool) -> dict[str, str]:
    script = str(EXAMPLES / name)
    if transfer:
        from torchport.tools.run import run_script

        run_script(script, args)
    else:
        sys.argv = [script, *args]
        runpy.run_path(script, run_name="__main__")
    return example_values(capsys.readouterr().out)


# ---- device naming -----------------------------------------------------------------
def test_torch_device_objects(xfer):
    assert torch.device("cuda") == torch.device("sim")
    assert torch.device("cuda:1") == torch.device("sim", 1)
    assert torch.device("cuda", 1) == torch.device("sim:1")
    assert torch.device(type="cuda", index=1) == torch.device("sim:1")
    assert torch.device("cpu").type == "cpu" and torch.device(1) == torch.device("sim:1")
    d = torch.device("cuda:1")
    assert isinstance(d, torch.device) and type(d) is torch._C.device
    assert issubclass(torch._C.device, torch.device)
    assert not isinstance("cuda", torch.device)
    assert pickle.loads(pickle.dumps(d)) == d
    with torch.device("cuda:1"):
        assert torch.ones(2).device == torch.device("sim:1")


def test_generators_on_cuda(xfer):
    """``torch.Generator(device="cuda")`` (diffusers' pipelines, seeded sampling) is a device
    generator that draws what the device's default generator draws after the same seed."""
    for make in (lambda: torch.Generator(device="cuda"), lambda: torch.Generator("cuda:1"),
                 lambda: torch.Generator(device=torch.device("cuda", 1))):
        g = make().manual_seed(7)
        assert isinstance(g, torch.Generator) and type(g) is torch._C.Generator
        assert g.device.type == "sim"
        got = torch.randn(5, generator=g, device=g.device)
        torch.manual_seed(7)
        assert torch.equal(got.cpu(), torch.randn(5, device=g.device).cpu())
    assert torch.Generator(device="cuda:1").device == torch.device("sim:1")
    assert torch.Generator().device.type == "cpu"
    assert issubclass(torch._C.Generator, torch.Generator)
    g = torch.Generator("cuda").manual_seed(3)
    assert pickle.loads(pickle.dumps(g)).initial_seed() == 3


def test_factories_inside_compiled_code(xfer):
    """A factory naming a device inside a compiled function (nanoGPT's ``torch.arange(...,
    device=idx.device)``) traces without a graph break: the whole forward would run eagerly.
    torchport's own modules are skipped by dynamo, transfer's stand-ins are not."""
    from torch._dynamo import trace_rules

    import torchport.ops.fallback
    import torchport.transfer

    assert trace_rules.check_file(torchport.ops.fallback.__file__).skipped
    assert not trace_rules.check_file(torchport.transfer.mapping.__file__).skipped

    @torch.compile(backend="eager", fullgraph=True)
    def f(x: torch.Tensor) -> torch.Tensor:
        return (x + torch.arange(x.shape[0], device=x.device)
                + torch.ones(x.shape[0], device="cuda") + torch.zeros(1, device="cuda:0"))

    x = torch.ones(3, device="cuda")
    assert torch.equal(f(x).cpu(), torch.tensor([2.0, 3.0, 4.0]))


def test_stand_ins_keep_what_torch_reads_of_the_originals(xfer):
    """Dynamo (torch 2.14+) reads ``torch.cuda.use_mem_pool.__wrapped__`` at import: a
    ``torch.cuda`` function replaced by transfer (forwarded or refused) keeps the original's
    name and ``__wrapped__``."""
    import inspect

    for name in ("use_mem_pool", "synchronize", "current_device"):
        fn = torch.cuda.__dict__[name]
        assert fn.__name__ == name and callable(fn.__wrapped__)
        assert inspect.unwrap(fn).__module__.startswith("torch.cuda")
    with pytest.raises(xfer.TransferError, match="memory pools"):
        torch.cuda.use_mem_pool(None)


def test_factories_and_ordinals(xfer):
    for spec, want in [("cuda", "sim:0"), ("cuda:1", "sim:1"), (torch.device("cuda", 1), "sim:1"),
                       (1, "sim:1"), (torch.device("cuda"), "sim:0")]:
        for t in (torch.zeros(2, device=spec), torch.ones(2, 3, device=spec),
                  torch.empty(3, device=spec), torch.randn(2, device=spec),
                  torch.tensor([1.0, 2.0], device=spec), torch.arange(4, device=spec),
                  torch.full((2,), 7.0, device=spec), torch.eye(2, device=spec),
                  torch.linspace(0, 1, 3, device=spec), torch.randint(0, 5, (3,), device=spec),
                  torch.as_tensor([1, 2], device=spec),
                  torch.zeros_like(torch.ones(2), device=spec),
                  torch.rand_like(torch.ones(2), device=spec)):
            assert str(t.device) == want, (spec, t.device)
    assert torch.arange(5, device="cuda").cpu().tolist() == list(range(5))


def test_tensor_methods(xfer):
    x = torch.arange(6.0).reshape(2, 3)
    assert x.cuda().device == torch.device("sim:0")
    assert x.cuda(1).device == torch.device("sim:1")
    assert x.cuda("cuda:1").device == torch.device("sim:1")
    assert x.cuda(torch.device("cuda", 1)).device == torch.device("sim:1")
    y = x.to("cuda:1", torch.float64, non_blocking=True)
    assert y.device == torch.device("sim:1") and y.dtype == torch.float64
    assert torch.equal(x.to(device="cuda").cpu(), x)
    assert x.new_zeros(2, device="cuda").device.type == "sim"
    assert x.new_tensor([1.0], device="cuda:1").device == torch.device("sim:1")
    assert x.cuda().is_cuda and not x.is_cuda
    torch.cuda.set_device(1)
    assert x.cuda().device == torch.device("sim:1")
    # a device without an index is the current one, as on CUDA (Tensor.to asks the C++
    # device guard, whose Python version answers 0)
    for spec in ("cuda", torch.device("cuda"), "sim"):
        assert x.to(spec).device == torch.device("sim:1")
        assert x.to(device=spec, dtype=torch.float64).device == torch.device("sim:1")
        assert torch.nn.Linear(2, 2).to(spec).weight.device == torch.device("sim:1")
    assert x.to("cuda:0").device == torch.device("sim:0")
    assert x.pin_memory().is_pinned() in (True, False)
    assert torch.equal(x.pin_memory(), x)


def test_module_cuda_and_to(xfer):
    m = torch.nn.Linear(3, 2)
    assert m.cuda().weight.device == torch.device("sim:0")
    assert m.cuda(1).weight.device == torch.device("sim:1")
    assert m.to("cuda:0").weight.device == torch.device("sim:0")
    assert m.to(torch.device("cuda", 1), dtype=torch.float64).bias.device == torch.device("sim:1")
    assert m.to("cpu").weight.device.type == "cpu"
    assert torch.nn.Linear(2, 2, device="cuda").weight.device.type == "sim"
    assert m.to_empty(device="cuda").weight.device.type == "sim"


# ---- torch.cuda ----------------------------------------------------------------------
def test_torch_cuda_api(xfer):
    c = torch.cuda
    assert c.is_available() and c.device_count() == torch.sim.device_count()
    c.set_device("cuda:1")
    assert c.current_device() == 1
    c.set_device(0)
    with c.device(1):
        assert torch.zeros(1, device="cuda").device == torch.device("sim:1")
    assert c.current_device() == 0
    c.synchronize()
    c.synchronize("cuda:1")
    x = torch.ones(1024, device="cuda")
    assert c.memory_allocated() >= 4096 and c.max_memory_allocated(0) >= 4096
    assert c.memory_reserved() >= c.memory_allocated() and c.memory_cached() == c.memory_reserved()
    assert "memory summary" in c.memory_summary()
    assert c.get_device_properties(0).name == c.get_device_name()
    assert not c.is_current_stream_capturing()
    del x
    c.empty_cache()
    c.manual_seed(5)
    a = torch.randn(4, device="cuda")
    state = c.get_rng_state()
    b = torch.randn(4, device="cuda")
    c.set_rng_state(state)
    assert torch.equal(torch.randn(4, device="cuda").cpu(), b.cpu())
    c.manual_seed(5)
    assert torch.equal(torch.randn(4, device="cuda").cpu(), a.cpu())
    with torch.random.fork_rng(devices=[0], device_type="cuda"):
        torch.randn(4, device="cuda")
    assert torch.equal(torch.randn(4, device="cuda").cpu(), b.cpu())


def test_torch_cuda_streams_events(xfer):
    if getattr(torch.sim, "Stream", None) is None:
        with pytest.raises(xfer.TransferError, match=r"torch\.cuda\.Stream"):
            torch.cuda.Stream()
        return
    s = torch.cuda.Stream()
    assert isinstance(s, torch.cuda.Stream) and isinstance(torch.cuda.current_stream(), torch.cuda.Stream)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    with torch.cuda.stream(s):
        y = torch.ones(8, device="cuda") * 2
    end.record()
    torch.cuda.current_stream().wait_stream(s)
    end.synchronize()
    assert start.elapsed_time(end) >= 0 and y.sum().item() == 16


def test_amp_mapping(xfer):
    from torchport.transfer import amp as transfer_amp

    m = torch.nn.Linear(4, 4).cuda()
    x = torch.randn(2, 4, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for ctx in (torch.autocast("cuda"), torch.autocast(device_type="cuda", dtype=torch.float16),
                    torch.amp.autocast("cuda"), torch.cuda.amp.autocast()):
            with ctx:
                assert torch.is_autocast_enabled() == torch.is_autocast_enabled("cuda")
                y = m(x)
            if transfer_amp._amp_works():
                assert y.dtype == torch.float16
        with torch.cuda.amp.autocast(enabled=False):
            assert m(x).dtype == torch.float32
    for scaler in (torch.cuda.amp.GradScaler(), torch.amp.GradScaler("cuda"), torch.amp.GradScaler(),
                   torch.cuda.amp.GradScaler(init_scale=8.0)):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        scaler.scale(m(x).float().sum()).backward()
        scaler.step(opt)
        scaler.update()
        assert scaler.get_scale() > 0


def test_unsupported_classes_stay_classes(xfer):
    """Library code annotates with them (``torch.cuda.CUDAGraph | None`` in transformers),
    subclasses and isinstance-checks them; only making one raises."""
    for name in ("CUDAGraph", "graph", "MemPool", "CUDAPluggableAllocator", "ExternalStream"):
        cls = getattr(torch.cuda, name)
        assert isinstance(cls, type), name
        assert (cls | None) is not None and not isinstance(object(), cls)

        class Sub(cls):  # a library's own subclass is defined at import
            pass

        with pytest.raises(xfer.TransferError, match=rf"torch\.cuda\.{name}"):
            Sub()
    ns: dict = {}
    exec("import torch\ndef f() -> torch.cuda.CUDAGraph | None: ...", ns)
    assert ns["f"]() is None


def test_unsupported_apis_are_named(xfer):
    with pytest.raises(xfer.TransferError, match=r"torch\.cuda\.CUDAGraph"):
        torch.cuda.CUDAGraph()
    with pytest.raises(xfer.TransferError, match=r"torch\.cuda\.graph"):
        torch.cuda.graph(None)
    with pytest.raises(xfer.TransferError, match=r"make_graphed_callables"):
        torch.cuda.make_graphed_callables(lambda x: x, (torch.ones(1),))
    with pytest.raises(xfer.TransferError, match=r"jiterator"):
        torch.cuda.jiterator._create_jit_fn("template <typename T> T f(T x) { return x; }")
    import torch.utils.cpp_extension as cpp

    with pytest.raises(xfer.TransferError, match=r"cpp_extension\.load"):
        cpp.load("ext", ["kernel.cu"])
    with pytest.raises(xfer.TransferError, match=r"CUDAExtension"):
        cpp.CUDAExtension("ext", ["k.cu"])
    with pytest.warns(RuntimeWarning, match=r"torch\.cuda\.nvtx") as rec:
        torch.cuda.nvtx.range_push("step")
        torch.cuda.nvtx.range_pop()
        with torch.cuda.nvtx.range("fwd"):
            pass
    assert len([w for w in rec if "nvtx" in str(w.message)]) == 1


def test_cudnn_flags_harmless(xfer):
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    assert torch.zeros(1, device="cuda").device.type == "sim"
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = False


def test_dataloader_pin_memory(xfer):
    from torch.utils.data import DataLoader, TensorDataset

    ds = TensorDataset(torch.arange(8.0).reshape(4, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loader = DataLoader(ds, batch_size=2, pin_memory=True, pin_memory_device="cuda")
        out = [b[0].to("cuda", non_blocking=True).sum().item() for b in loader]
    assert out == [6.0, 22.0]


def test_init_process_group_nccl(xfer, tmp_path):
    import torch.distributed as dist

    if "simccl" not in dist.Backend.backend_list:
        with pytest.raises(xfer.TransferError, match="nccl"):
            dist.init_process_group("nccl", init_method=f"file://{tmp_path}/s", rank=0,
                                    world_size=1)
        return
    assert dist.is_nccl_available()
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/s", rank=0, world_size=1)
    try:
        assert dist.get_backend() == "simccl"
        t = torch.ones(3, device="cuda")
        dist.all_reduce(t)
        assert t.cpu().tolist() == [1.0, 1.0, 1.0]
    finally:
        dist.destroy_process_group()


# ---- checkpoints ---------------------------------------------------------------------
def test_cuda_checkpoint_map_location_forms(xfer):
    w = torch.arange(6.0).reshape(2, 3)
    buf = io.BytesIO()
    save_as_cuda({"w": w.to("sim:0"), "b": torch.ones(2, device="sim:1")}, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        pkl = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    assert b"cuda:0" in pkl and b"cuda:1" in pkl and b"sim" not in pkl

    def load(ml):
        return torch.load(io.BytesIO(buf.getvalue()), map_location=ml)

    cases = [(None, "sim:0", "sim:1"), ("cuda", "sim", "sim"), ("cuda:1", "sim:1", "sim:1"),
             (torch.device("cuda", 1), "sim:1", "sim:1"), ("cpu", "cpu", "cpu"),
             ({"cuda:0": "cuda:1", "cuda:1": "cuda:0"}, "sim:1", "sim:0"),
             ({"cuda:0": "cpu"}, "cpu", "sim:1"),
             (lambda s, loc: s.cuda(1), "sim:1", "sim:1"),
             (lambda s, loc: s, "cpu", "cpu"),
             (lambda s, loc: None, "sim:0", "sim:1")]
    for ml, dw, db in cases:
        sd = load(ml)
        assert sd["w"].device == torch.device(dw) or str(sd["w"].device) == dw + ":0", (ml, sd["w"].device)
        assert sd["b"].device == torch.device(db) or str(sd["b"].device) == db + ":0", (ml, sd["b"].device)
        assert torch.equal(sd["w"].cpu(), w) and torch.equal(sd["b"].cpu(), torch.ones(2))
    sd = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    assert sd["w"].device == torch.device("sim:0")


# ---- reversibility, idempotence, CPU code --------------------------------------------
def test_disable_restores_everything(xfer):
    registry_len = len(torch.serialization._package_registry)
    xfer.disable()
    assert torch.device is torch._C.device and torch.Generator is torch._C.Generator
    assert torch.zeros is _ORIG_ZEROS and torch.cuda.is_available is _ORIG_CUDA_AVAILABLE
    assert torch.Tensor.to is _ORIG_TO and torch.tensor is _ORIG_TENSOR
    assert "cuda" not in vars(torch.Tensor)
    assert "is_cuda" not in vars(torch.Tensor)
    assert torch.autocast is torch.amp.autocast_mode.autocast
    assert torch._C.device not in copyreg.dispatch_table
    assert len(torch.serialization._package_registry) == registry_len - 1
    assert not xfer.is_enabled()
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")
    assert torch.cuda.is_available() is False
    xfer.enable()
    assert torch.zeros(1, device="cuda").device.type == "sim"


def test_enable_is_idempotent(xfer):
    n = len(xfer._S.patches)
    xfer.enable()
    xfer.enable()
    assert len(xfer._S.patches) == n
    assert torch.zeros.__torchport_original__ is _ORIG_ZEROS


def _cpu_work() -> tuple[float, str, bool]:
    torch.manual_seed(3)
    m = torch.nn.Linear(5, 1)
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    x = torch.randn(16, 5).to("cpu")
    for _ in range(5):
        opt.zero_grad()
        loss = m(x).pow(2).mean()
        loss.backward()
        opt.step()
    t = torch.zeros(2, device="cpu")
    return loss.item(), str(t.device), t.is_cuda


def test_cpu_code_untouched(xfer):
    with_transfer = _cpu_work()
    xfer.disable()
    without = _cpu_work()
    xfer.enable()
    assert with_transfer == without and with_transfer[1:] == ("cpu", False)
    assert torch.device("cpu:0").index == 0 and torch.device("meta").type == "meta"


# ---- realistic scripts ---------------------------------------------------------------
def test_example_train_argparse(xfer, capsys, argv_path):
    args = ["--epochs", "2", "--batch-size", "64"]
    dev = _run_example("train_argparse.py", args, capsys, transfer=True)
    xfer.disable()
    cpu = _run_example("train_argparse.py", [*args, "--cpu"], capsys, transfer=False)
    assert dev.keys() >= {"final loss", "params checksum"}
    assert float(dev["final loss"]) == pytest.approx(float(cpu["final loss"]), rel=1e-4, abs=1e-5)
    assert float(dev["params checksum"]) == pytest.approx(float(cpu["params checksum"]),
                                                          rel=1e-4, abs=1e-4)


def test_example_train_amp(xfer, capsys, argv_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dev = _run_example("train_amp.py", ["--steps", "4"], capsys, transfer=True)
        xfer.disable()
        cpu = _run_example("train_amp.py", ["--steps", "4", "--cpu"], capsys, transfer=False)
    assert dev["autocast dtype"] == ("torch.float16" if xfer._S.amp_ok is not False
                                     else "torch.float32")
    assert float(dev["final loss"]) == pytest.approx(float(cpu["final loss"]), rel=2e-2)


def test_example_infer_checkpoint(xfer, capsys, argv_path, tmp_path):
    ns = runpy.run_path(str(EXAMPLES / "infer_checkpoint.py"), run_name="not_main")
    torch.manual_seed(0)
    model = ns["Classifier"]().to("sim:0")
    path = tmp_path / "model.pt"
    save_as_cuda({"model": model.state_dict(), "epoch": 7}, path)
    dev = _run_example("infer_checkpoint.py", [str(path)], capsys, transfer=True)
    xfer.disable()
    cpu = _run_example("infer_checkpoint.py", [str(path), "--cpu"], capsys, transfer=False)
    assert dev["loaded epoch"].startswith("7 on sim")
    assert dev["predictions"] == cpu["predictions"]
    assert float(dev["probs checksum"]) == pytest.approx(float(cpu["probs checksum"]), rel=1e-5)


def test_cli_register_run_command(xfer, capsys, argv_path, tmp_path):
    typer = pytest.importorskip("typer")
    from typer.testing import CliRunner

    from torchport.tools.run import register

    script = tmp_path / "s.py"
    script.write_text("import sys, torch\n"
                      "print('ARGV', sys.argv[1:], __name__, torch.ones(1, device='cuda').device)\n")
    app = typer.Typer()
    register(app)

    @app.command("other")
    def other() -> None:  # a second command, as in the real CLI
        pass

    res = CliRunner().invoke(app, ["run", "--backend", "sim", str(script), "--lr", "1", "x"])
    assert res.exit_code == 0, res.output
    assert "ARGV ['--lr', '1', 'x'] __main__ sim:0" in res.output


def test_env_var_and_ddp_subprocesses():
    """TORCHPORT_TRANSFER=1 and 2-rank DDP over "nccl" need fresh interpreters; so does the
    CPU/gloo reference (:func:`tests.helpers.run_gloo_reference`)."""
    procs = [subprocess.Popen(
        [sys.executable, "-c", "import torch, torchport.sim\n"
         "print(torch.cuda.is_available(), torch.zeros(1, device='cuda:1').device)"],
        env=child_env(importable=True, TORCHPORT_TRANSFER="1"), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True)]
    import torch.distributed as dist

    ddp = "simccl" in dist.Backend.backend_list
    if ddp:
        port = str(free_port())
        for r in (0, 1):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "torchport.tools.run", str(EXAMPLES / "ddp_nccl.py"),
                 "--steps", "6"],
                env=child_env(importable=True, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    assert outs[0][0].strip() == "True sim:1"
    if not ddp:
        pytest.skip("no simccl distributed backend")
    dev = example_values(outs[1][0])
    assert dev["world size"] == "2 backend simccl"
    cpu = example_values(run_gloo_reference(EXAMPLES / "ddp_nccl.py", ["--steps", "6", "--cpu"],
                                      ROOT))
    assert float(dev["params checksum"]) == pytest.approx(float(cpu["params checksum"]), abs=1e-4)
