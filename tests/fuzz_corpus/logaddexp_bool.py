"""Fuzz repro: error-type [logaddexp:tensor@bool] NotImplementedError/RuntimeError (default mode)

First seen: program 7/442 step 6: cpu NotImplementedError: "logaddexp_cpu" not implemented for 'Bool' | device RuntimeError: Subtraction, the `-` operator, with two bool tensors is not supported. Use the `^` or `logical_xor()` operator instead.

From `python -m torchport.tools.fuzz` (seed/program 7/442, mode default; 7/289 the same with a
0-dim CPU operand), trimmed by hand. Runs the program below on the CPU and on sim, then compares
them step by step; exits 1 listing the differences while any remain:

    python {this file}

The helpers are torchport.tools.fuzz.prelude's, as the fuzzer's own.
"""
from torchport.tools.fuzz.prelude import *  # noqa: F403 (check, mk, torch...)


# ---- the program ----------------------------------------------------------------------
def program(dev, dev1, rec):
    with rec.step(0, 'create', strides=('t2',), on={'t2': 'dev'}):
        t2 = mk((3,), torch.bool, 451465).to(dev)
        rec.keep(t2=t2)
    with rec.step(1, 'view:view@bool', strides=('t5',)):
        t5 = t2.view(-1)
        rec.keep(t5=t5)
    with rec.step(2, 'logaddexp:tensor@float32', exact=False):
        t6 = torch.logaddexp(t5.float(), t2.float())  # the op's decomposition, taken once
        rec.keep(t6=t6)
    with rec.step(3, 'logaddexp:tensor@bool', exact=False):
        t7 = torch.logaddexp(t5, t2)
        rec.keep(t7=t7)
    with rec.step(4, 'logaddexp:cpu0dim@bool', exact=False, expect='RuntimeError'):  # CUDA's device check first
        t8 = torch.logaddexp(t2, torch.tensor(True))
        rec.keep(t8=t8)

if __name__ == "__main__":
    import torchport.sim  # noqa: F401
    found = check(program)
    for d in found:
        print(f"step {d['k']} [{d['tag']}] {d['kind']}: {d['detail']}")
    raise SystemExit(1 if found else 0)
