"""Fuzz repro: device-raises [module:BatchNorm2d+SGD-momentum] AttributeError (async mode)

First seen: program 0/74 step 18: AttributeError: 'NoneType' object has no attribute 'shape'

From `python -m torchport.tools.fuzz` (seed/program 0/74, mode async). Runs the program below on the CPU and on sim,
then compares them step by step; exits 1 listing the differences while any remain:

    TORCHPORT_SIM_ASYNC=1 python {this file}

The helpers are torchport.tools.fuzz.prelude's, as the fuzzer's own.
"""
from torchport.tools.fuzz.prelude import *  # noqa: F403 (check, mk, torch...)


# ---- the program ----------------------------------------------------------------------
def program(dev, dev1, rec):
    with rec.step(0, 'module:BatchNorm2d+SGD-momentum', exact=False):
        torch.manual_seed(212830)
        m20 = torch.nn.BatchNorm2d(2).to(dev)
        opt21 = torch.optim.SGD(m20.parameters(), lr=0.1, momentum=0.9)
        x22 = mk((3, 2, 4, 4), torch.float32, 941537).to(dev)
        for _ in range(1):
            opt21.zero_grad()
            loss24 = m20(x22).square().mean()
            loss24.backward()
            opt21.step()
        t23 = [p.detach() for p in m20.parameters()] + list(m20.buffers())
        rec.keep(loss24=loss24, t23=t23)

if __name__ == "__main__":
    import torchport.sim  # noqa: F401
    found = check(program)
    for d in found:
        print(f"step {d['k']} [{d['tag']}] {d['kind']}: {d['detail']}")
    raise SystemExit(1 if found else 0)
