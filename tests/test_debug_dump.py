"""Op dumps: stderr levels 1-3, dump directories (manifest + safetensors), filters, CPU mode."""

import json
import subprocess

import pytest
import torch
from safetensors.torch import load_file

import torchport.ops as ops
from tests.helpers import run_python
from torchport.ops import fallback, hooks
from torchport.tools import debug
from torchport.tools.debug.opdump import parse_bytes, parse_range

pytestmark = pytest.mark.tools


@pytest.fixture(autouse=True)
def _quiet():
    old = ops.set_fallback_warn(False)
    yield
    ops.set_fallback_warn(old)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _step(model, device):
    x = torch.randn(3, 4)
    model(x.to(device)).sum().backward()


def _manifest(d):
    lines = [json.loads(x) for x in (d / "manifest.jsonl").read_text().splitlines()]
    return lines[0], lines[1:]


def test_levels_on_stderr(capfd):
    m = _model().to("sim")
    capfd.readouterr()
    with debug.dump(level=1):
        _step(m, "sim")
    err1 = capfd.readouterr().err
    assert "[torchport dump] #" in err1 and "addmm (native)" in err1 and "relu (native)" in err1
    assert "threshold_backward (native)" in err1  # backward ops are device ops too
    assert "stride=" not in err1
    with debug.dump(level=2):
        _step(m, "sim")
    err2 = capfd.readouterr().err
    assert "mat1: tensor float32[3, 4] stride=[4, 1] sim:0" in err2
    assert "-> out0: tensor float32[3, 8]" in err2 and "values=" not in err2
    with debug.dump(level=3, ops="relu"):
        _step(m, "sim")
    err3 = capfd.readouterr().err
    assert "relu (native)" in err3 and "addmm" not in err3
    assert "values=[" in err3
    assert not hooks.ACTIVE and not fallback.SLOW


def test_dump_directory_manifest_and_files(tmp_path, capfd):
    m = _model().to("sim")
    with debug.dump(tmp_path / "d") as d:
        _step(m, "sim")
    assert capfd.readouterr().err == ""  # level 0 with a directory: files only
    head, calls = _manifest(tmp_path / "d")
    assert head["format"] == "torchport-op-dump" and head["device"] == "sim"
    assert [c["index"] for c in calls] == list(range(len(calls))) and d.count == len(calls)
    ops_ = [c["op"] for c in calls]
    assert "addmm" in ops_ and "relu" in ops_ and "threshold_backward" in ops_
    addmm = calls[ops_.index("addmm")]
    assert addmm["path"] == "native" and addmm["depth"] == 0
    names = [a["name"] for a in addmm["inputs"]]
    assert names[:3] == ["self", "mat1", "mat2"]
    mat1 = addmm["inputs"][1]
    assert mat1["shape"] == [3, 4] and mat1["dtype"] == "float32" and mat1["stride"] == [4, 1]
    assert mat1["device"] == "sim:0" and mat1["stats"]["numel"] == 12
    saved = load_file(str(tmp_path / "d" / addmm["file"]))
    assert set(saved) >= {"in.self", "in.mat1", "in.mat2", "out.0"}
    torch.testing.assert_close(saved["out.0"], torch.addmm(saved["in.self"], saved["in.mat1"],
                                                           saved["in.mat2"]))
    # in-place ops keep their input as it was before the call
    with debug.dump(tmp_path / "e"):
        x = torch.ones(3, device="sim")
        x.mul_(2)
    _, calls = _manifest(tmp_path / "e")
    mul = next(c for c in calls if c["op"].startswith("mul"))
    t = load_file(str(tmp_path / "e" / mul["file"]))
    assert t["in.self"].tolist() == [1, 1, 1] and t["out.0"].tolist() == [2, 2, 2]


def test_filters_range_and_max_bytes(tmp_path):
    m = _model().to("sim")
    with debug.dump(tmp_path / "f", ops=["addmm", r"relu.*"]) as d:
        _step(m, "sim")
    _, calls = _manifest(tmp_path / "f")
    assert {c["op"] for c in calls} == {"addmm", "relu"} and d.recorded == len(calls) == 3
    with debug.dump(tmp_path / "r", start=2, end=5):
        _step(m, "sim")
    _, calls = _manifest(tmp_path / "r")
    assert [c["index"] for c in calls] == [2, 3, 4]
    with debug.dump(tmp_path / "b", max_bytes=40):
        _step(m, "sim")
    _, calls = _manifest(tmp_path / "b")
    addmm = next(c for c in calls if c["op"] == "addmm")
    mat1 = addmm["inputs"][1]  # 48 bytes: metadata and statistics only
    assert mat1["key"] is None and "max_bytes" in mat1["skipped"]
    assert set(mat1["stats"]) >= {"min", "max", "mean", "std", "sum", "nan", "inf"}
    assert "in.mat1" not in load_file(str(tmp_path / "b" / addmm["file"]))
    assert addmm["inputs"][0]["key"] == "in.self"  # the 8-byte bias is kept


def test_nested_calls_have_depth_and_parent(tmp_path):
    x = torch.randn(5, device="sim", dtype=torch.float64)
    with debug.dump(tmp_path / "n"):
        torch.logaddexp(x, x)
    _, calls = _manifest(tmp_path / "n")
    top = next(c for c in calls if c["op"] == "logaddexp.out")
    assert top["path"] == "decomposed" and top["depth"] == 0
    inner = [c for c in calls if c["parent"] == top["index"]]
    assert inner and all(c["depth"] == 1 and c["index"] > top["index"] for c in inner)


def test_cpu_dump_same_format(tmp_path):
    m = _model()
    with debug.dump(tmp_path / "c", device="cpu"):
        _step(m, "cpu")
    head, calls = _manifest(tmp_path / "c")
    assert head["device"] == "cpu"
    ops_ = [c["op"] for c in calls]
    assert "addmm" in ops_ and "threshold_backward" in ops_
    c = calls[ops_.index("addmm")]
    assert c["path"] == "cpu" and c["inputs"][1]["device"] == "cpu"
    assert set(load_file(str(tmp_path / "c" / c["file"]))) >= {"in.mat1", "out.0"}
    # device ops inside a CPU dump are not recorded
    with debug.dump(tmp_path / "c2", device="cpu"):
        torch.ones(2, device="sim") + 1
    _, calls = _manifest(tmp_path / "c2")
    assert all(all(a.get("device", "cpu") == "cpu" for a in c["inputs"]) for c in calls)


def test_parse_helpers():
    assert parse_range("10:20") == (10, 20) and parse_range(":5") == (0, 5)
    assert parse_range("7:") == (7, None) and parse_range(None) == (0, None)
    assert parse_bytes("1024") == 1024 and parse_bytes("64KiB") == 65536
    assert parse_bytes("2MB") == 2 << 20
    with pytest.raises(ValueError):
        parse_range("12")


def _quiet_python(code: str, **env: str) -> subprocess.CompletedProcess:
    return run_python(code, timeout=120, TORCHPORT_FALLBACK_WARN="0", **env)


def test_env_variables(tmp_path):
    code = ("import torch, torchport.sim\n"
            "x = torch.randn(2, 3, device='sim')\n"
            "(x * 2).relu().sum()\n")
    r = _quiet_python(code, TORCHPORT_DUMP_OPS="2", TORCHPORT_DUMP_DIR=str(tmp_path / "env"),
             TORCHPORT_DUMP_FILTER=r"mul\..*,relu", TORCHPORT_DUMP_RANGE="0:100")
    assert r.returncode == 0, r.stderr
    assert "mul.Tensor (native)" in r.stderr and "self: tensor float32[2, 3]" in r.stderr
    assert "sum" not in r.stderr
    _, calls = _manifest(tmp_path / "env")
    assert [c["op"] for c in calls] == ["mul.Tensor", "relu"]
    code_cpu = "import torch, torchport.sim\n(torch.ones(2, 3) * 2).relu()\n"
    r = _quiet_python(code_cpu, TORCHPORT_DUMP_CPU="1", TORCHPORT_DUMP_DIR=str(tmp_path / "cpu"))
    assert r.returncode == 0, r.stderr
    head, calls = _manifest(tmp_path / "cpu")
    assert head["device"] == "cpu" and [c["op"] for c in calls][-2:] == ["mul.Tensor", "relu"]
