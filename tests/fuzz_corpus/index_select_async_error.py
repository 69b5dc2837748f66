"""Fuzz repro: error-type [index:index_select@float32] IndexError/SimAsyncError (async mode)

First seen: program 11/67 step 8: cpu IndexError: index out of range in self | device SimAsyncError: sim: aten::index_select failed asynchronously on sim:0 stream 0: RuntimeError: index out of range in self (set TORCHPORT_LAUNCH_BLOCKING=1 to get the error where the op is called)

From `python -m torchport.tools.fuzz` (seed/program 11/67, mode async). Runs the program below on the CPU and on sim,
then compares them step by step; exits 1 listing the differences while any remain:

    TORCHPORT_SIM_ASYNC=1 python {this file}

The helpers are torchport.tools.fuzz.prelude's, as the fuzzer's own.
"""
from torchport.tools.fuzz.prelude import *  # noqa: F403 (check, mk, torch...)


# ---- the program ----------------------------------------------------------------------
def program(dev, dev1, rec):
    with rec.step(0, 'factory:full', strides=('t1',), on={'t1': 'dev'}):
        t1 = torch.full((4, 4), 2.5, dtype=torch.complex64, device=dev)
        rec.keep(t1=t1)
    with rec.step(1, 'linalg:norm@complex64', exact=False):
        t6 = torch.linalg.norm(t1)
        rec.keep(t6=t6)
    with rec.step(2, 'resize@float32', strides=('t6',)):
        t6.resize_((1,))
        rec.keep(t6=t6)
    with rec.step(3, 'index:index_select@float32'):
        t8 = torch.index_select(t6, 0, torch.tensor([-1, -1, -1], dtype=torch.int64, device=dev))
        rec.keep(t8=t8)

if __name__ == "__main__":
    import torchport.sim  # noqa: F401
    found = check(program)
    for d in found:
        print(f"step {d['k']} [{d['tag']}] {d['kind']}: {d['detail']}")
    raise SystemExit(1 if found else 0)
