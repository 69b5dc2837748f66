"""Fuzz repro: device-accepts [out:cpu0dim@int64] (default mode)

First seen: program 0/30 step 11: CUDA raises RuntimeError; the device returned

From `python -m torchport.tools.fuzz` (seed/program 0/30, mode default). Runs the program below on the CPU and on sim,
then compares them step by step; exits 1 listing the differences while any remain:

    python {this file}

The helpers are torchport.tools.fuzz.prelude's, as the fuzzer's own.
"""
# fuzz-corpus: subprocess
from torchport.tools.fuzz.prelude import *  # noqa: F403 (check, mk, torch...)


# ---- the program ----------------------------------------------------------------------
def program(dev, dev1, rec):
    with rec.step(0, 'create', strides=('t3',), on={'t3': 'dev'}):
        t3 = mk((1,), torch.int8, 46136).to(dev)
        rec.keep(t3=t3)
    with rec.step(1, 'out:right@int8', exact=False):
        o9 = torch.empty((), dtype=torch.int64, device=dev)
        t10 = torch.sum(t3, 0, out=o9)
        same = t10 is o9
        rec.keep(o9=o9, t10=t10, same=same)
    with rec.step(2, 'out:cpu0dim@int64', expect='RuntimeError'):
        o11 = torch.empty((), dtype=torch.int64)
        t12 = torch.mul(t10, t10, out=o11)
        same = t12 is o11
        rec.keep(o11=o11, t12=t12, same=same)

if __name__ == "__main__":
    import torchport.sim  # noqa: F401
    found = check(program)
    for d in found:
        print(f"step {d['k']} [{d['tag']}] {d['kind']}: {d['detail']}")
    raise SystemExit(1 if found else 0)
