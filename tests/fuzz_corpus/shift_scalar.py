"""Fuzz repro: device-raises [shift:scalar@int64] RuntimeError (default mode)

First seen: program 100/36 step 4: RuntimeError: aten::bitwise_left_shift() Expected a value of type 'Tensor' for argument 'other' but instead found type 'int'.

From `python -m torchport.tools.fuzz` (seed/program 100/36, mode default). Runs the program below on the CPU and on sim,
then compares them step by step; exits 1 listing the differences while any remain:

    python {this file}

The helpers are torchport.tools.fuzz.prelude's, as the fuzzer's own.
"""
from torchport.tools.fuzz.prelude import *  # noqa: F403 (check, mk, torch...)


# ---- the program ----------------------------------------------------------------------
def program(dev, dev1, rec):
    with rec.step(0, 'factory:arange', strides=('t1',), on={'t1': 'dev'}):
        t1 = torch.arange(6, dtype=torch.int64, device=dev)
        rec.keep(t1=t1)
    with rec.step(1, 'shift:scalar@int64'):
        t5 = torch.bitwise_left_shift(t1, 3)
        rec.keep(t5=t5)

if __name__ == "__main__":
    import torchport.sim  # noqa: F401
    found = check(program)
    for d in found:
        print(f"step {d['k']} [{d['tag']}] {d['kind']}: {d['detail']}")
    raise SystemExit(1 if found else 0)
