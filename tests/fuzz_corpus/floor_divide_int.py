"""Fuzz repro: device-raises [floor_divide:cpu0dim@int64] RuntimeError (default mode)

First seen: program 7/2015 step 13: RuntimeError: ZeroDivisionError

From `python -m torchport.tools.fuzz` (seed/program 7/2015, mode default; the probe of refused dtypes ran the CPU kernel on zeros, and took its integer division by zero for a refusal). Runs the program below on the CPU and on sim,
then compares them step by step; exits 1 listing the differences while any remain:

    python {this file}

The helpers are torchport.tools.fuzz.prelude's, as the fuzzer's own.
"""
from torchport.tools.fuzz.prelude import *  # noqa: F403 (check, mk, torch...)


# ---- the program ----------------------------------------------------------------------
def program(dev, dev1, rec):
    with rec.step(0, 'create', strides=('t1',), on={'t1': 'dev'}):
        t1 = mk((), torch.float16, 275856).to(dev)
        rec.keep(t1=t1)
    with rec.step(1, 'create', strides=('t2',), on={'t2': 'dev'}):
        t2 = mk((5,), torch.int64, 533677).to(dev)
        rec.keep(t2=t2)
    with rec.step(2, 'maximum:tensor@int64'):
        t6 = torch.maximum(t2, t1)
        rec.keep(t6=t6)
    with rec.step(3, 'index:nonzero@float16'):
        t7 = torch.nonzero(t6)
        rec.keep(t7=t7)
    with rec.step(4, 'floor_divide:cpu0dim@int64'):
        t14 = torch.floor_divide(t7, torch.tensor(1))
        rec.keep(t14=t14)

if __name__ == "__main__":
    import torchport.sim  # noqa: F401
    found = check(program)
    for d in found:
        print(f"step {d['k']} [{d['tag']}] {d['kind']}: {d['detail']}")
    raise SystemExit(1 if found else 0)
