"""Fuzz repro: device-raises [copysign:scalar@int32] RuntimeError (default mode)

First seen: program 101/9 step 5: RuntimeError: aten::copysign() Expected a value of type 'Tensor' for argument 'other' but instead found type 'float'.

From `python -m torchport.tools.fuzz` (seed/program 101/9, mode default). Runs the program below on the CPU and on sim,
then compares them step by step; exits 1 listing the differences while any remain:

    python {this file}

The helpers are torchport.tools.fuzz.prelude's, as the fuzzer's own.
"""
from torchport.tools.fuzz.prelude import *  # noqa: F403 (check, mk, torch...)


# ---- the program ----------------------------------------------------------------------
def program(dev, dev1, rec):
    with rec.step(0, 'create', strides=('t4',), on={'t4': 'dev'}):
        t4 = mk((2, 3), torch.int32, 207120).to(dev)
        rec.keep(t4=t4)
    with rec.step(1, 'copysign:scalar@int32'):
        t6 = torch.copysign(t4, 0.0)
        rec.keep(t6=t6)

if __name__ == "__main__":
    import torchport.sim  # noqa: F401
    found = check(program)
    for d in found:
        print(f"step {d['k']} [{d['tag']}] {d['kind']}: {d['detail']}")
    raise SystemExit(1 if found else 0)
