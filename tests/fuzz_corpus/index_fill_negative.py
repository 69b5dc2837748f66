"""Fuzz repro: device-raises [index_fill:negative@float32] IndexError (default mode)

First seen: program 100/16 step 10: IndexError: index_copy_(): index -3 is out of bounds for dimension 1 with size 4

From `python -m torchport.tools.fuzz` (seed/program 100/16, mode default). Runs the program below on the CPU and on sim,
then compares them step by step; exits 1 listing the differences while any remain:

    python {this file}

The helpers are torchport.tools.fuzz.prelude's, as the fuzzer's own.
"""
from torchport.tools.fuzz.prelude import *  # noqa: F403 (check, mk, torch...)


# ---- the program ----------------------------------------------------------------------
def program(dev, dev1, rec):
    with rec.step(0, 'create', strides=('t3',), on={'t3': 'dev'}):
        t3 = mk((4, 4), torch.float32, 817165).to(dev)
        rec.keep(t3=t3)
    with rec.step(1, 'index_fill:negative@float32', strides=('t3',)):
        t3.index_fill_(1, torch.tensor([-3], device=dev), 2)
        rec.keep(t3=t3)

if __name__ == "__main__":
    import torchport.sim  # noqa: F401
    found = check(program)
    for d in found:
        print(f"step {d['k']} [{d['tag']}] {d['kind']}: {d['detail']}")
    raise SystemExit(1 if found else 0)
