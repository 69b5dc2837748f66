"""Fuzz repro: device-accepts [unary:hardshrink@uint8] NotImplementedError (default mode)

First seen: program 0/129 step 11: cpu NotImplementedError: "hardshrink_cpu" not implemented for 'Byte'

From `python -m torchport.tools.fuzz` (seed/program 0/129, mode default). Runs the program below on the CPU and on sim,
then compares them step by step; exits 1 listing the differences while any remain:

    python {this file}

The helpers are torchport.tools.fuzz.prelude's, as the fuzzer's own.
"""
from torchport.tools.fuzz.prelude import *  # noqa: F403 (check, mk, torch...)


# ---- the program ----------------------------------------------------------------------
def program(dev, dev1, rec):
    with rec.step(0, 'create', strides=('t2',), on={'t2': 'dev'}):
        t2 = mk((), torch.uint8, 901403).to(dev)
        rec.keep(t2=t2)
    with rec.step(1, 'unary:trunc@uint8'):
        t7 = torch.trunc(t2)
        rec.keep(t7=t7)
    with rec.step(2, 'unary:hardshrink@uint8'):
        t9 = torch.nn.functional.hardshrink(t7)
        rec.keep(t9=t9)

if __name__ == "__main__":
    import torchport.sim  # noqa: F401
    found = check(program)
    for d in found:
        print(f"step {d['k']} [{d['tag']}] {d['kind']}: {d['detail']}")
    raise SystemExit(1 if found else 0)
