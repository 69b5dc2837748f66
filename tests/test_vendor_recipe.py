"""The discrete-memory recipe of docs/vendor-guide.md (examples/discrete_recipe/backend.py:
device-only memory, a worker thread per stream, three kernels) passes the suites a backend
must pass: the stream-order sweep, the sweep of written arguments, a conformance subset, and
a BatchNorm CNN trained with SGD momentum as on the CPU. Each runs in a child interpreter
(one backend per process), the four at once."""

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT, child_env

pytestmark = pytest.mark.vendor

BACKEND = "examples.discrete_recipe.backend"
OPS = ("add|sub|mul|div.no_rounding_mode|matmul|sum|mean|cat|where|index_put|"
       "nn.functional.(conv2d|relu|max_pool2d|cross_entropy)")

CNN = f"""
import copy
import torch
import {BACKEND}

torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, bias=False), torch.nn.BatchNorm2d(4),
                          torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten(),
                          torch.nn.Linear(36, 3))
gen = torch.Generator().manual_seed(1)
data = [(torch.randn(8, 3, 8, 8, generator=gen), torch.randint(0, 3, (8,), generator=gen))
        for _ in range(3)]
models = {{d: copy.deepcopy(net).to(d) for d in ("cpu", "recipe")}}
opts = {{d: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for d, m in models.items()}}
losses = {{d: [] for d in models}}
for x, y in data:
    for d, m in models.items():
        opts[d].zero_grad()
        loss = torch.nn.functional.cross_entropy(m(x.to(d)), y.to(d))
        loss.backward()
        opts[d].step()
        losses[d].append(loss.item())
assert losses["recipe"] == losses["cpu"], losses
want, got = models["cpu"].state_dict(), models["recipe"].state_dict()
assert got["1.running_mean"].abs().sum().item() > 0  # the statistics were updated
for k in want:  # the kernels are the CPU's on the device's memory: bit for bit
    assert torch.equal(got[k].cpu(), want[k]), k
for m in models.values():
    m.eval()
assert torch.equal(models["recipe"](data[0][0].to("recipe")).cpu(), models["cpu"](data[0][0]))
print("cnn ok")
"""


def _start(args: list[str]) -> subprocess.Popen:
    env = child_env(drop=("TORCHPORT_SIM_ASYNC", "TORCHPORT_SIM_STRICT", "TORCHPORT_AUTOLOAD"),
                    importable=True, OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_the_recipe_passes_the_suites(tmp_path):
    runs = {
        "stream order": _start(["-m", "tests.stream_order_sweep", BACKEND, "-n", "4096"]),
        "mutations": _start(["-m", "tests.mutation_sweep", BACKEND]),
        "conformance": _start(["-m", "torchport.tools.conformance", "--backend", BACKEND,
                               "--subset", "--ops", OPS, "--dtypes", "float32,int64",
                               "--jobs", "1", "--out",
                               str(tmp_path), "--quiet"]),
        "cnn": _start(["-c", CNN]),
    }
    out = {name: p.communicate(timeout=300)[0] for name, p in runs.items()}
    for name, p in runs.items():
        assert p.returncode == 0, (name, out[name][-3000:])
    for sweep in ("stream order", "mutations"):
        assert "MISMATCH" not in out[sweep] and "checked " in out[sweep], out[sweep][-3000:]
    assert "cnn ok" in out["cnn"], out["cnn"][-3000:]
    report = json.loads((tmp_path / "conformance.json").read_text())
    assert report["meta"]["device"] == "recipe"
    status = {r["id"]: r["status"] for r in report["results"]}
    assert len(status) >= 10 and set(status.values()) == {"pass"}, status
    paths = report["totals"]["overload_paths"]
    for overload in ("add.Tensor", "mul.Tensor", "copy_"):
        assert paths[overload] == "native", (overload, paths)  # the recipe's kernels ran
