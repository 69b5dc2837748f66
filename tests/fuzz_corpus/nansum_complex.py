"""Fuzz repro: device-accepts [reduce:nansum:all@complex64] (default mode, written from the op table)

First seen: cpu RuntimeError: nansum on CPU does not support complex inputs

From `python -m torchport.tools.fuzz` (seed/program 0/0, mode default). Runs the program below on the CPU and on sim,
then compares them step by step; exits 1 listing the differences while any remain:

    python {this file}

The helpers are torchport.tools.fuzz.prelude's, as the fuzzer's own.
"""
from torchport.tools.fuzz.prelude import *  # noqa: F403 (check, mk, torch...)


# ---- the program ----------------------------------------------------------------------
def program(dev, dev1, rec):
    with rec.step(0, 'create', strides=('t1',)):
        t1 = mk((3,), torch.complex64, 1).to(dev)
        rec.keep(t1=t1)
    with rec.step(1, 'reduce:nansum:all@complex64'):
        t2 = torch.nansum(t1)
        rec.keep(t2=t2)

if __name__ == "__main__":
    import torchport.sim  # noqa: F401
    found = check(program)
    for d in found:
        print(f"step {d['k']} [{d['tag']}] {d['kind']}: {d['detail']}")
    raise SystemExit(1 if found else 0)
