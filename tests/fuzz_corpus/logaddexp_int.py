"""Fuzz repro: device-accepts [logaddexp:cpu0dim@int64] NotImplementedError (default mode)

First seen: program 108/31 step 14: cpu NotImplementedError: "logaddexp_cpu" not implemented for 'Long'

From `python -m torchport.tools.fuzz` (seed/program 108/31, mode default). Runs the program below on the CPU and on sim,
then compares them step by step; exits 1 listing the differences while any remain:

    python {this file}

The helpers are torchport.tools.fuzz.prelude's, as the fuzzer's own.
"""
from torchport.tools.fuzz.prelude import *  # noqa: F403 (check, mk, torch...)


# ---- the program ----------------------------------------------------------------------
def program(dev, dev1, rec):
    with rec.step(0, 'create', strides=('t2',), on={'t2': 'dev'}):
        t2 = mk((2, 0, 3), torch.int64, 723093).to(dev)
        rec.keep(t2=t2)
    with rec.step(1, 'op^:cpu0dim@int64'):
        t6 = t2 ^ torch.tensor(3)
        rec.keep(t6=t6)
    with rec.step(2, 'shift:tensor@int64'):
        t9 = t2 >> t6
        rec.keep(t9=t9)
    with rec.step(3, 'contiguous@int64', strides=('t10',)):
        t10 = t9.contiguous()
        rec.keep(t10=t10)
    with rec.step(4, 'logaddexp:cpu0dim@int64', exact=False, expect='RuntimeError'):  # CUDA's device check first
        t15 = torch.logaddexp(t10, torch.tensor(2))
        rec.keep(t15=t15)

if __name__ == "__main__":
    import torchport.sim  # noqa: F401
    found = check(program)
    for d in found:
        print(f"step {d['k']} [{d['tag']}] {d['kind']}: {d['detail']}")
    raise SystemExit(1 if found else 0)
