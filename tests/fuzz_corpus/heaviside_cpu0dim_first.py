"""Fuzz repro: device-raises [seq:heaviside@bfloat16] RuntimeError (default mode)

Found by a probe of the fuzzer's same-op sequences (a 0-dim CPU tensor as the first operand),
rebuilt by hand: ops served by a decomposition (heaviside, logaddexp) raised "cross-device
copies are not allowed" from PyTorch's out= wrapper, which checks the first argument against
the output's device; the kernels take a 0-dim CPU tensor as a scalar operand anywhere

Runs the program below on the CPU and on sim,
then compares them step by step; exits 1 listing the differences while any remain:

    python {this file}

The helpers are torchport.tools.fuzz.prelude's, as the fuzzer's own.
"""
from torchport.tools.fuzz.prelude import *  # noqa: F403 (check, mk, torch...)


# ---- the program ----------------------------------------------------------------------
def program(dev, dev1, rec):
    with rec.step(0, 'seq:heaviside@bfloat16'):
        t1 = torch.heaviside(mk((), torch.bfloat16, 5), mk((), torch.bfloat16, 6).to(dev))
        rec.keep(t1=t1)
    with rec.step(1, 'seq:heaviside@float32'):
        t2 = torch.heaviside(mk((), torch.float32, 7), mk((3,), torch.float32, 8).to(dev))
        rec.keep(t2=t2)
    with rec.step(2, 'logaddexp:cpu0dim-first', exact=False, expect='RuntimeError'):  # CUDA checks logaddexp's devices
        t3 = torch.logaddexp(mk((), torch.float32, 9), mk((2, 3), torch.float32, 10).to(dev))
        rec.keep(t3=t3)

if __name__ == "__main__":
    import torchport.sim  # noqa: F401
    found = check(program)
    for d in found:
        print(f"step {d['k']} [{d['tag']}] {d['kind']}: {d['detail']}")
    raise SystemExit(1 if found else 0)
