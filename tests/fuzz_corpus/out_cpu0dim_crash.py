"""Fuzz repro: crash [out:cpu0dim@float64] (default mode)

First seen: program 100/8 step 18: default: crash in step 18 [out:cpu0dim@float64]: Fatal Python error: Segmentation fault

From `python -m torchport.tools.fuzz` (seed/program 100/8, mode default). Runs the program below on the CPU and on sim,
then compares them step by step; exits 1 listing the differences while any remain:

    python {this file}

The helpers are torchport.tools.fuzz.prelude's, as the fuzzer's own.
"""
# fuzz-corpus: subprocess
from torchport.tools.fuzz.prelude import *  # noqa: F403 (check, mk, torch...)


# ---- the program ----------------------------------------------------------------------
def program(dev, dev1, rec):
    with rec.step(0, 'rng:randn', on={'t5': 'dev'}):
        torch.manual_seed(504606)
        t5 = torch.randn((3, 1, 2), dtype=torch.float64, device=dev)
        rec.keep(t5=t5)
    with rec.step(1, 'out:cpu0dim@float64', expect='RuntimeError'):
        o22 = torch.tensor(0, dtype=torch.float64)
        t23 = torch.neg(t5, out=o22)
        same = t23 is o22
        rec.keep(o22=o22, t23=t23, same=same)

if __name__ == "__main__":
    import torchport.sim  # noqa: F401
    found = check(program)
    for d in found:
        print(f"step {d['k']} [{d['tag']}] {d['kind']}: {d['detail']}")
    raise SystemExit(1 if found else 0)
