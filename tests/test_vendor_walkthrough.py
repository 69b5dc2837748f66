"""The vendor contract end to end: the walkthrough backend (examples/vendor_walkthrough/,
written from docs/vendor-guide.md alone: device-only memory, streams as in-order queues,
out= kernels launched through torchport.kernel_api) passes a conformance subset run with
``python -m torchport.tools.conformance --backend``, and the same run fails when a kernel is
wrong; it trains a CNN with BatchNorm and a transformer block to the CPU's numbers
(tests/vendor_training.py, in a worker process: one backend per process, this one has the
sim), bit for bit where its math is the CPU's."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, backend_worker, run_python

BACKEND = "examples.vendor_walkthrough.backend"
OPS = "add|mul|mm|sum"

# The walkthrough with mul.out off by one: what the runner must catch.
BROKEN = f"""
import {BACKEND} as walk

_launch = walk._launch


def _wrong(out, compute, *inputs):
    mul = compute is walk.torch.mul
    _launch(out, (lambda *a: compute(*a) + 1) if mul else compute, *inputs)


walk._launch = _wrong
"""


def _conformance(backend: str, out: Path, extra_path: str = "") -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT / "src"), extra_path, os.environ.get("PYTHONPATH")]))}
    for k in ("TORCHPORT_SIM_STRICT", "TORCHPORT_SIM_ASYNC", "TORCHPORT_AUTOLOAD"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torchport.tools.conformance", "--backend", backend, "--subset",
           "--ops", OPS, "--dtypes", "float32,int64", "--max-samples", "3", "--jobs", "1",
           "--out", str(out), "--quiet"]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_walkthrough_backend_passes_conformance_and_a_wrong_kernel_fails(tmp_path):
    (tmp_path / "broken_walk.py").write_text(BROKEN)
    good = _conformance(BACKEND, tmp_path / "good")
    bad = _conformance("broken_walk", tmp_path / "bad", str(tmp_path))
    good_out, bad_out = good.communicate(timeout=300)[0], bad.communicate(timeout=300)[0]

    assert good.returncode == 0, good_out
    report = json.loads((tmp_path / "good" / "conformance.json").read_text())
    assert report["meta"]["device"] == "walk" and report["meta"]["backend"] == BACKEND
    assert {r["id"]: r["status"] for r in report["results"]} == dict.fromkeys(
        ("add", "mul", "mm", "sum"), "pass")
    paths = report["totals"]["overload_paths"]
    for overload in ("add.Tensor", "mul.Tensor", "mm", "sum.dim_IntList"):
        assert paths[overload] == "native", (overload, paths)  # its kernel ran, no fallback
    md = (tmp_path / "good" / "conformance.md").read_text()
    assert md.startswith("# torchport conformance: walk vs CPU")

    assert bad.returncode == 1, bad_out
    bad_report = json.loads((tmp_path / "bad" / "conformance.json").read_text())
    status = {r["id"]: r["status"] for r in bad_report["results"]}
    assert status["mul"] == "fail" and status["add"] == "pass", status


def test_unknown_backend_is_named():
    p = _conformance("no_such_backend_module", Path("/nonexistent"))
    out = p.communicate(timeout=120)[0]
    assert p.returncode != 0 and "no_such_backend_module" in out, out


class _Minimal:
    """A synchronous runtime with only the abstract methods (memory in host bytearrays)."""

    @staticmethod
    def make():
        import torchport

        class Minimal(torchport.Runtime):
            def device_count(self):
                return 1

            def get_device_properties(self, index):
                return torchport.DeviceProperties(name="minimal", total_memory=1 << 20)

            def malloc(self, index, nbytes):
                return None

            def free(self, index, ptr):
                pass

            def mem_get_info(self, index):
                return (1 << 20, 1 << 20)

            def copy_h2d(self, index, dst, src_host, nbytes, stream=None):
                pass

            copy_d2h = copy_d2d = memset = copy_h2d
        return Minimal()


def test_synchronous_runtime_needs_only_the_abstract_methods():
    import time

    rt = _Minimal.make()
    s = rt.create_stream(0, priority=-1)
    assert s is not None and s is not rt.create_stream(0)
    rt.synchronize(0)
    rt.synchronize_stream(0, s)
    assert rt.query_stream(0, s) and rt.query_stream(0, None)
    start, end = rt.create_event(0, enable_timing=True), rt.create_event(0, enable_timing=True)
    with pytest.raises(RuntimeError, match="recorded"):
        rt.event_elapsed_time(0, start, end)
    rt.record_event(0, start, s)
    time.sleep(0.01)
    rt.record_event(0, end, None)
    rt.stream_wait_event(0, None, end)
    rt.synchronize_event(0, end)
    assert rt.query_event(0, end)
    assert rt.event_elapsed_time(0, start, end) >= 10.0
    plain = rt.create_event(0)
    rt.record_event(0, plain, None)
    with pytest.raises(RuntimeError, match="enable_timing"):
        rt.event_elapsed_time(0, plain, end)
    ran = []
    rt.launch(0, s, lambda: ran.append(1))
    assert ran == [1]  # synchronous: done on return


def test_asynchronous_runtime_must_implement_its_queues():
    base = type(_Minimal.make())
    with pytest.raises(TypeError, match="asynchronous = True.*synchronize_stream"):
        type("Half", (base,), {"asynchronous": True, "launch": lambda *a: None})


def test_kernel_api_on_the_sim():
    """Address (offset included), physical index (visible devices applied), current stream;
    no backend: current_backend() is None."""
    code = """
import torch, torchport
assert torchport.current_backend() is None
import torchport.sim
assert torchport.current_backend() is torchport.active_backend()
t = torch.arange(10.0, device="sim:0")[3:]
assert torchport.device_address(t) == t.untyped_storage().data_ptr() + 12
assert torchport.device_address(t[:0]) == 0
assert torchport.device_index(t) == 1  # TORCHPORT_VISIBLE_DEVICES=1,0
assert torchport.current_stream(t) is None
s = torch.sim.Stream()
with torch.sim.stream(s):
    h = torchport.current_stream(t)
    assert h is not None and h is torchport.active_backend().current_stream_handle(0)
    ran = []
    torchport.launch(t, lambda: ran.append(torch.sim.current_stream() == s))
torch.sim.synchronize()
assert ran == [True] or torchport.active_backend().runtime.asynchronous, ran
try:
    torchport.device_address(torch.ones(2))
except ValueError as e:
    assert "'sim' device" in str(e)
else:
    raise AssertionError("a CPU tensor has no device address")
print("ok")
"""
    env = {**os.environ, "TORCHPORT_VISIBLE_DEVICES": "1,0",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                       os.environ.get("PYTHONPATH")]))}
    env.pop("TORCHPORT_AUTOLOAD", None)
    r = run_python(code, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


# ---- training against the CPU ---------------------------------------------------------------

WORKER = r"""
import json, warnings
import torch
import torchport
import examples.vendor_walkthrough.backend as walk
from tests.helpers import serve
from tests.vendor_training import check

torchport.ops.set_fallback_warn(False)
warnings.simplefilter("ignore", UserWarning)


def fails(patch, undo, *case):
    '''check("walk", *case) with patch() applied raises AssertionError: its message.'''
    patch()
    try:
        check("walk", *case)
    except AssertionError as e:
        return str(e)
    finally:
        undo()
        torch.walk.synchronize()
    raise AssertionError(f"{case} passed on a wrong walkthrough")


serve(dict(globals()), "walk", "<walk test>")
"""


@pytest.fixture(scope="module")
def walk():
    w = backend_worker(WORKER, "walk")
    yield w
    w.close()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("model", ["cnn", "block"])
def test_trains_as_on_the_cpu(walk, model, optimizer, dtype):
    """Losses per step, parameters and BatchNorm's running statistics within the rounding
    of the ops torchport decomposes for the walkthrough (vendor_training.tolerance)."""
    walk.run(f"check('walk', {model!r}, {optimizer!r}, {dtype!r})")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_trains_bit_for_bit_where_its_math_is_the_cpus(walk, dtype):
    """The walkthrough's kernels run the CPU's own ops on the same bytes and the ops it has
    no kernel for run on the CPU fallback, so where no op is decomposed (SGD, and a head
    without bias: no addmm) its CNN trains to exactly the CPU's numbers."""
    walk.run(f"""
    with torchport.ops.record() as rec:
        check("walk", "cnn", "sgd", {dtype!r}, exact=True, head_bias=False)
    ops = json.loads(rec.to_json())["ops"]
    assert not [op for op, row in ops.items() if "decomposed" in row["paths"]], ops
    """)


def test_a_wrong_walkthrough_fails_the_comparison(walk):
    """The comparison catches what makes training silently wrong: a matmul off by 1e-4
    relative, and BatchNorm's running statistics never written on the device
    (the walkthrough as it once was: only the buffers show it)."""
    messages = walk.run("""
    launch, batch_norm = walk._launch, torch.nn.functional.batch_norm

    def off(out, compute, *inputs):
        wrong = (lambda *a: compute(*a) * (1 + 1e-4)) if compute is torch.mm else compute
        launch(out, wrong, *inputs)

    def lost(x, mean, var, *args, **kwargs):  # updates copies of the statistics
        if x.device.type == "walk":
            mean, var = mean.clone(), var.clone()
        return batch_norm(x, mean, var, *args, **kwargs)

    result = [fails(lambda: setattr(walk, "_launch", off),
                    lambda: setattr(walk, "_launch", launch), "cnn", "sgd"),
              fails(lambda: setattr(torch.nn.functional, "batch_norm", lost),
                    lambda: setattr(torch.nn.functional, "batch_norm", batch_norm), "cnn",
                    "adamw")]
    """)
    assert "not close" in messages[0], messages[0]
    assert "running_mean" in messages[1], messages[1]
