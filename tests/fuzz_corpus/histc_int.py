"""Fuzz repro: device-accepts [reduce:histc@int64] NotImplementedError (default mode)

First seen: program 0/14 step 13: cpu NotImplementedError: "histogram_cpu" not implemented for 'Long'

From `python -m torchport.tools.fuzz` (seed/program 0/14, mode default). Runs the program below on the CPU and on sim,
then compares them step by step; exits 1 listing the differences while any remain:

    python {this file}

The helpers are torchport.tools.fuzz.prelude's, as the fuzzer's own.
"""
from torchport.tools.fuzz.prelude import *  # noqa: F403 (check, mk, torch...)


# ---- the program ----------------------------------------------------------------------
def program(dev, dev1, rec):
    with rec.step(0, 'create', strides=('t2',), on={'t2': 'dev'}):
        t2 = mk((2, 3, 4), torch.bool, 491455).to(dev)
        rec.keep(t2=t2)
    with rec.step(1, 'view:narrow@bool', strides=('t5',)):
        t5 = t2.narrow(0, 0, 1)
        rec.keep(t5=t5)
    with rec.step(2, 'view:step-slice@bool', strides=('t14',)):
        t14 = t5[::2]
        rec.keep(t14=t14)
    with rec.step(3, 'index:nonzero@bool'):
        t16 = torch.nonzero(t14)
        rec.keep(t16=t16)
    with rec.step(4, 'reduce:histc@int64'):
        t18 = torch.histc(t16, bins=4)
        rec.keep(t18=t18)

if __name__ == "__main__":
    import torchport.sim  # noqa: F401
    found = check(program)
    for d in found:
        print(f"step {d['k']} [{d['tag']}] {d['kind']}: {d['detail']}")
    raise SystemExit(1 if found else 0)
