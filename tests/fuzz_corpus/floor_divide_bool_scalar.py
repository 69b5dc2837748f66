"""Fuzz repro: device-raises [floor_divide:scalar@bool] NotImplementedError (default mode)

First seen: program 7/962 step 14: NotImplementedError: "div_floor_cpu" not implemented for 'Bool'

From `python -m torchport.tools.fuzz` (seed/program 7/962 on a2dc0be, in a worker that had run
hundreds of programs), rebuilt by hand with the history it needed: the decomposition taken once,
then ``bool // True`` (refused by the CPU kernel) taught the device a refusal that
``bool // 1`` then met, the learnt refusals being keyed by tensor dtypes only. Runs the program
below on the CPU and on sim, then compares them step by step; exits 1 listing the differences
while any remain:

    python {this file}

The helpers are torchport.tools.fuzz.prelude's, as the fuzzer's own.
"""
from torchport.tools.fuzz.prelude import *  # noqa: F403 (check, mk, torch...)


# ---- the program ----------------------------------------------------------------------
def program(dev, dev1, rec):
    with rec.step(0, 'create', strides=('t1',), on={'t1': 'dev'}):
        t1 = mk((3,), torch.float32, 17).to(dev)
        rec.keep(t1=t1)
    with rec.step(1, 'create', strides=('t2',), on={'t2': 'dev'}):
        t2 = mk((3,), torch.bool, 748172).to(dev)
        rec.keep(t2=t2)
    with rec.step(2, 'floor_divide:scalar@float32'):
        t3 = torch.floor_divide(t1, 2)
        rec.keep(t3=t3)
    with rec.step(3, 'floor_divide:scalar@bool'):
        t4 = torch.floor_divide(t2, True)
        rec.keep(t4=t4)
    with rec.step(4, 'floor_divide:scalar@bool'):
        t5 = torch.floor_divide(t2, 1)
        rec.keep(t5=t5)

if __name__ == "__main__":
    import torchport.sim  # noqa: F401
    found = check(program)
    for d in found:
        print(f"step {d['k']} [{d['tag']}] {d['kind']}: {d['detail']}")
    raise SystemExit(1 if found else 0)
