"""Tests for the offline CUDA -> torchport migration tool (``torchport migrate``).

They never import torch or torchport.sim: the tool must work without either.
"""

from __future__ import annotations

import ast
import csv
import os
import sys
import textwrap
import types
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from torchport.tools.migrate import (
    TORCH_BACKEND_MIRROR_APIS,
    Backend,
    BackendSpecError,
    MigrationError,
    migrate_path,
    migrate_source,
    rewrite_source,
)
from torchport.tools.migrate.cli import register

pytestmark = pytest.mark.tools

DATA = Path(__file__).parent / "data" / "migrate"
BACKEND_IMPORT = 'import torchport.sim  # noqa: F401  registers the "sim" device\n'


def body(code: str) -> str:
    """Migrate ``import torch`` + ``code`` and return what follows the import line(s).

    A source with nothing to port comes back unchanged, without the backend import.
    """
    source = "import torch\n" + textwrap.dedent(code)
    new, changes = migrate_source(source)
    if not changes:
        assert new == source
        return new[len("import torch\n") :]
    assert new.startswith("import torch\n" + BACKEND_IMPORT), new
    return new[len("import torch\n" + BACKEND_IMPORT) :]


def rules(code: str) -> list[str]:
    return [change.rule for change in migrate_source(textwrap.dedent(code))[1]]


def findings(code: str) -> list[tuple[str, str]]:
    result = rewrite_source(textwrap.dedent(code))
    return [(finding.kind, finding.api) for finding in result.findings]


# --------------------------------------------------------------------------- backend import


def test_backend_import_goes_right_after_import_torch() -> None:
    new, changes = migrate_source(
        "import os\nimport torch  # fw\nimport numpy as np\ntorch.cuda.synchronize()\n")
    assert new == ("import os\nimport torch  # fw\n" + BACKEND_IMPORT
                   + "import numpy as np\ntorch.sim.synchronize()\n")
    assert [(c.rule, c.line) for c in changes] == [("backend-import", 2), ("torch.cuda", 4)]


def test_backend_import_is_not_added_twice() -> None:
    source = "import torch\nimport torchport.sim\nx = torch.zeros(1).cuda()\n"
    new, changes = migrate_source(source)
    assert new.count("import torchport.sim") == 1
    assert [c.rule for c in changes] == [".cuda()"]


def test_backend_import_after_docstring_and_future_when_only_from_torch_imports() -> None:
    source = ('"""Doc."""\nfrom __future__ import annotations\n\nimport os\nfrom torch import nn\n'
              "m = nn.Linear(1, 1).cuda()\n")
    new, _ = migrate_source(source)
    assert new == (
        '"""Doc."""\nfrom __future__ import annotations\n'
        + BACKEND_IMPORT
        + '\nimport os\nfrom torch import nn\nm = nn.Linear(1, 1).to("sim")\n'
    )


def test_backend_import_precedes_an_earlier_statement_that_needs_it() -> None:
    source = "import os\nfrom torch.cuda import synchronize\nimport torch\n"
    new, _ = migrate_source(source)
    assert (
        new == "import os\n" + BACKEND_IMPORT + "from torch.sim import synchronize\nimport torch\n"
    )


def test_files_without_torch_or_cuda_are_unchanged() -> None:
    source = 'print("cuda")  # talks about cuda\nx = {"device": 1}\n'
    assert migrate_source(source) == (source, [])


# --------------------------------------------------------------------------- torch.cuda


def test_torch_cuda_attribute_chains_are_renamed() -> None:
    assert body("torch.cuda.synchronize()\nn = torch.cuda.device_count()\n") == (
        "torch.sim.synchronize()\nn = torch.sim.device_count()\n"
    )


def test_torch_alias_is_followed() -> None:
    new, _ = migrate_source("import torch as th\nth.cuda.manual_seed(0)\n")
    assert new == "import torch as th\n" + BACKEND_IMPORT + "th.sim.manual_seed(0)\n"


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ("import torch.cuda as tc\n", "import torch.sim as tc\n"),
        ("import torch.cuda\n", "import torch.sim\n"),
        (
            "from torch.cuda import synchronize, Stream\n",
            "from torch.sim import synchronize, Stream\n",
        ),
        ("from torch import cuda, nn\n", "from torch import sim as cuda, nn\n"),
        ("from torch.cuda import *\n", "from torch.sim import *\n"),
        ("from torch.cuda import amp\n", "from torch import amp\n"),
        ("import torch.cuda.amp as amp\n", "import torch.amp as amp\n"),
    ],
)
def test_torch_cuda_imports(before: str, after: str) -> None:
    new, changes = migrate_source(before)
    assert new == BACKEND_IMPORT + after
    assert {c.rule for c in changes} <= {"backend-import", "torch.cuda", "torch.cuda.amp"}


def test_import_mixing_supported_and_unsupported_names_is_split() -> None:
    new, _ = migrate_source("import torch\nfrom torch.cuda import nvtx, synchronize\n")
    assert new.endswith("from torch.cuda import nvtx\nfrom torch.sim import synchronize\n")


# --------------------------------------------------------------------------- amp


def test_amp_attribute_calls_move_to_torch_amp_with_the_device() -> None:
    code = """\
    with torch.cuda.amp.autocast(True, torch.bfloat16):
        pass
    scaler = torch.cuda.amp.GradScaler(init_scale=1024.0)
    """
    assert body(code) == (
        'with torch.amp.autocast("sim", enabled=True, dtype=torch.bfloat16):\n'
        "    pass\n"
        'scaler = torch.amp.GradScaler("sim", init_scale=1024.0)\n'
    )


def test_amp_names_imported_from_torch_cuda_amp() -> None:
    code = """\
    from torch.cuda.amp import GradScaler, autocast as ac
    scaler = GradScaler()
    with ac(dtype=torch.float16):
        pass
    """
    assert body(code) == (
        "from torch.amp import GradScaler, autocast as ac\n"
        'scaler = GradScaler("sim")\n'
        'with ac("sim", dtype=torch.float16):\n'
        "    pass\n"
    )


def test_amp_custom_fwd_bwd_decorators_get_device_type() -> None:
    code = """\
    @torch.cuda.amp.custom_fwd
    def f(ctx, x): ...
    @torch.cuda.amp.custom_fwd(cast_inputs=torch.float32)
    def g(ctx, x): ...
    """
    assert body(code) == (
        '@torch.amp.custom_fwd(device_type="sim")\n'
        "def f(ctx, x): ...\n"
        '@torch.amp.custom_fwd(cast_inputs=torch.float32, device_type="sim")\n'
        "def g(ctx, x): ...\n"
    )


def test_amp_reference_without_call_stays_on_the_mirror() -> None:
    assert body("ctx = torch.cuda.amp.autocast\n") == "ctx = torch.sim.amp.autocast\n"
    # a call we cannot give the device argument mechanically keeps CUDA's signature too
    assert body("with torch.cuda.amp.autocast(*a): pass\n") == (
        "with torch.sim.amp.autocast(*a): pass\n"
    )


# --------------------------------------------------------------------------- .cuda()


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ("m.cuda()", 'm.to("sim")'),
        ("m.cuda(1)", 'm.to("sim:1")'),
        ("m.cuda(device=0)", 'm.to("sim:0")'),
        ("m.cuda(non_blocking=True)", 'm.to("sim", non_blocking=True)'),
        # an argument that may be None: .cuda(None) is the current device, .to(None) no move
        ("m.cuda(rank)", 'm.to("sim" if rank is None else rank)'),
        ("m.cuda(args.gpu, True)", 'm.to("sim" if args.gpu is None else args.gpu, non_blocking=True)'),
        ('m.cuda("cuda:2")', 'm.to("sim:2")'),
        ('m.cuda(torch.device("cuda", 1))', 'm.to(torch.device("sim", 1))'),
        ('m.cuda(cfg["gpu"])', 'm.to("sim" if cfg["gpu"] is None else cfg["gpu"])'),
        ("nn.Linear(2, 2).cuda().half()", 'nn.Linear(2, 2).to("sim").half()'),
    ],
)
def test_cuda_method_calls(before: str, after: str) -> None:
    assert body(before + "\n") == after + "\n"


def test_cuda_method_with_variable_index_says_what_it_assumed() -> None:
    _, changes = migrate_source("x.cuda(rank)\n")
    (change,) = [c for c in changes if c.rule == ".cuda()"]
    assert "rank" in change.note


# --------------------------------------------------------------------------- device strings


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ('torch.device("cuda")', 'torch.device("sim")'),
        ("torch.device('cuda:0')", "torch.device('sim:0')"),
        ('torch.device("cuda", 1)', 'torch.device("sim", 1)'),
        ('torch.device(f"cuda:{rank}")', 'torch.device(f"sim:{rank}")'),
        ('torch.device("cuda:%d" % rank)', 'torch.device("sim:%d" % rank)'),
        ('torch.zeros(2, device="cuda")', 'torch.zeros(2, device="sim")'),
        ('x.to("cuda:1", non_blocking=True)', 'x.to("sim:1", non_blocking=True)'),
        ('torch.load(f, map_location="cuda")', 'torch.load(f, map_location="sim")'),
        ('torch.load(f, "cuda:0")', 'torch.load(f, "sim:0")'),
        (
            'torch.load(f, map_location={"cuda:1": "cuda:0"})',
            'torch.load(f, map_location={"sim:1": "sim:0"})',
        ),
        (
            'torch.load(f, map_location=lambda s, loc: "cuda")',
            'torch.load(f, map_location=lambda s, loc: "sim")',
        ),
        ('torch.autocast(device_type="cuda")', 'torch.autocast(device_type="sim")'),
        (
            'torch.autocast("cuda", dtype=torch.bfloat16)',
            'torch.autocast("sim", dtype=torch.bfloat16)',
        ),
        ('ok = x.device.type == "cuda"', 'ok = x.device.type == "sim"'),
        ('ok = device.type in ("cuda", "mps")', 'ok = device.type in ("sim", "mps")'),
        (
            'd = torch.device("cuda" if torch.cuda.is_available() else "cpu")',
            'd = torch.device("sim" if torch.sim.is_available() else "cpu")',
        ),
        (
            'DataLoader(ds, pin_memory=True, pin_memory_device="cuda")',
            'DataLoader(ds, pin_memory=True, pin_memory_device="sim")',
        ),
        ('DEVICE = "cuda"', 'DEVICE = "sim"'),
        ('cfg = {"device": "cuda:0"}', 'cfg = {"device": "sim:0"}'),
        ('def f(x, device="cuda"): ...', 'def f(x, device="sim"): ...'),
        (
            'p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])',
            'p.add_argument("--device", default="sim", choices=["sim", "cpu"])',
        ),
    ],
)
def test_device_strings_where_they_name_a_device(before: str, after: str) -> None:
    assert body(before + "\n") == after + "\n"


def test_unrelated_cuda_strings_are_untouched() -> None:
    code = '''\
    def f():
        """Runs on "cuda" when available."""
        print("using cuda")  # "cuda" in a comment
        info = {"cuda_version": "12.1", "cuda": 1}
        if name == "cuda":
            log("cuda")
        return "cuda:0"
    '''
    # a returned "cuda:0" is a device string in practice
    assert body(code) == textwrap.dedent(code).replace('return "cuda:0"', 'return "sim:0"')


# --------------------------------------------------------------------------- collectives, is_cuda


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ('dist.init_process_group("nccl")', 'dist.init_process_group("simccl")'),
        (
            'dist.init_process_group(backend="nccl", rank=0)',
            'dist.init_process_group(backend="simccl", rank=0)',
        ),
        (
            'dist.new_group(ranks, backend="cpu:gloo,cuda:nccl")',
            'dist.new_group(ranks, backend="cpu:gloo,sim:simccl")',
        ),
        ('ok = dist.get_backend() == "nccl"', 'ok = dist.get_backend() == "simccl"'),
        ('BACKEND = "nccl"', 'BACKEND = "simccl"'),
        ('compile(m, backend="inductor")', 'compile(m, backend="inductor")'),
    ],
)
def test_nccl_backend_strings(before: str, after: str) -> None:
    assert body("import torch.distributed as dist\n" + before + "\n") == (
        "import torch.distributed as dist\n" + after + "\n"
    )


def test_is_cuda_attribute() -> None:
    assert body("if x.is_cuda:\n    pass\n") == "if x.is_sim:\n    pass\n"


def test_other_backend_names_and_modules() -> None:
    code = 'import torch\ntorch.cuda.synchronize()\nx.cuda(0)\ndist.init_process_group("nccl")\n'
    new, _ = migrate_source(code, backend="npu=acme.npu_backend")
    assert new == (
        'import torch\nimport acme.npu_backend  # noqa: F401  registers the "npu" device\n'
        "torch.npu.synchronize()\n"
        'x.to("npu:0")\ndist.init_process_group("npuccl")\n'
    )
    assert Backend.parse("foo") == Backend("foo", "torchport.foo")
    for bad in ("", "cuda", "a-b", "x=not a module"):
        with pytest.raises(BackendSpecError):
            Backend.parse(bad)


# --------------------------------------------------------------------------- findings


def test_cudnn_and_cuda_backend_flags_are_left_alone_but_reported() -> None:
    code = """\
    import torch
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = True
    """
    new, _ = migrate_source(textwrap.dedent(code))
    assert "torch.backends.cudnn.benchmark = True" in new
    assert "torch.backends.cuda.matmul.allow_tf32 = True" in new
    assert findings(code) == [
        ("no-effect", "torch.backends.cudnn.benchmark"),
        ("no-effect", "torch.backends.cuda.matmul.allow_tf32"),
    ]


@pytest.mark.parametrize(
    ("code", "api"),
    [
        ("g = torch.cuda.CUDAGraph()", "torch.cuda.CUDAGraph"),
        ("with torch.cuda.graph(g): pass", "torch.cuda.graph"),
        ("f = torch.cuda.make_graphed_callables(f, (x,))", "torch.cuda.make_graphed_callables"),
        ("k = torch.cuda.jiterator._create_jit_fn(src)", "torch.cuda.jiterator._create_jit_fn"),
        ("torch.cuda.nvtx.range_push('step')", "torch.cuda.nvtx.range_push"),
        ("torch.cuda.comm.broadcast(t, [0, 1])", "torch.cuda.comm.broadcast"),
        ("torch.cuda.nccl.all_reduce(ts)", "torch.cuda.nccl.all_reduce"),
    ],
)
def test_unsupported_torch_cuda_apis_are_reported_not_rewritten(code: str, api: str) -> None:
    source = "import torch\n" + code + "\n"
    new, _ = migrate_source(source)
    assert new == source  # nothing ported: not even the backend import
    assert ("unsupported", api) in findings(source)


@pytest.mark.parametrize(
    ("code", "api"),
    [
        ("import cupy as cp", "cupy"),
        ("import pynvml", "pynvml"),
        ("from numba import cuda", "numba.cuda"),
        (
            "from torch.utils.cpp_extension import CUDAExtension",
            "torch.utils.cpp_extension.CUDAExtension",
        ),
        (
            "from torch.utils.cpp_extension import load\nk = load('k', ['k.cpp', 'k.cu'])",
            "torch.utils.cpp_extension.load",
        ),
    ],
)
def test_unsupported_libraries_and_extensions_are_reported(code: str, api: str) -> None:
    assert ("unsupported", api) in findings(code)


def test_unknown_torch_cuda_api_is_renamed_and_reported() -> None:
    code = "import torch\nx = torch.cuda.FloatTensor(2)\n"
    assert "torch.sim.FloatTensor(2)" in migrate_source(code)[0]
    assert findings(code) == [("unknown", "torch.cuda.FloatTensor")]


def test_known_mirror_list_covers_the_documented_names() -> None:
    for name in ("is_available", "synchronize", "memory_allocated", "Stream", "Event", "amp"):
        assert name in TORCH_BACKEND_MIRROR_APIS
    assert findings("import torch\ntorch.cuda.mem_get_info()\n") == []


# --------------------------------------------------------------------------- fidelity


def test_formatting_and_comments_survive() -> None:
    code = """\
    x = torch.randn(  # make data
        4,
        device = 'cuda',   # odd spacing kept
    )


    # two blank lines above survive
    y = x.cuda(  non_blocking=True  )  # trailing comment
    """
    assert body(code) == textwrap.dedent(
        """\
        x = torch.randn(  # make data
            4,
            device = 'sim',   # odd spacing kept
        )


        # two blank lines above survive
        y = x.to(  "sim", non_blocking=True  )  # trailing comment
        """
    )


def test_golden_training_script() -> None:
    source = (DATA / "train_cuda.py.in").read_bytes()
    result = rewrite_source(source, path="train_cuda.py")
    assert result.code == (DATA / "train_cuda.py.expected").read_bytes()
    compile(result.code, "train_cuda.py", "exec")
    assert {c.rule for c in result.changes} == {
        "backend-import",
        "torch.cuda",
        "torch.cuda.amp",
        ".cuda()",
        "device-string",
        "collective",
        "is_cuda",
    }


def test_migration_is_idempotent() -> None:
    once = rewrite_source((DATA / "train_cuda.py.in").read_bytes())
    twice = rewrite_source(once.code)
    assert twice.code == once.code
    assert twice.changes == []


# --------------------------------------------------------------------------- trees


def make_tree(root: Path) -> Path:
    src = root / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "train.py").write_text(
        "import torch\nx = torch.zeros(1).cuda()\ntorch.cuda.nvtx.mark('a')\n"
    )
    (src / "train.py").chmod(0o755)
    (src / "pkg" / "plain.py").write_text("print('no torch here')\n")
    (src / "pkg" / "notes.md").write_text("Runs on cuda.\n")
    return src


def test_migrate_tree_writes_a_copy(tmp_path: Path) -> None:
    src = make_tree(tmp_path)
    dst = tmp_path / "out"
    result = migrate_path(src, dst)
    assert (dst / "train.py").read_text() == (
        "import torch\n" + BACKEND_IMPORT + 'x = torch.zeros(1).to("sim")\n'
        "torch.cuda.nvtx.mark('a')\n"
    )
    assert os.stat(dst / "train.py").st_mode & 0o777 == 0o755
    assert (dst / "pkg" / "plain.py").read_bytes() == (src / "pkg" / "plain.py").read_bytes()
    assert (dst / "pkg" / "notes.md").read_text() == "Runs on cuda.\n"
    assert (src / "train.py").read_text().count("cuda()") == 1  # source untouched
    assert result.summary["files scanned"] == 2
    assert result.files_changed == ["train.py"]
    assert [f.api for f in result.unsupported] == ["torch.cuda.nvtx.mark"]


def test_single_file_into_existing_directory(tmp_path: Path) -> None:
    src = make_tree(tmp_path) / "train.py"
    out = tmp_path / "out"
    out.mkdir()
    migrate_path(src, out)
    assert 'to("sim")' in (out / "train.py").read_text()


def test_report_markdown_and_csv(tmp_path: Path) -> None:
    src = make_tree(tmp_path)
    (src / "bad.py").write_text("def broken(:\n")
    report = tmp_path / "report"
    result = migrate_path(src, tmp_path / "out", report_dir=report)
    assert result.report_files == [report / "migration_report.md", report / "migration_report.csv"]
    md = (report / "migration_report.md").read_text()
    assert "| files scanned | 3 |" in md
    assert "| files changed | 1 |" in md
    assert "| unsupported | 1 |" in md
    assert "| parse failures | 1 |" in md
    assert '| train.py:2 | .cuda() | `torch.zeros(1).cuda()` | `torch.zeros(1).to("sim")` |' in md
    assert "| train.py:3 | `torch.cuda.nvtx.mark` |" in md
    assert "| bad.py | parse |" in md
    with (report / "migration_report.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    by_category = {row["category"]: row for row in rows}
    assert by_category["change"]["file"] == "train.py"
    assert by_category["unsupported"]["rule_or_api"] == "torch.cuda.nvtx.mark"
    assert by_category["unsupported"]["line"] == "3"
    assert by_category["parse-failure"]["file"] == "bad.py"
    cuda_row = next(row for row in rows if row["rule_or_api"] == ".cuda()")
    assert (cuda_row["line"], cuda_row["before"], cuda_row["after"]) == (
        "2",
        "torch.zeros(1).cuda()",
        'torch.zeros(1).to("sim")',
    )


def test_dry_run_writes_nothing_but_reports(tmp_path: Path) -> None:
    src = make_tree(tmp_path)
    dst = tmp_path / "out"
    result = migrate_path(src, dst, dry_run=True, report_dir=tmp_path / "r")
    assert not dst.exists()
    assert result.files_changed == ["train.py"]
    assert "dry run" in (tmp_path / "r" / "migration_report.md").read_text()
    assert migrate_path(src, None, dry_run=True).changes == result.changes


@pytest.mark.parametrize("where", ["same", "inside"])
def test_refuses_to_overwrite_the_source_tree(tmp_path: Path, where: str) -> None:
    src = make_tree(tmp_path)
    dst = src if where == "same" else src / "migrated"
    with pytest.raises(MigrationError):
        migrate_path(src, dst)
    assert not (src / "migrated").exists()
    assert "cuda()" in (src / "train.py").read_text()


def test_refuses_to_overwrite_a_source_file(tmp_path: Path) -> None:
    src = make_tree(tmp_path) / "train.py"
    for dst in (src, src.parent):  # the file itself, or its own directory
        with pytest.raises(MigrationError):
            migrate_path(src, dst)
    assert "cuda()" in src.read_text()


def test_unparsable_file_is_copied_unchanged_and_reported(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "py2.py").write_text('import torch\nprint "cuda"\n')
    result = migrate_path(src, tmp_path / "out")
    assert (tmp_path / "out" / "py2.py").read_text() == 'import torch\nprint "cuda"\n'
    assert [(f.path, f.kind) for f in result.failures] == [("py2.py", "parse")]


def test_non_utf8_file_is_copied_byte_for_byte(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    data = b"import torch\nx = torch.zeros(1).cuda()  # caf\xe9\n"
    (src / "latin.py").write_bytes(data)
    result = migrate_path(src, tmp_path / "out")
    assert (tmp_path / "out" / "latin.py").read_bytes() == data
    assert [(f.path, f.kind) for f in result.failures] == [("latin.py", "decode")]


def test_encoding_cookie_is_honoured(tmp_path: Path) -> None:
    src = tmp_path / "cookie.py"
    src.write_bytes(b'# -*- coding: latin-1 -*-\nimport torch\ns = "caf\xe9"\nx.cuda()\n')
    migrate_path(src, tmp_path / "out.py")
    assert (tmp_path / "out.py").read_bytes() == (
        b"# -*- coding: latin-1 -*-\nimport torch\n"
        + BACKEND_IMPORT.encode()
        + b's = "caf\xe9"\nx.to("sim")\n'
    )


def test_symlinks_inside_are_kept_and_outside_are_skipped(tmp_path: Path) -> None:
    src = make_tree(tmp_path)
    outside = tmp_path / "secret.py"
    outside.write_text("import torch\n")
    (src / "escape.py").symlink_to(outside)
    (src / "pkg" / "alias.py").symlink_to(src / "train.py")  # absolute, but inside
    (src / "linkdir").symlink_to("pkg")
    dst = tmp_path / "out"
    result = migrate_path(src, dst)
    assert not os.path.lexists(dst / "escape.py")
    assert [s.path for s in result.skipped] == ["escape.py"]
    assert os.readlink(dst / "pkg" / "alias.py") == "../train.py"
    assert (dst / "pkg" / "alias.py").resolve() == (dst / "train.py").resolve()
    assert os.readlink(dst / "linkdir") == "pkg"
    assert outside.read_text() == "import torch\n"


# --------------------------------------------------------------------------- CLI


@pytest.fixture()
def cli() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def main() -> None:
        """Stand-in for the lead's torchport app."""

    register(app)
    return app


def test_cli_success_even_with_unsupported_findings(tmp_path: Path, cli: typer.Typer) -> None:
    src = make_tree(tmp_path)
    report = tmp_path / "rep"
    outcome = CliRunner().invoke(
        cli, ["migrate", str(src), "-o", str(tmp_path / "out"), "--report", str(report)]
    )
    assert outcome.exit_code == 0, outcome.output
    assert "files changed" in outcome.output
    assert "torch.cuda.nvtx.mark" in outcome.output
    assert (report / "migration_report.md").exists()


def test_cli_dry_run(tmp_path: Path, cli: typer.Typer) -> None:
    src = make_tree(tmp_path)
    outcome = CliRunner().invoke(cli, ["migrate", str(src), "-o", str(tmp_path / "o"), "--dry-run"])
    assert outcome.exit_code == 0, outcome.output
    assert "dry run" in outcome.output
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "args",
    [
        ["{src}", "-o", "{src}"],
        ["{src}", "-o", "{src}/sub"],
        ["{src}"],
        ["{src}", "-o", "{tmp}/o", "--backend", "bad-name"],
        ["{tmp}/missing", "-o", "{tmp}/o"],
        ["{src}", "--unknown-flag"],
    ],
)
def test_cli_usage_errors_exit_2(tmp_path: Path, cli: typer.Typer, args: list[str]) -> None:
    src = make_tree(tmp_path)
    argv = [a.format(src=src, tmp=tmp_path) for a in args]
    outcome = CliRunner().invoke(cli, ["migrate", *argv])
    assert outcome.exit_code == 2, outcome.output


def test_cli_internal_failure_exits_1(
    tmp_path: Path, cli: typer.Typer, monkeypatch: pytest.MonkeyPatch
) -> None:
    def explode(*args: object, **kwargs: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr("torchport.tools.migrate.cli.migrate_path", explode)
    outcome = CliRunner().invoke(cli, ["migrate", str(tmp_path), "-o", str(tmp_path / "o")])
    assert outcome.exit_code == 1


def test_analyse_says_when_the_coverage_tool_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "torchport.tools.debug.opcoverage", None)  # import -> ImportError
    src = make_tree(tmp_path) / "train.py"
    result = migrate_path(src, tmp_path / "o.py", analyse=True, report_dir=tmp_path / "r")
    assert result.analysis is not None and "not available" in result.analysis
    assert "not available" in (tmp_path / "r" / "migration_report.md").read_text()


def test_analyse_links_the_coverage_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []

    def run_script_coverage(script: Path, report_dir: Path | None = None) -> Path:
        calls.append(script)
        out = (report_dir or tmp_path) / "coverage.md"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("ok")
        return out

    fake = types.ModuleType("torchport.tools.debug.opcoverage")
    fake.run_script_coverage = run_script_coverage  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torchport.tools.debug.opcoverage", fake)
    src = make_tree(tmp_path)
    migrate_path(src, tmp_path / "o", analyse=True, entry="train.py", report_dir=tmp_path / "r")
    assert calls == [tmp_path / "o" / "train.py"]
    assert "[coverage.md](coverage.md)" in (tmp_path / "r" / "migration_report.md").read_text()


def test_migration_package_does_not_import_torch() -> None:
    package = Path(__file__).parents[1] / "src" / "torchport" / "migrate"
    for path in package.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not any(n == "torch" or n.startswith("torch.") for n in names), path


# --------------------------------------------------------------------------- --analyse (runs)

ANALYSED = """\
import sys
import torch


def main():
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 1
    model = torch.nn.Linear(4, 2).cuda()
    for _ in range(steps):
        y = model(torch.randn(3, 4).cuda()).relu().sum()
    print("steps", steps, float(y))


if __name__ == "__main__":
    main()
"""


def analysed_tree(root: Path) -> Path:
    src = root / "proj"
    (src / "lib").mkdir(parents=True)
    (src / "train.py").write_text(ANALYSED)
    (src / "broken.py").write_text(
        "import torch\n\nif __name__ == '__main__':\n    raise ValueError('bad data')\n"
    )
    (src / "lib" / "util.py").write_text("import torch\nDEV = 'cuda'\n")  # not an entry script
    return src


def test_cli_analyse_reports_fallback_ops_and_failures(
    tmp_path: Path, cli: typer.Typer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHPORT_FORCE_FALLBACK_OPS", "addmm")  # read by the subprocesses
    src, report = analysed_tree(tmp_path), tmp_path / "rep"
    outcome = CliRunner().invoke(
        cli, ["migrate", str(src), "-o", str(tmp_path / "out"), "--report", str(report), "--analyse"]
    )
    # the migration is written, but a failing script makes the analysis a failure
    assert outcome.exit_code == 3, outcome.output
    assert "2 script(s) analysed, 1 ran, 1 failed; fall back to CPU: addmm" in outcome.output
    md = (report / "migration_report.md").read_text()
    assert "## Op coverage of the migrated scripts" in md
    assert "| train.py | `--steps 1` |" not in md  # no args were given
    assert "[coverage_train.html](coverage_train.html)" in md
    section = md.split("### Ops that would fall back to CPU", 1)[1]
    assert "| train.py | `addmm` | 1 | float32 |" in section
    assert "| broken.py | 1 | ValueError: bad data |" in section
    page = (report / "coverage_train.html").read_text()
    assert "<svg" in page and "addmm" in page
    rows = list(csv.reader((report / "migration_report.csv").open()))
    assert ["fallback-op", "train.py", "", "", "addmm", "", "", "calls 1; dtypes float32"] in rows
    assert any(r[0] == "coverage-failure" and r[1] == "broken.py" for r in rows)
    assert not any("util.py" in r[1] for r in rows if r[0].startswith("coverage"))


def test_cli_analyse_script_with_arguments(tmp_path: Path, cli: typer.Typer) -> None:
    src, report = analysed_tree(tmp_path), tmp_path / "rep"
    outcome = CliRunner().invoke(
        cli,
        ["migrate", str(src), "-o", str(tmp_path / "out"), "--report", str(report),
         "--analyse-script", "train.py", "--", "--steps", "3"],
    )
    assert outcome.exit_code == 0, outcome.output
    md = (report / "migration_report.md").read_text()
    assert "| train.py | `--steps 3` | ok |" in md
    assert "broken.py" not in md.split("## Op coverage", 1)[1]
    data = (report / "coverage_train.json").read_text()
    assert '"args": [\n  "--steps",\n  "3"\n ]' in data
    assert "fall back to CPU: none" in outcome.output


def test_cli_analyse_single_file_and_usage_errors(tmp_path: Path, cli: typer.Typer) -> None:
    src = analysed_tree(tmp_path) / "train.py"
    outcome = CliRunner().invoke(cli, ["migrate", str(src), "-o", str(tmp_path / "t.py"),
                                       "--analyse"])
    assert outcome.exit_code == 0, outcome.output
    assert "1 script(s) analysed, 1 ran" in outcome.output
    extra = CliRunner().invoke(cli, ["migrate", str(src), "-o", str(tmp_path / "u.py"),
                                     "--", "--steps", "2"])
    assert extra.exit_code == 2  # script arguments without --analyse-script


def test_pin_memory_is_kept_as_written() -> None:
    """The device has pinned host memory: ``pin_memory`` settings stay, and only the
    generic rules touch them (torch.cuda -> torch.sim, device strings)."""
    src = ("import torch\n"
           "dl = torch.utils.data.DataLoader(ds, batch_size=4,\n"
           "                                 pin_memory=torch.cuda.is_available(),\n"
           '                                 pin_memory_device="cuda")\n'
           "f(pin_memory=True)\n"
           "g(pin_memory=False)\n")
    res = rewrite_source(src, path="train.py")
    assert "pin_memory=torch.sim.is_available()," in res.code
    assert 'pin_memory_device="sim")' in res.code
    assert "f(pin_memory=True)\ng(pin_memory=False)\n" in res.code
    assert not [c for c in res.changes if "pin" in c.rule]
    assert sorted((c.line, c.rule) for c in res.changes if c.rule != "backend-import") == [
        (3, "torch.cuda"), (4, "device-string")]

# --------------------------------------------------------------------------- never touches SRC


def _checksums(root: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under ``root``: (inode, bytes); symlinks by their target text."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_symlink():
            out[str(p.relative_to(root))] = (0, os.readlink(p).encode())
        elif p.is_file():
            out[str(p.relative_to(root))] = (p.stat().st_ino, p.read_bytes())
    return out


def test_a_hard_linked_destination_leaves_the_source_intact(tmp_path: Path,
                                                            cli: typer.Typer) -> None:
    src = make_tree(tmp_path)
    dst = tmp_path / "linked"
    for p in sorted(src.rglob("*")):  # cp -al: the same inodes under another name
        q = dst / p.relative_to(src)
        if p.is_dir() and not p.is_symlink():
            q.mkdir(parents=True, exist_ok=True)
        elif p.is_file() and not p.is_symlink():
            q.parent.mkdir(parents=True, exist_ok=True)
            os.link(p, q)
    before = _checksums(src)
    outcome = CliRunner().invoke(cli, ["migrate", str(src), "-o", str(dst)])
    assert outcome.exit_code == 0, outcome.output
    assert _checksums(src) == before
    assert any(b"torchport" in p.read_bytes() for p in dst.rglob("*.py"))


@pytest.mark.parametrize("args, message", [
    (["-o", ""], "output path is empty"),
    (["-o", "{tmp}/o", "--report", "{src}/rep"], "report inside the source tree"),
    (["-o", "{tmp}/o", "--report", ""], "report path is empty"),
    (["-o", "{tmp}/o", "--report", "{src}", "--dry-run"], "report inside the source tree"),
])
def test_outputs_that_would_write_into_the_source_or_cwd_are_refused(
        tmp_path: Path, cli: typer.Typer, monkeypatch: pytest.MonkeyPatch, args: list[str],
        message: str) -> None:
    (tmp_path / "in").mkdir()
    src = make_tree(tmp_path / "in")
    cwd = tmp_path / "cwd"
    (cwd / "train.py").parent.mkdir()
    (cwd / "train.py").write_text("import torch\nx = torch.ones(2).cuda()\n")
    monkeypatch.chdir(cwd)
    before, here = _checksums(src), _checksums(cwd)
    argv = [a.format(src=src, tmp=tmp_path) for a in args]
    outcome = CliRunner().invoke(cli, ["migrate", str(src), *argv])
    assert outcome.exit_code == 2 and message in " ".join(outcome.output.split()), outcome.output
    assert _checksums(src) == before and _checksums(cwd) == here


def test_relative_symlinks_keep_their_text_loops_included(tmp_path: Path, cli: typer.Typer) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "train.py").write_text("import torch\nx = torch.ones(2).cuda()\n")
    os.symlink("b", src / "a")  # a -> b -> a: a loop, copied as a loop
    os.symlink("a", src / "b")
    os.symlink("train.py", src / "alias.py")
    os.symlink("missing.py", src / "dangling.py")
    outcome = CliRunner().invoke(cli, ["migrate", str(src), "-o", str(tmp_path / "out")])
    assert outcome.exit_code == 0, outcome.output
    out = tmp_path / "out"
    assert {n: os.readlink(out / n) for n in ("a", "b", "alias.py", "dangling.py")} == \
        {"a": "b", "b": "a", "alias.py": "train.py", "dangling.py": "missing.py"}


@pytest.mark.parametrize("where, message", [
    ("file", "is a file"),
    ("file/below", "cannot write"),
])
def test_a_destination_that_cannot_be_one_is_a_usage_error(
        tmp_path: Path, cli: typer.Typer, where: str, message: str) -> None:
    (tmp_path / "in").mkdir()
    src = make_tree(tmp_path / "in")
    (tmp_path / "file").write_text("not a directory\n")
    before = _checksums(src)
    outcome = CliRunner().invoke(cli, ["migrate", str(src), "-o", str(tmp_path / where)])
    assert outcome.exit_code == 2 and message in " ".join(outcome.output.split()), outcome.output
    assert "internal error" not in outcome.output
    assert (tmp_path / "file").read_text() == "not a directory\n"
    assert _checksums(src) == before


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0,
                    reason="root writes into read-only folders")
def test_a_read_only_destination_is_a_usage_error(tmp_path: Path, cli: typer.Typer) -> None:
    (tmp_path / "in").mkdir()
    src = make_tree(tmp_path / "in")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        outcome = CliRunner().invoke(cli, ["migrate", str(src), "-o", str(ro / "out")])
    finally:
        ro.chmod(0o755)
    assert outcome.exit_code == 2 and "not writable" in outcome.output, outcome.output


def test_files_above_the_size_limit_are_copied_unchanged_and_reported(
        tmp_path: Path, cli: typer.Typer) -> None:
    src = tmp_path / "src"
    src.mkdir()
    small = "import torch\nx = torch.ones(2).cuda()\n"
    big = small + "y = torch.zeros(3).cuda()\n" * 40
    (src / "small.py").write_text(small)
    (src / "generated.py").write_text(big)
    seen: list[tuple[int, int, str]] = []
    result = migrate_path(src, tmp_path / "out", max_file_bytes=len(small) + 1,
                          progress=lambda done, total, rel: seen.append((done, total, rel)))
    assert (tmp_path / "out" / "generated.py").read_text() == big
    assert "torchport" in (tmp_path / "out" / "small.py").read_text()
    assert [s.path for s in result.skipped] == ["generated.py"]
    assert "limit" in result.skipped[0].reason
    assert seen == [(1, 2, "small.py")]  # generated.py (first in order) was not rewritten
    outcome = CliRunner().invoke(cli, ["migrate", str(src), "-o", str(tmp_path / "o2"),
                                       "--max-file-size", "0"])
    assert outcome.exit_code == 0, outcome.output
    assert "torchport" in (tmp_path / "o2" / "generated.py").read_text()
