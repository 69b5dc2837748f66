"""Fuzz repros: paths learnt on an overload's first call, met by later calls (default mode)

Found by probes of the fuzzer's same-op sequences, rebuilt by hand: a decomposition chosen
on aminmax.out's first call raised RuntimeError where the kernel raises IndexError (an empty
dim); a refusal learnt from a Python number's value (bool // 0, an int8 threshold of inf)
was applied to the overload's later calls with other numbers; threshold's decomposition
compared in the promoted type where the kernels convert the threshold to int first

Runs the program below on the CPU and on sim,
then compares them step by step; exits 1 listing the differences while any remain:

    python {this file}

The helpers are torchport.tools.fuzz.prelude's, as the fuzzer's own.
"""
from torchport.tools.fuzz.prelude import *  # noqa: F403 (check, mk, torch...)


# ---- the program ----------------------------------------------------------------------
def program(dev, dev1, rec):
    with rec.step(0, 'seq:aminmax@float32'):
        t1 = torch.aminmax(mk((2, 3), torch.float32, 1).to(dev), dim=0, out=(torch.empty(0, device=dev), torch.empty(0, device=dev)))
        rec.keep(t1=t1)
    with rec.step(1, 'seq:aminmax@float32'):
        t2 = torch.aminmax(mk((0, 3), torch.float32, 2).to(dev), dim=0, out=(torch.empty(0, device=dev), torch.empty(0, device=dev)))
        rec.keep(t2=t2)
    with rec.step(2, 'seq:floor_divide@bool'):
        t3 = mk((), torch.bool, 3).to(dev) // 0
        rec.keep(t3=t3)
    with rec.step(3, 'seq:floor_divide@bool'):
        t4 = mk((4,), torch.bool, 4).to(dev) // -1
        rec.keep(t4=t4)
    with rec.step(4, 'seq:threshold-int@int8'):
        t5 = torch.nn.functional.threshold(mk((2, 1), torch.int8, 5).to(dev), True, float('inf'))
        rec.keep(t5=t5)
    with rec.step(5, 'seq:threshold-int@int8'):
        t6 = torch.nn.functional.threshold(mk((), torch.int8, 6).to(dev), False, 2.5)
        rec.keep(t6=t6)
    with rec.step(6, 'seq:threshold-int@int32'):
        t7 = torch.nn.functional.threshold(mk((3, 4), torch.int32, 7).to(dev), -0.5, 7)
        rec.keep(t7=t7)

if __name__ == "__main__":
    import torchport.sim  # noqa: F401
    found = check(program)
    for d in found:
        print(f"step {d['k']} [{d['tag']}] {d['kind']}: {d['detail']}")
    raise SystemExit(1 if found else 0)
