"""Fuzz repro: device-raises [copy:pyscalar@float32] AttributeError (strict mode)

First seen: program 100/7 step 18: AttributeError: 'float' object has no attribute 'device'

From `python -m torchport.tools.fuzz` (seed/program 100/7, mode strict). Runs the program below on the CPU and on sim,
then compares them step by step; exits 1 listing the differences while any remain:

    TORCHPORT_SIM_STRICT=1 python {this file}

The helpers are torchport.tools.fuzz.prelude's, as the fuzzer's own.
"""
from torchport.tools.fuzz.prelude import *  # noqa: F403 (check, mk, torch...)


# ---- the program ----------------------------------------------------------------------
def program(dev, dev1, rec):
    with rec.step(0, 'factory:full', strides=('t5',), on={'t5': 'dev'}):
        t5 = torch.full((3,), 0.0, dtype=torch.float32, device=dev)
        rec.keep(t5=t5)
    with rec.step(1, 'view:squeeze@float32', strides=('t6',)):
        t6 = t5.squeeze()
        rec.keep(t6=t6)
    with rec.step(2, 'copy:pyscalar@float32', strides=('t6', 't5')):
        t6.copy_(0.0)
        rec.keep(t6=t6, t5=t5)

if __name__ == "__main__":
    import torchport.sim  # noqa: F401
    found = check(program)
    for d in found:
        print(f"step {d['k']} [{d['tag']}] {d['kind']}: {d['detail']}")
    raise SystemExit(1 if found else 0)
