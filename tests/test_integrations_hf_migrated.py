"""Hugging Face CUDA scripts after ``torchport migrate``, run as ``python script.py``.

A Trainer script usually names no CUDA API at all (the Trainer picks the GPU), and an
accelerate script only ``Accelerator()``: migrating them used to change nothing, so the
libraries, never told of the device, trained on the CPU. The migration now adds the backend
import to every module importing such a library and reports it; the libraries then choose
the device through torchport's integration (:mod:`torchport.integrations.huggingface`).

Each case (Trainer, Trainer bf16, an accelerate loop, accelerate bf16, accelerate fp16 with
its GradScaler; gradient accumulation over two micro-batches in all) is the CUDA script,
migrated, then run in a fresh interpreter with ``TORCHPORT_OP_STATS=1``: the parameters and
the batches must be on the device, the device must have run the model's matmuls (in the
mixed-precision dtype where there is one) with nothing falling back to the CPU, and the loss
curve must be the original script's on a CPU-only PyTorch: bit for bit in fp32 (the same
math), within 1% in bf16/fp16 (low-precision matmuls; the reference is the fp32 CPU run).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the Hugging Face cases need transformers")
pytest.importorskip("accelerate", reason="the Hugging Face cases need accelerate")

pytestmark = pytest.mark.tools

# No ``import torch`` and no ``__main__`` guard: the Trainer chooses the device by itself.
TRAINER = '''\
"""Fine-tune a tiny BERT with the Trainer (on the GPU when there is one)."""
import sys

from transformers import BertConfig, BertForMaskedLM, Trainer, TrainingArguments, set_seed

seen = set()


class RecordingTrainer(Trainer):
    def compute_loss(self, model, inputs, *args, **kwargs):
        seen.add(str(inputs["input_ids"].device))
        return super().compute_loss(model, inputs, *args, **kwargs)


rows = [[3 + (7 * i + 5 * j) % 90 for j in range(8)] for i in range(16)]
data = [{"input_ids": r, "labels": r} for r in rows]
set_seed(0)
model = BertForMaskedLM(BertConfig(vocab_size=99, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
args = TrainingArguments(output_dir=sys.argv[1], per_device_train_batch_size=2, max_steps=3,
                         gradient_accumulation_steps=2, learning_rate=1e-3, logging_steps=1,
                         report_to=[], save_strategy="no", seed=0, disable_tqdm=True,
                         bf16="--bf16" in sys.argv)
trainer = RecordingTrainer(model=model, args=args, train_dataset=data)
trainer.train()
print("result params", next(trainer.model.parameters()).device)
print("result batches", sorted(seen))
print("result losses", [h["loss"] for h in trainer.state.log_history if "loss" in h])
'''

# No ``__main__`` guard and no CUDA name but the peak-memory report.
ACCELERATE = '''\
"""A tiny BERT trained with an accelerate loop."""
import sys

import torch
from accelerate import Accelerator
from transformers import BertConfig, BertForMaskedLM

precision = sys.argv[1] if len(sys.argv) > 1 else "no"
accelerator = Accelerator(mixed_precision=precision, gradient_accumulation_steps=2)
torch.manual_seed(0)
model = BertForMaskedLM(BertConfig(vocab_size=99, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
ids = torch.randint(3, 99, (12, 8), generator=torch.Generator().manual_seed(1))
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=2)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
losses, seen = [], set()
for (batch,) in loader:
    seen.add(str(batch.device))
    with accelerator.accumulate(model):
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        if accelerator.sync_gradients:
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    losses.append(loss.item())
print("result params", next(model.parameters()).device)
print("result batches", sorted(seen))
print("result scaler", type(accelerator.scaler).__name__, getattr(accelerator.scaler, "_device", None))
print("result losses", losses)
if torch.cuda.is_available():
    print("result peak", torch.cuda.max_memory_allocated())
'''

SCRIPTS = {"hf_trainer.py": TRAINER, "hf_accelerate.py": ACCELERATE}
DEVICE = "sim"
# (script, arguments, the CPU reference's arguments, low-precision dtype or None)
CASES = {
    "trainer": ("hf_trainer.py", [], [], None),
    "trainer-bf16": ("hf_trainer.py", ["--bf16"], [], "bfloat16"),
    "accelerate": ("hf_accelerate.py", ["no"], ["no"], None),
    "accelerate-bf16": ("hf_accelerate.py", ["bf16"], ["no"], "bfloat16"),
    "accelerate-fp16": ("hf_accelerate.py", ["fp16"], ["no"], "float16"),
}
_ROW = re.compile(r"^\s+(\S+)\s+(\d+)\s+(\S.*?)\s{2,}([a-z0-9,]*)\s+[\d.]+\s*$")


def _env(torchport: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHPORT_")
           or k.startswith(("TORCHPORT_SIM_", "TORCHPORT_NATIVE", "TORCHPORT_CACHE_DIR"))}
    env.update(OMP_NUM_THREADS="1", PYTHONHASHSEED="0", COLUMNS="250",
               TRANSFORMERS_VERBOSITY="error")
    if torchport:
        env.update(TORCHPORT_OP_STATS="1", TORCHPORT_FALLBACK_WARN="0")
    return env


def _run(script: Path, args: list[str], torchport: bool, tmp: Path
         ) -> tuple[dict[str, object], dict[str, tuple[str, set[str]]]]:
    """Run ``script``; its ``result`` lines, and the device's op statistics (op -> paths,
    dtypes) when ``torchport``."""
    argv = [str(tmp / "out"), *args] if script.name == "hf_trainer.py" else args
    out = subprocess.run([sys.executable, str(script), *argv], cwd=tmp, env=_env(torchport),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-5000:])
    results: dict[str, object] = {}
    for m in re.finditer(r"^result (\S+) (.*)$", out.stdout, re.M):
        try:
            results[m[1]] = ast.literal_eval(m[2])
        except (ValueError, SyntaxError):
            results[m[1]] = m[2]
    stats = {m[1]: (m[3], set(filter(None, m[4].split(","))))
             for m in map(_ROW.match, out.stderr.splitlines()) if m}
    return results, stats


@pytest.fixture(scope="module")
def scripts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """The CUDA scripts and their migration: (original dir, migrated dir, report text)."""
    root = tmp_path_factory.mktemp("hf")
    src = root / "cuda"
    src.mkdir()
    for name, text in SCRIPTS.items():
        (src / name).write_text(text)
    out = subprocess.run([sys.executable, "-m", "torchport.tools.cli", "migrate", str(src), "-o",
                          str(root / "migrated"), "--report", str(root / "report")],
                         env=_env(False), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Libraries that choose the device" in out.stdout
    report = (root / "report" / "migration_report.md").read_text()
    return src, root / "migrated", report


_CPU: dict[tuple[str, ...], list[float]] = {}


def test_migration_adds_the_backend_where_a_library_chooses_the_device(
        scripts: tuple[Path, Path, str]) -> None:
    """Both scripts get ``import torchport.sim`` (the Trainer script imports nothing else
    of torch), and the report says which library chooses the device and how."""
    _, migrated, report = scripts
    for name in SCRIPTS:
        assert "import torchport.sim  # noqa: F401" in (migrated / name).read_text(), name
    section = report.split("## Libraries that choose the device", 1)[1].split("\n## ", 1)[0]
    assert "| hf_trainer.py:1 | transformers |" in section
    assert "| hf_accelerate.py:" in section and "| accelerate |" in section


def test_backend_import_rule_for_device_choosing_libraries() -> None:
    """The rule itself: a module importing transformers/accelerate/trl/Lightning (also in a
    function) gets the import, noted with the library; one importing none of them, or
    already importing the backend, is left as it was."""
    from torchport.tools.migrate import rewrite_source

    for code, libs in [("from transformers import Trainer\n", ("transformers",)),
                       ("import accelerate, trl\n", ("accelerate", "trl")),
                       ("def main():\n    import pytorch_lightning as pl\n",
                        ("pytorch_lightning",))]:
        result = rewrite_source(code, path="train.py")
        assert isinstance(result.code, str)
        assert result.code.startswith("import torchport.sim  # noqa: F401"), result.code
        [change] = result.changes
        assert change.rule == "backend-import" and change.libraries == libs
        assert all(lib in change.note for lib in libs)
    for code in ("import numpy\nimport torch\n",
                 "import torch\nimport torchport.sim\nfrom transformers import Trainer\n"):
        result = rewrite_source(code, path="train.py")
        assert result.code is code and result.changes == []


# bf16 through Accelerate stands for bf16 in make test; the Trainer's own: make examples
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c == "trainer-bf16"
                                  else c for c in CASES])
def test_migrated_script_trains_on_the_device(scripts: tuple[Path, Path, str], case: str,
                                              tmp_path: Path) -> None:
    """The migrated script trains on the device with the original's losses on the CPU."""
    src, migrated, _ = scripts
    name, args, cpu_args, low = CASES[case]
    key = (name, *cpu_args)
    if key not in _CPU:
        cpu, _ = _run(src / name, cpu_args, torchport=False, tmp=tmp_path)
        assert cpu["params"] == "cpu" and cpu["batches"] == ["cpu"]
        _CPU[key] = cpu["losses"]  # type: ignore[assignment]
    dev, stats = _run(migrated / name, args, torchport=True, tmp=tmp_path)
    assert dev["params"] == f"{DEVICE}:0", dev
    assert dev["batches"] == [f"{DEVICE}:0"], dev
    assert stats, "no op ran on the device"
    assert not [op for op, (paths, _) in stats.items() if "fallback" in paths]
    matmuls = stats.get("addmm", ("", set()))[1] | stats.get("mm", ("", set()))[1]
    assert (low or "float32") in matmuls, matmuls
    if name == "hf_accelerate.py":
        assert dev["peak"] > 0  # torch.cuda.max_memory_allocated -> torch.sim's
        if low == "float16":  # accelerate's GradScaler, of the device
            assert dev["scaler"] == f"GradScaler {DEVICE}"
            assert "_amp_foreach_non_finite_check_and_unscale_" in stats
    losses, want = dev["losses"], _CPU[key]
    assert isinstance(losses, list) and len(losses) == len(want) and len(set(losses)) > 1
    if low is None:
        assert losses == want
    else:
        for got, ref in zip(losses, want, strict=True):
            assert got == pytest.approx(ref, rel=1e-2), (losses, want)
