"""Step time of the zoo's training scripts (examples/zoo/) on the device against the CPU.

Each case's script runs as a whole process, alternating: the original on the CPU under plain
PyTorch, then the migrated script on sim (``torchport migrate`` output, the way a ported
project runs it), ``--rounds`` times. A script reports the median of its own steps after the
first (``timing step_ms``); the table gives the median over rounds of each side and the
median of the back-to-back device/CPU ratios. Process start, imports and compiling are not in
the step time.

    .venv/bin/python benchmarks/zoo.py [--rounds 3] [--only nanogpt,peft_lora]

Needs the ``zoo`` extra for the diffusers and peft cases (``make zoo`` installs it); a case
whose library is missing is listed as skipped.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ZOO = ROOT / "examples" / "zoo"

# name: (script, device arguments, CPU arguments, libraries): more steps than the tests take,
# so that the median step is steady.
CASES = {
    "nanogpt": ("nanogpt.py", ["--iters", "12", "--compile", "0", "--dtype", "float32"],
                ["--iters", "12", "--compile", "0", "--fused", "1"], ()),
    "nanogpt_compile": ("nanogpt.py", ["--iters", "12", "--dtype", "float32"],
                        ["--iters", "12", "--fused", "1"], ()),
    "nanogpt_bf16": ("nanogpt.py", ["--iters", "12", "--compile", "0"],
                     ["--iters", "12", "--compile", "0", "--fused", "1"], ()),
    "diffusers_ddpm": ("diffusers_ddpm.py", ["--steps", "10", "--sample-steps", "2"],
                       ["--steps", "10", "--sample-steps", "2"], ("diffusers",)),
    "peft_lora": ("peft_lora.py", ["--steps", "12"], ["--steps", "12"], ("peft",)),
    "lightning": ("lightning_module.py", ["--steps", "16"], ["--steps", "16"],
                  ("pytorch_lightning",)),
}


def _env(torchport: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHPORT_")
           or (torchport and k.startswith("TORCHPORT_SIM_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONHASHSEED="0", TORCHPORT_FALLBACK_WARN="0")
    return env


def _step_ms(cmd: list[str], torchport: bool) -> float:
    out = subprocess.run(cmd, capture_output=True, text=True, env=_env(torchport), timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    m = re.search(r"^timing step_ms (\S+)$", out.stdout, re.M)
    assert m, out.stdout[-2000:]
    return float(m.group(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", default="", help="comma list of cases")
    a = p.parse_args()
    only = set(filter(None, a.only.split(",")))
    with tempfile.TemporaryDirectory() as tmp:
        migrated = Path(tmp) / "zoo"
        subprocess.run([sys.executable, "-m", "torchport.tools.cli", "migrate", str(ZOO), "-o",
                        str(migrated), "--report", str(Path(tmp) / "report")], check=True,
                       capture_output=True, env=_env(True))
        print(f"{'case':<16} {'CPU ms':>8} {'sim ms':>8} {'sim/CPU':>8}")
        for name, (script, dev_args, cpu_args, libs) in CASES.items():
            if only and name not in only:
                continue
            missing = [lib for lib in libs if importlib.util.find_spec(lib) is None]
            if missing:
                print(f"{name:<16} skipped: {', '.join(missing)} not installed (make zoo)")
                continue
            cpu, dev, ratios = [], [], []
            for _ in range(a.rounds):
                c = _step_ms([sys.executable, str(ZOO / script), *cpu_args], False)
                d = _step_ms([sys.executable, str(migrated / script), *dev_args], True)
                cpu.append(c)
                dev.append(d)
                ratios.append(d / c)
            print(f"{name:<16} {statistics.median(cpu):>8.2f} {statistics.median(dev):>8.2f} "
                  f"{statistics.median(ratios):>8.2f}", flush=True)


if __name__ == "__main__":
    main()
