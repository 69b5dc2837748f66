"""Asynchronous sim (``TORCHPORT_SIM_ASYNC=1``): ATen kernels are queued on the stream.

The runtime reads its settings at start, so each case runs in a fresh process.
Ordering is made deterministic with a gate: a launch that blocks the stream's
worker until the test opens it, so "the host ran ahead" is observed, not timed.
"""

from __future__ import annotations

import os
import textwrap

import pytest

from tests.helpers import run_python
from torchport.core import native, settings

STRICT = settings.get("TORCHPORT_SIM_STRICT")
needs_cpp = pytest.mark.skipif(native.loaded() is None or STRICT,
                               reason="C++ queues host ops on host-addressable memory "
                               "(not with TORCHPORT_NATIVE=0, no compiler, the strict sim)")

PRELUDE = """
import threading, torch, torchport.sim
rt = torchport.sim.runtime
assert rt.asynchronous
gate = threading.Event()
def close_gate(stream=None):
    gate.clear()
    rt.launch(0, stream, gate.wait, "gate")
def raises_at_the_call(call, message):
    try:
        call()
    except RuntimeError as e:
        assert message in str(e), str(e)
    else:
        raise AssertionError("no error at the call")
"""


def run(code: str, **env: str) -> str:
    full = PRELUDE + textwrap.dedent(code)
    e = {**os.environ, "TORCHPORT_SIM_ASYNC": "1", **env}
    p = run_python(full, env=e)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def test_kernels_are_queued_and_results_match_cpu():
    out = run("""
        a, b = torch.randn(64, 64), torch.randn(64, 64)
        da, db = a.to("sim"), b.to("sim")
        close_gate()
        c = torch.tanh(da @ db) + da.sum(0)       # three kernels, queued behind the gate
        assert not torch.sim.current_stream().query()
        w = rt._workers[(0, 0)]
        assert w.submitted - w.completed >= 4, (w.submitted, w.completed)
        gate.set()
        torch.testing.assert_close(c.cpu(), torch.tanh(a @ b) + a.sum(0), rtol=0, atol=0)
        assert torch.sim.current_stream().query()
        print("ok")
    """)
    assert "ok" in out


def test_queued_kernels_write_results_made_in_inference_mode():
    # Found by running the migrated inference example asynchronously: the results of ops
    # called in torch.inference_mode() are inference tensors, and so are the host views
    # the worker writes; the worker runs outside the caller's mode.
    out = run("""
        x, w = torch.randn(16, 32), torch.randn(8, 32)
        dx, dw = x.to("sim"), w.to("sim")
        with torch.inference_mode():
            close_gate()
            y = torch.nn.functional.linear(dx, dw, dw[:, 0])  # addmm, queued
            z = torch.relu(y) * 2
            gate.set()
            assert y.is_inference() and z.is_inference()
            torch.sim.synchronize()
        want = torch.relu(torch.nn.functional.linear(x, w, w[:, 0])) * 2
        assert torch.equal(z.cpu(), want)
        dx.mul_(3)                                 # outside the mode: plain tensors again
        r = (dx * dx).sum()
        x3 = x * 3
        assert not r.is_inference() and torch.equal(r.cpu(), (x3 * x3).sum())
        print("ok")
    """)
    assert "ok" in out


def test_queued_results_have_the_cpu_kernels_strides():
    # The meta kernel of x + 1, x of shape (1, 4) and strides (1, 1), says (4, 1); the CPU
    # kernel keeps (1, 1). The queued op must give the CPU's layout without waiting.
    out = run("""
        cases = [torch.arange(4.).as_strided((1, 4), (1, 1)),
                 torch.arange(6.).as_strided((3, 1, 2), (2, 7, 1)),
                 torch.arange(12.).view(3, 4).t(), torch.ones(2, 1, 3)[:, :, ::2]]
        for x in cases:
            d = x.to("sim")
            for _ in range(2):                  # the first call with a layout, then a later one
                close_gate()
                ys = [d + 1, torch.exp(d), d * d, torch.sigmoid(d)]
                assert not torch.sim.current_stream().query()   # queued behind the gate
                gate.set()
                for y, want in zip(ys, [x + 1, torch.exp(x), x * x, torch.sigmoid(x)]):
                    assert y.stride() == want.stride(), (x.stride(), y.stride(), want.stride())
                    assert torch.equal(y.cpu(), want)
        print("ok")
    """)
    assert "ok" in out


def test_queued_ops_whose_out_overload_cannot_be_trusted_match_cpu():
    # Found by the conformance harness in asynchronous mode: binary_cross_entropy's out=
    # kernel stages its unreduced loss in ``out`` (a resize past the block: wrong values),
    # embedding_bag's resizes too (a crash), layer_norm's meta kernel gives float32
    # statistics where the CPU gives the input's dtype, batch_norm in eval mode returns
    # empty statistics where the meta kernel says (C,). These take the host's path.
    out = run("""
        import torch.nn.functional as F
        g = torch.Generator().manual_seed(0)
        x, y = torch.rand(5, 5, generator=g), torch.rand(5, 5, generator=g)
        w, b = torch.randn(5, generator=g), torch.randn(5, generator=g)
        table, idx = torch.randn(10, 3, generator=g), torch.tensor([1, 2, 4, 5, 4, 3, 2, 9])
        offsets = torch.tensor([0, 4])
        cases = [
            (F.binary_cross_entropy, (x, y)),
            (F.binary_cross_entropy, (x[0], y[0])),
            (F.embedding_bag, (idx, table, offsets)),
            (torch.ops.aten.native_layer_norm, (x.bfloat16(), [5], w.bfloat16(), b.bfloat16(), 1e-5)),
            (torch.ops.aten.native_layer_norm, (x.half(), [5], None, None, 1e-5)),
            (torch.ops.aten.native_batch_norm, (x, w, b, torch.zeros(5), torch.ones(5), False, 0.1, 1e-5)),
        ]
        dev = lambda v: v.to("sim") if isinstance(v, torch.Tensor) else v
        for fn, args in cases:
            for _ in range(2):                  # the first call with a layout, then a later one
                want = fn(*args)
                got = fn(*[dev(a) for a in args])
                want = want if isinstance(want, tuple) else (want,)
                got = got if isinstance(got, tuple) else (got,)
                for c, d in zip(want, got, strict=True):
                    assert (d.shape, d.stride(), d.dtype) == (c.shape, c.stride(), c.dtype), fn
                    assert torch.equal(d.cpu(), c), fn
        print("ok")
    """)
    assert "ok" in out


def test_in_place_updates_are_queued_and_match_cpu():
    """A real device's host enqueues ``add_`` and returns: elementwise in-place ops, fills
    and an optimizer's foreach updates are queued behind the gate, the host runs ahead,
    and the values are the CPU's."""
    out = run("""
        g = torch.Generator().manual_seed(0)
        a, b = torch.randn(33, 17, generator=g), torch.randn(33, 17, generator=g)
        ps = [torch.randn(5, generator=g), torch.randn(3, 4, generator=g)]
        gs = [torch.randn(5, generator=g), torch.randn(3, 4, generator=g)]
        da, db = a.to("sim"), b.to("sim")
        dps, dgs = [p.to("sim") for p in ps], [x.to("sim") for x in gs]
        n = torch.arange(12, dtype=torch.int32).to("sim")
        torch.sim.synchronize()
        w = rt._workers[(0, 0)]
        for step in range(2):                       # the first call with a layout, then a later one
            close_gate()
            timer = threading.Timer(20, gate.set)   # (a host that waits fails, not hangs)
            timer.start()
            before = w.submitted
            r = da.mul_(0.5).add_(db, alpha=2.0)    # returns its argument, queued
            assert r is da
            da.t().sub_(db.t()).clamp_(min=-1.0)    # a transposed view
            db.fill_(0.25)
            db.addcmul_(da, da, value=3)
            torch._foreach_add_(dps, dgs, alpha=-0.1)
            torch._foreach_mul_(dps, 0.9)
            n.add_(2).mul_(3)
            assert w.submitted - before == 10 and not torch.sim.current_stream().query(), \
                (w.submitted - before)
            gate.set()
            timer.cancel()
            a.mul_(0.5).add_(b, alpha=2.0)
            a.t().sub_(b.t()).clamp_(min=-1.0)
            b.fill_(0.25)
            b.addcmul_(a, a, value=3)
            torch._foreach_add_(ps, gs, alpha=-0.1)
            torch._foreach_mul_(ps, 0.9)
            assert torch.equal(da.cpu(), a) and torch.equal(db.cpu(), b)
            assert all(torch.equal(d.cpu(), c) for d, c in zip(dps, ps))
        assert n.cpu().tolist() == [((i + 2) * 3 + 2) * 3 for i in range(12)]
        print("ok")
    """)
    assert "ok" in out


def test_in_place_trial_is_once_per_layout_not_per_step_size():
    """An optimizer's foreach update passes new step sizes each step (a list of floats):
    the layout trial runs once, not every step (it runs the op on stand-ins of every
    parameter: a large model's step doubled)."""
    out = run("""
        from torchport.ops.hostkernels import trials
        n = [0]
        tried = trials.inplace_launchable
        def counted(*a, **k):
            n[0] += 1
            return tried(*a, **k)
        trials.inplace_launchable = counted
        ps = [torch.randn(3, device="sim"), torch.randn(2, 2, device="sim")]
        gs = [torch.rand(3, device="sim") + 1, torch.rand(2, 2, device="sim") + 1]
        want = [p.cpu() for p in ps]
        for step in range(1, 6):
            sizes = [0.1 / step, 0.2 / step]
            torch._foreach_addcdiv_(ps, gs, gs, sizes)
            torch._foreach_addcdiv_(want, [g.cpu() for g in gs], [g.cpu() for g in gs], sizes)
            ps[0].mul_(1.0 - 0.01 * step)
            want[0].mul_(1.0 - 0.01 * step)
        assert n[0] == 2, n                       # one per op and layout
        assert all(torch.equal(p.cpu(), w) for p, w in zip(ps, want))
        print("ok")
    """)
    assert "ok" in out


def test_in_place_errors_stay_at_the_call():
    """What the CPU refuses for the arguments' dtypes or layouts raises at the call, as
    on CUDA (the host checks before it enqueues), leaving the tensor as it was: a float
    into an integer tensor, a broadcast that would resize, a written tensor that overlaps
    itself or its input, an integer division by zero (the host computes those: its error
    is the CPU's)."""
    out = run("""
        x = torch.arange(6, device="sim")
        f = torch.ones(2, 3, device="sim")
        v = torch.arange(6.0, device="sim")
        cases = [
            (lambda: x.add_(1.5), lambda: torch.arange(6).add_(1.5)),
            (lambda: f.add_(torch.ones(4, 2, 3, device="sim")),
             lambda: torch.ones(2, 3).add_(torch.ones(4, 2, 3))),
            (lambda: v[:1].expand(4).add_(1), lambda: torch.zeros(1).expand(4).add_(1)),
            (lambda: v[1:].add_(v[:-1]), lambda: (lambda c: c[1:].add_(c[:-1]))(torch.arange(6.0))),
            (lambda: x.div_(torch.zeros(6, dtype=torch.int64, device="sim"), rounding_mode="floor"),
             lambda: torch.arange(6).div_(torch.zeros(6, dtype=torch.int64), rounding_mode="floor")),
        ]
        for _ in range(2):
            for dev, cpu in cases:
                try:
                    cpu()
                except RuntimeError as e:
                    want = str(e).splitlines()[0]
                else:
                    raise AssertionError("the CPU accepts it")
                try:
                    dev()
                except RuntimeError as e:
                    assert str(e).splitlines()[0] == want, (str(e), want)
                else:
                    raise AssertionError("no error at the call: " + want)
        torch.sim.synchronize()                   # nothing failed on the stream
        assert x.cpu().tolist() == list(range(6)) and v.cpu().tolist() == [float(i) for i in range(6)]
        print("ok")
    """)
    assert "ok" in out


def test_calls_their_shapes_or_dtypes_refuse_raise_without_waiting_for_the_stream():
    """A call whose arguments' layouts alone refuse it (shapes that do not broadcast or
    multiply, a dtype that cannot be cast) raises at the call as CUDA's host checks do,
    before the queued kernels ran, with the CPU's words; the arguments stay as they were
    and the CPU's random numbers untouched."""
    out = run("""
        d = lambda *s, **k: torch.ones(*s, device="sim", **k)
        c = lambda *s, **k: torch.ones(*s, **k)
        cases = {
            "broadcast": lambda t: t(5, 6) + t(4),
            "matmul": lambda t: t(5, 6) @ t(5, 6),
            "cat": lambda t: torch.cat([t(5, 6), t(5, 7)]),
            "lerp dtypes": lambda t: torch.lerp(t(3), t(3, dtype=torch.long), 0.5),
            "in-place dtype": lambda t: t(3, dtype=torch.long).add_(t(3) * 0.5),
            "in-place broadcast": lambda t: t(1, 6).add_(t(5, 6)),
            "out= dtype": lambda t: torch.add(t(3), t(3), out=t(3, dtype=torch.long)),
            "random": lambda t: torch.normal(t(5, 6), t(4)),
        }
        x = torch.arange(6.0, device="sim")
        for _ in range(2):                        # a layout's first call, then a later one
            for name, call in cases.items():
                try:
                    call(c)
                except RuntimeError as e:
                    want = str(e).splitlines()[0]
                else:
                    raise AssertionError(name + ": the CPU accepts it")
                close_gate()
                x.mul_(2)                         # queued behind the gate
                timer = threading.Timer(10.0, gate.set)   # (a call that waits returns then)
                timer.start()
                cpu_rng = torch.get_rng_state()
                raises_at_the_call(lambda: call(d), want)
                assert not gate.is_set(), name + ": the call waited for the stream"
                assert torch.equal(torch.get_rng_state(), cpu_rng), name
                gate.set()
                timer.cancel()
        assert x.cpu().tolist() == [float(i * 2 ** 16) for i in range(6)]
        print("ok")
    """)
    assert "ok" in out


def test_host_reads_wait_for_queued_work():
    out = run("""
        x = torch.zeros(1000, device="sim")
        close_gate()
        y = x + 1                                   # queued
        threading.Timer(0.2, gate.set).start()
        assert y.sum().item() == 1000.0             # .item() synchronises first
        z = torch.ones(4, device="sim")
        close_gate()
        w = z * 3
        threading.Timer(0.2, gate.set).start()
        assert w.tolist() == [3.0] * 4              # .cpu() copies after the queued kernel
        print("ok")
    """)
    assert "ok" in out


def test_kernel_error_is_reported_at_next_sync_and_device_stays_usable():
    out = run("""
        x = torch.randn(5, device="sim")
        bad = torch.tensor([0, 7], device="sim")    # index 7 is out of range
        y = x.index_select(0, bad)                  # returns at once; fails on the worker
        try:
            torch.sim.synchronize()
        except RuntimeError as e:
            msg = str(e)
        else:
            raise AssertionError("no error reported")
        assert "index_select" in msg, msg
        assert (x * 2).cpu().equal(x.cpu() * 2)    # the device still works
        print("ok")
    """)
    assert "ok" in out


def test_streams_run_independently_and_wait_event_orders_them():
    out = run("""
        s = torch.sim.Stream()
        a = torch.ones(256, device="sim")
        close_gate()                                 # default stream blocked
        with torch.sim.stream(s):
            b = torch.full((256,), 2.0, device="sim") * 2   # side stream is not blocked
        s.synchronize()
        assert not torch.sim.default_stream().query()
        ev = torch.sim.Event()
        c = a + 1                                    # on the blocked default stream
        ev.record()
        s.wait_event(ev)
        with torch.sim.stream(s):
            d = c * b                                # must wait for c
        gate.set()
        s.synchronize()
        assert d.cpu().eq(8.0).all()
        print("ok")
    """)
    assert "ok" in out


def test_in_place_ops_under_vmap_are_queued_as_elsewhere():
    """Deciding whether an in-place op can be queued computes on stand-ins; under vmap,
    which refuses random ops (gradcheck's batched gradients, ``torch.vmap``), those must
    draw no random numbers: the first ``add_`` of a layout raised vmap's error."""
    out = run("""
        from torch._vmap_internals import vmap as old_vmap
        def f(v):
            y = v * 2
            y.add_(v).mul_(0.5)
            return y
        for vmap in (old_vmap, lambda fn: torch.vmap(fn, randomness="error")):
            for layout in (lambda t: t, lambda t: t.t().contiguous().t()):
                x = layout(torch.arange(12.0).reshape(3, 4))
                got = vmap(f)(x.to("sim"))
                assert torch.equal(got.cpu(), vmap(f)(x)), got
        print("ok")
    """)
    assert out.strip() == "ok"


def test_launch_blocking_makes_every_op_synchronous():
    code = ("import torchport.sim; rt = torchport.sim.runtime; "
            "import torch; x = torch.randn(8, device='sim'); y = x * 2; "
            "print(rt.asynchronous, not rt._workers)")
    p = run_python(code, TORCHPORT_SIM_ASYNC="1", TORCHPORT_LAUNCH_BLOCKING="1")
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["False", "True"]


@pytest.mark.parametrize("steps", [20])
def test_training_matches_sync_run(steps):
    code = f"""
        import torch, torchport.sim
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to("sim")
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        x, y = torch.randn(64, 16).to("sim"), torch.randint(0, 4, (64,)).to("sim")
        for _ in range({steps}):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
        print(repr(loss.item()), repr(m[0].weight.sum().item()))
    """
    outs = []
    for asyn in ("1", "0"):
        p = run_python(code, TORCHPORT_SIM_ASYNC=asyn)
        assert p.returncode == 0, p.stderr
        outs.append(p.stdout)
    assert outs[0] == outs[1]


@needs_cpp
def test_cpp_queues_the_calls_the_python_kernels_taught_it():
    """With the native library, the first call of an op with a layout of its arguments goes
    to its Python kernel, which decides whether it may be queued and teaches C++; later
    calls with that layout are queued from C++ (no Python), on the same stream queue, the
    results bit for bit the CPU's (Python numbers too: the dispatcher's wrapped numbers).
    Another layout is learned on its own; a side stream takes the Python kernel."""
    out = run("""
        from torchport.ops import native_hostops as nh
        from torchport.backends.sim.queues import _NativeWorker
        assert isinstance(rt._worker(0, None), _NativeWorker)
        a, b = torch.randn(16, 16), torch.randn(16, 16)
        params = [torch.randn(5, 3), torch.randn(7)]
        da, db = a.to("sim"), b.to("sim")
        dparams = [p.to("sim") for p in params]
        i = torch.tensor([3, 0, 15, 3])
        di = i.to("sim")
        def calls(x, y, ps, i):
            out = [x + y, torch.relu(x) @ y, (x * y).sum(1), x.t() + y, x * 2, x / 3.0,
                   torch.cat([x, y], 1), x[i], x[:, i]]  # tensor lists, index's Tensor?[]
            z = x.clone()
            z.mul_(y).add_(y, alpha=0.5).mul_(0.25)
            torch._foreach_mul_(ps, 0.5)
            torch._foreach_add_(ps, ps)
            return out + [z]
        want = calls(a, b, params, i)
        calls(da, db, [p.clone() for p in dparams], di)   # the Python kernels learn and teach
        torch.sim.synchronize()
        served, handed, _ = nh.counts()
        close_gate()
        got = calls(da, db, dparams, di)
        assert not torch.sim.current_stream().query()  # queued behind the gate
        s2, h2, _ = nh.counts()
        gate.set()
        for g, w in zip(got, want):
            assert torch.equal(g.cpu(), w), (g, w)
        assert all(torch.equal(p.cpu(), w) for p, w in zip(dparams, params))
        assert h2 - handed <= 1 and s2 - served >= 16, (s2 - served, h2 - handed)  # clone: Python
        with torch.sim.stream(torch.sim.Stream()):
            before = nh.counts()[1]
            c = da + db
            assert nh.counts()[1] == before + 1       # a side stream: the Python kernel
        torch.sim.synchronize()
        assert torch.equal(c.cpu(), a + b)
        print("ok")
    """)
    assert out.strip() == "ok"


@needs_cpp
def test_unboxed_and_boxed_calls_queue_alike_and_keep_their_arguments_references():
    """An op of tensors and numbers that returns one new tensor, or writes its first argument
    and returns it, has an unboxed entry: calls from the bindings, autograd and composite
    ops are queued from their arguments as they are, without a counted reference to them;
    boxed calls (``torch.ops``) reach the same kernel. Each schema shape computes bit for bit
    as the CPU, an in-place call returns its argument, and no reference is left or lost."""
    out = run("""
        import sys
        from torchport.ops import native_hostops as nh
        A = torch.ops.aten
        torch.manual_seed(0)
        a, b, c = torch.randn(8, 8), torch.randn(8, 8), torch.rand(8, 8)
        m = a > 0
        def calls(x, y, z, m):
            out = [torch.relu(x), torch.exp(x),                               # T>T
                   x * y, x @ y, A.mul.Tensor(x, y), x * 2,                    # TT>T
                   x.pow(2), A.mul.Scalar(x, 3.0),                             # TS>T
                   torch.add(x, y, alpha=0.5), A.add.Tensor(x, y, alpha=2),    # TTS>T
                   torch.nn.functional.hardtanh(x, -0.5, 0.5), A.add.Scalar(x, 2, 3),
                   torch.where(m, x, y), torch.lerp(x, y, z),                  # TTT>T
                   torch.addmm(z, x, y, beta=0.5, alpha=2)]                    # TTTSS>T
            w = x.clone()
            ret = [w.relu_(), w.mul_(y), w.mul_(0.5), w.add_(y, alpha=0.25),   # W>W WT>W WS>W
                   A.add_.Tensor(w, z, alpha=-1), torch.nn.functional.hardtanh_(w, -0.3, 0.3)]
            assert all(r is w for r in ret)
            g = x.detach().requires_grad_()
            (torch.relu(g) * y).sum().backward()                              # autograd's calls
            return out + [w, g.grad]
        want = calls(a, b, c, m)
        dev = [t.to("sim") for t in (a, b, c, m)]
        calls(*dev)                                  # the Python kernels learn and teach
        torch.sim.synchronize()
        refs = [sys.getrefcount(t) for t in dev]
        served = nh.counts()[0]
        close_gate()
        got = calls(*dev)
        assert not torch.sim.current_stream().query()  # queued behind the gate
        assert nh.counts()[0] - served >= 18, nh.counts()[0] - served
        gate.set()
        for i, (g, w) in enumerate(zip(got, want)):
            assert torch.equal(g.cpu(), w), (i, g, w)
        del got, g
        torch.sim.synchronize()
        assert [sys.getrefcount(t) for t in dev] == refs, ([sys.getrefcount(t) for t in dev], refs)
        print("ok")
    """)
    assert out.strip() == "ok"


@needs_cpp
def test_calls_queued_while_the_worker_runs_grow_the_ring_and_run_in_order():
    """Jobs wait in a ring of slots the worker runs them in: hundreds of calls queued from C++
    while the worker is held inside one job make the ring grow several times under it, and a
    slot is reused only after its job ran. A chain of in-place and new-result calls over few
    tensors then gives the CPU's bits (any job run out of order, twice, or on a slot's stale
    arguments changes them)."""
    out = run("""
        from torchport.ops import native_hostops as nh
        torch.manual_seed(0)
        a, b = torch.randn(16, 16), torch.randn(16, 16)
        def chain(x, y, n):
            outs = []
            for i in range(n):
                x.mul_(0.5).add_(y, alpha=0.25)
                y = torch.tanh(x + y) * 1.5
                if i % 50 == 0:
                    outs.append(y)
            return outs + [x, y]
        want = chain(a.clone(), b.clone(), 180)   # 900 calls: within the bound (1024)
        da, db = a.to("sim"), b.to("sim")
        chain(da.clone(), db.clone(), 2); torch.sim.synchronize()   # taught to C++
        for round in range(2):                      # the second reuses the grown ring's slots
            x, y = da.clone(), db.clone()
            torch.sim.synchronize()
            served = nh.counts()[0]
            close_gate()
            got = chain(x, y, 180)
            assert not torch.sim.current_stream().query()          # all behind the gate
            assert nh.counts()[0] - served >= 700, nh.counts()[0] - served
            gate.set()
            for i, (g, w) in enumerate(zip(got, want)):
                assert torch.equal(g.cpu(), w), (round, i)
        print("ok")
    """)
    assert out.strip() == "ok"


@needs_cpp
def test_a_block_freed_behind_queued_work_waits_for_it_without_queueing_anything():
    """A block freed while the default stream still has work that reads it goes back to the
    allocator once that work ran: its event is the ticket of the queue's last job, so the
    free submits nothing to the queue (each such free queued a marker job before); the block
    is not handed out before the reads ran, and then it is."""
    out = run("""
        a = torch.arange(4096.0)
        da = a.to("sim")
        (da * 3).sum(); torch.sim.synchronize()              # taught to C++
        w = rt._worker(0, None)
        alloc = torchport.sim.BACKEND.allocator(0)
        close_gate()
        try:
            y = da * 3
            z = y.sum()                                      # reads y, behind the gate
            ptr = y.data_ptr()
            before = w.submitted
            del y
            queued = w.submitted - before                    # by the free: none
            pending = any(b.ptr == ptr for b in alloc.pending_blocks())
            fresh = torch.empty(4096, device="sim")          # not y's while the sum may read it
        finally:
            gate.set()
        assert queued == 0 and pending and fresh.data_ptr() != ptr, (queued, pending)
        assert z.item() == (a * 3).sum().item()
        del fresh
        again = [torch.empty(4096, device="sim") for _ in range(2)]
        assert ptr in [t.data_ptr() for t in again]          # released once the reads ran
        print("ok")
    """)
    assert out.strip() == "ok"


@needs_cpp
def test_rounds_of_queued_calls_compute_as_the_cpu_and_a_forked_child_drops_the_parents():
    """The C++ queue's jobs, reused round after round: rounds of a thousand calls behind a
    gate, each round's arguments of another layout than the last's, compute what the CPU
    computes. A child forked while calls are queued drops them and exits cleanly; the
    parent's still run."""
    out = run("""
        import os
        from torchport.ops import native_hostops as nh
        xs = [torch.randn(4, 5), torch.randn(3, 2, 2), torch.randn(6)]
        for x in xs:                                     # taught to C++
            dx = x.to("sim"); (dx + 1.0) * 2.0; torch.sim.synchronize()
        for rnd in range(3):
            x = xs[rnd % len(xs)]
            dx = x.to("sim")
            served = nh.counts()[0]
            close_gate()
            got = [(dx + float(i)) * 2.0 for i in range(500)]  # 1000 calls behind the gate
            assert not torch.sim.current_stream().query()
            assert nh.counts()[0] - served >= 1000
            gate.set()
            assert all(torch.equal(g.cpu(), (x + float(i)) * 2.0) for i, g in enumerate(got))
        x = xs[0]; dx = x.to("sim")
        close_gate()
        got = [dx * float(i) for i in range(10)]
        pid = os.fork()
        if pid == 0:
            os._exit(7)
        _, status = os.waitpid(pid, 0)
        gate.set()
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 7, status
        assert all(torch.equal(g.cpu(), x * float(i)) for i, g in enumerate(got))
        print("ok")
    """)
    assert out.strip() == "ok"


@needs_cpp
def test_a_queued_call_reads_its_tensors_layouts_at_the_call_not_when_it_runs():
    """A call queued from C++ computes on its tensors as they were laid out at the call: the
    worker makes their CPU tensors when it runs, but from sizes, strides, offsets and memory
    read at the call, so an in-place change of a tensor's layout or memory (``t_``,
    ``as_strided_``, ``set_``) after the call does not reach it; so in tensor lists and
    indices; a tensor passed twice, and two views of one block, stay one tensor and one
    block; the results are the CPU's bit for bit."""
    out = run("""
        from torchport.ops import native_hostops as nh
        a, b, c = torch.randn(6, 4), torch.randn(6, 4), torch.randn(6, 4)
        da, db, dc = a.to("sim"), b.to("sim"), c.to("sim")
        d, i = torch.randn(6, 4), torch.tensor([3, 0, 3])
        dd, di = d.to("sim"), i.to("sim")
        def calls(x):                                        # tensors, lists, Tensor?[]
            torch._foreach_addcmul_(x, [da, db[:5]], [dc, dd[1:]])
            return [da + db, da * da, da[:3] - da[3:], dc.exp(), da[:, di], *x]
        def zeros():
            return [torch.zeros(6, 4, device="sim"), torch.zeros(5, 4, device="sim")]
        for _ in range(2):                                   # taught to C++
            calls(zeros()); torch.sim.synchronize()
        want = [a + b, a * a, a[:3] - a[3:], c.exp(), a[:, i], a * c, b[:5] * d[1:]]
        x = zeros()
        torch.sim.synchronize()
        served = nh.counts()[0]
        close_gate()
        try:
            got = calls(x)
            queued = nh.counts()[0] - served
            da.t_()                                          # after the calls, before they run
            db.as_strided_((4, 6), (1, 4), 0)
            dc.set_(torch.zeros(5, device="sim"))
            di.as_strided_((3,), (0,), 0)
            waited = torch.sim.current_stream().query()
        finally:
            gate.set()
        assert queued == 6 and not waited, (queued, waited)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape and g.stride() == w.stride()
            assert torch.equal(g.cpu(), w), (g.cpu(), w)
        print("ok")
    """)
    assert out.strip() == "ok"


@needs_cpp
def test_an_optimizers_foreach_updates_are_queued_from_cpp_whatever_their_step_sizes():
    """An optimizer's foreach step (AdamW's: per-tensor step sizes as lists of floats that
    change every step, ``_foreach_sqrt``'s list of new tensors) is learned by the Python
    kernels once, then queued from C++ with other step sizes, the results bit for bit the
    CPU's; a list of integers is keyed by its values."""
    out = run("""
        from torchport.ops import native_hostops as nh
        params = [torch.randn(5, 3), torch.randn(7), torch.randn(2, 2)]
        def step(ps, k):
            sizes = [0.1 * k + 0.01 * j for j in range(len(ps))]
            roots = torch._foreach_sqrt([p.abs() for p in ps])
            torch._foreach_div_(roots, sizes)
            torch._foreach_addcdiv_(ps, roots, roots, [-s for s in sizes])
            torch._foreach_mul_(ps, [2, 3, 4])
            return roots
        cpu = [p.clone() for p in params]
        dev = [p.to("sim") for p in params]
        want = [step(cpu, k) for k in range(1, 5)]
        got = [step(dev, 1)]                    # the Python kernels learn and teach
        torch.sim.synchronize()
        served, handed, _ = nh.counts()
        close_gate()
        got += [step(dev, k) for k in (2, 3, 4)]
        assert not torch.sim.current_stream().query()  # queued behind the gate
        s2, h2, _ = nh.counts()
        gate.set()
        assert h2 == handed and s2 - served == 3 * (3 + 4), (s2 - served, h2 - handed)
        for g, w in zip(got, want):
            assert all(torch.equal(a.cpu(), b) for a, b in zip(g, w))
        assert all(torch.equal(a.cpu(), b) for a, b in zip(dev, cpu))
        h3 = nh.counts()[1]
        torch._foreach_mul_(dev, [2, 3, 5])     # other integers: learned on their own
        assert nh.counts()[1] == h3 + 1, nh.counts()[1] - h3
        print("ok")
    """)
    assert out.strip() == "ok"


def test_every_foreach_optimizer_trains_as_on_the_cpu():
    """PyTorch's optimizers with ``foreach=True`` (lists of step sizes, new tensors from
    foreach ops, queued from C++ after their first step): five steps bit for bit the CPU's."""
    out = run("""
        from torch import nn
        settings = {
            "AdamW": dict(weight_decay=0.1), "AdamW-amsgrad": dict(amsgrad=True),
            "Adam": dict(maximize=True), "Adamax": {}, "NAdam": {},
            "NAdam-decoupled": dict(decoupled_weight_decay=True, weight_decay=0.1),
            "RAdam": {}, "Adagrad": {}, "Adadelta": dict(lr=1.0),
            "RMSprop": dict(momentum=0.9, centered=True),
            "SGD": dict(momentum=0.9, nesterov=True), "ASGD": {}, "Rprop": {}}
        def train(device, name, kw):
            torch.manual_seed(0)
            m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.LayerNorm(16),
                              nn.Linear(16, 3)).to(device)
            opt = getattr(torch.optim, name.split("-")[0])(
                m.parameters(), foreach=True, **{"lr": 1e-2, **kw})
            x, y = torch.randn(4, 8).to(device), torch.randint(0, 3, (4,)).to(device)
            losses = []
            for _ in range(5):
                opt.zero_grad()
                loss = nn.functional.cross_entropy(m(x), y)
                loss.backward()
                opt.step()
                losses.append(loss.item())
            return losses, [p.detach().cpu() for p in m.parameters()]
        for name, kw in settings.items():
            (lc, pc), (ls, ps) = train("cpu", name, kw), train("sim", name, kw)
            assert lc == ls and all(torch.equal(a, b) for a, b in zip(pc, ps)), name
        print("ok")
    """)
    assert out.strip() == "ok"


@needs_cpp
def test_a_failure_of_a_call_queued_from_cpp_is_reported_at_the_next_sync():
    """The second call of a layout is queued from C++: its CPU kernel fails on the worker,
    the failure (with the op's name and the kernel's exception, as the Python worker
    reports it) is raised by the next synchronising call, the device stays usable, and the
    next failure is reported in its turn."""
    out = run("""
        from torchport.ops import native_hostops as nh
        x = torch.randn(5, device="sim")
        good, bad = torch.tensor([0, 4], device="sim"), torch.tensor([0, 7], device="sim")
        x.index_select(0, good)                      # learned
        torch.sim.synchronize()
        for _ in range(2):
            served = nh.counts()[0]
            y = x.index_select(0, bad)               # queued from C++; fails on the worker
            assert nh.counts()[0] == served + 1
            try:
                torch.sim.synchronize()
            except RuntimeError as e:
                assert "index_select" in str(e) and "out of range" in str(e), str(e)
                assert "IndexError: index out of range" in str(e), str(e)
                assert isinstance(e.__cause__, IndexError), repr(e.__cause__)
            else:
                raise AssertionError("no error reported")
            assert torch.equal((x * 2).cpu(), x.cpu() * 2)   # the device still works
        print("ok")
    """)
    assert out.strip() == "ok"


@needs_cpp
def test_the_hosts_calls_run_from_cpp_after_the_queued_work():
    """Copies between the host and the device, ``Tensor.item``, an op with a 0-dim CPU
    operand and the CPU fallback's learnt calls are computed by the host after the stream's
    queued work, as their Python kernels compute them: from C++, no Python kernel or
    fallback called, each waiting for the work queued behind a gate, bit for bit the CPU's.
    A queued failure is still reported by the first of them; the device stays usable."""
    out = run("""
        import warnings
        from torchport.ops import native_hostops as nh
        warnings.simplefilter("ignore")
        a, b, s = torch.randn(8, 8), torch.randn(8, 8), torch.tensor(2.5)
        da = a.to("sim")
        host = torch.empty(8, 8)
        cases = [  # each on y = da * 3 then y.mul_(2.0) queued behind the gate
            lambda y: y.cpu(),
            lambda y: torch.tensor(y[1, 2].item()),
            lambda y: host.copy_(y).clone(),
            lambda y: y.copy_(b).cpu(),                        # written after the queued write
            lambda y: y.to("cpu", torch.float64),
            lambda y: (y * s).cpu(),
            lambda y: torch.hypot(y, y).cpu(),
            lambda y: torch.hypot(y, y, out=y).cpu(),
        ]
        for call in cases:  # the first calls: the fallback learns, layouts are taught
            call((da * 3).mul_(2.0))
        torch.sim.synchronize()
        for k, call in enumerate(cases):
            want = call((a * 3).mul_(2.0))
            y = da * 3
            torch.sim.synchronize()
            close_gate()
            y.mul_(2.0)                                        # queued behind the gate
            timer = threading.Timer(0.2, gate.set)
            timer.start()
            served, handed, _ = nh.counts()
            to_python = nh.fallback_counts()[1]
            got = call(y)
            assert gate.is_set(), k
            assert torch.equal(got, want), (k, got, want)
            assert nh.counts()[1] == handed and nh.fallback_counts()[1] == to_python, k
            assert nh.counts()[0] > served, k
            timer.join()
        x = torch.randn(5, device="sim")
        xc = x.cpu()
        good, bad = torch.tensor([0, 4], device="sim"), torch.tensor([0, 7], device="sim")
        x.index_select(0, good)
        for call in (lambda t: t.cpu(), lambda t: torch.hypot(t, t).cpu(),
                     lambda t: (t * s).cpu()):
            x.index_select(0, bad)                             # fails on the worker
            raises_at_the_call(lambda: call(x), "out of range")
            assert torch.equal(call(x), call(xc))              # the device still works
        print("ok")
    """)
    assert out.strip() == "ok"


@needs_cpp
def test_ctrl_c_reaches_a_host_call_waiting_in_cpp_for_the_stream():
    """A copy to the host and a learnt fallback call wait in C++ for a stream that never
    finishes: a SIGINT raises KeyboardInterrupt there, as in the Python wait."""
    out = run("""
        import os, signal, time, warnings
        signal.signal(signal.SIGINT, signal.default_int_handler)  # (a background job ignores it)
        warnings.simplefilter("ignore")
        x = torch.randn(8, device="sim")
        torch.hypot(x, x).cpu()                                 # learnt
        torch.sim.synchronize()
        for call in (lambda: x.cpu(), lambda: torch.hypot(x, x)):
            close_gate()
            threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
            t = time.perf_counter()
            try:
                call()
            except KeyboardInterrupt:
                assert time.perf_counter() - t < 5
            else:
                raise AssertionError("no KeyboardInterrupt")
            gate.set()
            torch.sim.synchronize()
        print("ok")
    """)
    assert out.strip() == "ok"


@pytest.mark.skipif(STRICT, reason="device-only memory: a conversion is the host's")
def test_copies_within_a_device_are_queued():
    """``copy_`` between two tensors of one device, and ``Tensor.to`` a dtype on the device
    (autocast's casts), are queued on the current stream as a device's copy kernel is; they
    waited for the stream before. Their errors stay at the call; complex into real (the CPU
    warns at the call) is the host's."""
    out = run("""
        import warnings
        a = torch.randn(6, 5)
        d = a.to("sim")
        close_gate()
        timer = threading.Timer(10.0, gate.set)   # (a copy that waits for the stream returns then)
        timer.start()
        x = torch.empty(6, 5, device="sim"); x.copy_(d)
        t = torch.empty(5, 6, device="sim").t(); t.copy_(d)
        b = torch.empty(3, 6, 5, dtype=torch.float64, device="sim"); b.copy_(d)
        h, i = d.half(), d.to(torch.int32)
        assert not gate.is_set(), "a copy waited for the stream"
        assert not torch.sim.current_stream().query()   # all queued behind the gate
        raises_at_the_call(lambda: x.copy_(torch.ones(4, 5, device="sim")), "must match")
        gate.set()
        timer.cancel()
        for got, want in ((x, a), (t, a), (b, a.double().expand(3, 6, 5)), (h, a.half()),
                          (i, a.to(torch.int32))):
            assert torch.equal(got.cpu(), want) and got.dtype == want.dtype, (got, want)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.empty(2, device="sim").copy_(torch.ones(2, dtype=torch.complex64, device="sim"))
        assert any("imaginary" in str(w.message) for w in seen), seen
        print("ok")
    """)
    assert out.strip() == "ok"


def test_list_ops_and_factories_are_queued_as_cuda_queues_them():
    """Ops CUDA launches without waiting for the stream -- ``cat``, ``stack``, indexing with
    index tensors, ``arange``, ``linspace`` -- are queued behind the stream's work too, with
    the CPU's bits; they waited for the stream before. A bad call still raises at the call,
    and an index out of range (a device-side assert on CUDA) at the next sync, with the
    CPU kernel's exception as its cause."""
    out = run("""
        a, b = torch.randn(6, 5), torch.randn(6, 5)
        i = torch.tensor([4, 0, 2, 2])
        da, db, di = a.to("sim"), b.to("sim"), i.to("sim")
        def calls(x, y, ix, dev):
            return [torch.cat([x, y]), torch.cat([x, y], 1), torch.stack([x, y], 2),
                    torch.cat(x.chunk(2, 0), 1), x[ix], x[:, ix[:2]], x[ix, ix[:1]],
                    torch.arange(7.0, device=dev), torch.arange(7, device=dev),  # equal keys
                    torch.arange(0.5, 3.0, 0.25, device=dev),
                    torch.arange(2, 11, 3, dtype=torch.float64, device=dev),
                    torch.linspace(-1, 1, 9, device=dev)]
        want = calls(a, b, i, "cpu")
        for _ in range(2):                              # a layout's first call, then later ones
            close_gate()
            timer = threading.Timer(10.0, gate.set)     # (a call that waits returns then)
            timer.start()
            got = calls(da, db, di, "sim")
            assert not gate.is_set(), "a call waited for the stream"
            assert not torch.sim.current_stream().query()
            gate.set()
            timer.cancel()
            for g, w in zip(got, want):
                assert g.device.type == "sim" and g.dtype == w.dtype and g.stride() == w.stride()
                assert torch.equal(g.cpu(), w), (g, w)
        rows, other = torch.tensor([0, 9], device="sim"), torch.ones(2, 3, device="sim")
        close_gate()                                    # (a copy from the host waits for it)
        timer = threading.Timer(10.0, gate.set)         # (a call that waits returns then)
        timer.start()
        raises_at_the_call(lambda: torch.cat([da, other]), "Sizes of tensors must match")
        assert not gate.is_set(), "a call its shapes refuse waited for the stream"
        bad = da[rows]                                  # returns; fails on the worker
        assert not gate.is_set(), "an index waited for the stream"
        gate.set()
        timer.cancel()
        try:
            torch.sim.synchronize()
        except RuntimeError as e:
            assert "aten.index.Tensor" in str(e) and "out of bounds" in str(e), str(e)
            assert isinstance(e.__cause__, IndexError), repr(e.__cause__)
        else:
            raise AssertionError("no error reported")
        assert torch.equal(torch.cat([da, db]).cpu(), torch.cat([a, b]))   # still usable
        print("ok")
    """)
    assert out.strip() == "ok"


def test_ops_without_a_usable_out_overload_are_queued_as_their_functional_kernel():
    """Ops whose ``out=`` overload cannot serve a call -- none exists (attention's backward),
    a result is left undefined (a convolution's backward without the input's gradient), the
    results are a list (``_foreach_sqrt``, AdamW's), a random op whose arguments turn its
    randomness off (attention with ``dropout_p=0``) -- are queued as their functional CPU
    kernel, its results copied into the new tensors: the CPU's bits, no wait for the
    stream, and the CPU's own random numbers untouched by the first call's trial."""
    out = run("""
        import torch.nn.functional as F
        aten = torch.ops.aten
        torch.manual_seed(1)
        q, k, v = torch.randn(3, 2, 4, 5, 8).unbind(0)
        g = torch.randn(2, 4, 5, 8)
        x, w, go = torch.randn(2, 3, 6, 6), torch.randn(4, 3, 3, 3), torch.randn(2, 4, 4, 4)
        ts = [torch.rand(3, 4), torch.rand(5)]
        def calls(q, k, v, g, x, w, go, ts):
            o, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0)[:2]
            back = aten._scaled_dot_product_flash_attention_for_cpu_backward(
                g, q, k, v, o, lse, 0.0, False)
            conv = aten.convolution_backward(go, x, w, [4], [1, 1], [0, 0], [1, 1],
                                             False, [0, 0], 1, [False, True, True])
            assert conv[0] is None
            return [o, lse, *back, *conv[1:], *torch._foreach_sqrt(ts)]
        want = calls(q, k, v, g, x, w, go, ts)
        on_sim = [t.to("sim") for t in (q, k, v, g, x, w, go)] + [[t.to("sim") for t in ts]]
        for _ in range(2):                              # a layout's first call, then later ones
            before = torch.get_rng_state()
            close_gate()
            timer = threading.Timer(10.0, gate.set)
            timer.start()
            got = calls(*on_sim)
            assert not gate.is_set(), "a call waited for the stream"
            assert not torch.sim.current_stream().query()
            assert torch.equal(torch.get_rng_state(), before), "the CPU's generator moved"
            gate.set()
            timer.cancel()
            for a, b in zip(got, want, strict=True):
                assert a.device.type == "sim" and a.dtype == b.dtype and a.stride() == b.stride()
                assert torch.equal(a.cpu(), b), (a, b)
        print("ok")
    """)
    assert out.strip() == "ok"


def test_random_ops_draw_at_the_call_in_call_order_without_waiting():
    """Random fills (``uniform_``, ``normal_``, ``bernoulli_``, ``random_``, and ``rand``,
    ``randn``, ``randint``, ``rand_like`` through them) and dropout draw their numbers at
    the call, in call order, as CUDA reserves a launch's numbers when it is launched: no
    wait for the stream, the numbers the CPU gives from the same seed, the generator's state
    read and set at any point with the numbers of a synchronous run, the CPU's own generator
    untouched. A random op whose draws depend on values (``multinomial``) still waits."""
    out = run("""
        import torch.nn.functional as F
        x = torch.randn(6, 40)
        dx = x.to("sim")
        # (channels-last before the gate: on device-only memory, a copy that changes the layout
        # goes through the host where a backend has no strided copy kernel, and waits)
        cl_of = lambda t: t.to(memory_format=torch.channels_last)
        t, cl = torch.empty(3, 5, device="sim"), cl_of(torch.empty(2, 3, 4, 4, device="sim"))
        def calls(dev, x, t, cl):
            # F.dropout on a device is its fused kernel, native_dropout (CUDA's too); on the
            # CPU it multiplies by a scaled mask instead, other roundings of the same draws
            drop = (lambda x, p: F.dropout(x, p, training=True)) if dev == "sim" else \
                (lambda x, p: torch.native_dropout(x, p, True)[0])
            return [drop(x, 0.3), torch.rand(4, 3, device=dev),
                    torch.randn(5, device=dev, dtype=torch.float64), t.uniform_(-2, 3).clone(),
                    t.normal_(1.0, 0.5).clone(), torch.randint(0, 9, (7,), device=dev),
                    torch.rand_like(x.t()), t.bernoulli_(0.25).clone(),
                    cl.exponential_(2.0).clone(),
                    drop(x.t(), 0.5), t.random_(0, 5).clone()]
        for round in range(2):                      # a layout's first call, then later ones
            torch.manual_seed(11)
            cpu_first = torch.rand(3)
            torch.manual_seed(7)
            want = calls("cpu", x, torch.empty(3, 5), cl_of(torch.empty(2, 3, 4, 4)))
            torch.manual_seed(11)                       # (seeds the sim's generators too)
            torch.sim.manual_seed(7)
            close_gate()
            timer = threading.Timer(10.0, gate.set)
            timer.start()
            got = calls("sim", dx, t, cl)
            state = torch.sim.get_rng_state()
            assert not gate.is_set(), "a random op waited for the stream"
            assert not torch.sim.current_stream().query()
            assert torch.equal(torch.rand(3), cpu_first), "the CPU's generator moved"
            gate.set()
            timer.cancel()
            for a, b in zip(got, want, strict=True):
                assert a.device.type == "sim" and a.dtype == b.dtype and a.stride() == b.stride()
                assert torch.equal(a.cpu(), b), (round, a, b)
            nxt = torch.rand(4, device="sim")
            torch.sim.set_rng_state(state)
            assert torch.equal(torch.rand(4, device="sim").cpu(), nxt.cpu())
        probs = torch.rand(4, 6, device="sim")
        close_gate()
        threading.Timer(1.0, gate.set).start()      # the draws depend on the values
        torch.multinomial(probs, 2)
        assert gate.is_set()
        print("ok")
    """)
    assert out.strip() == "ok"


def test_explicit_out_calls_are_queued_with_their_errors_at_the_call():
    """``torch.add(a, b, out=c)`` and other ``out=`` calls whose outputs already have the
    result's shape are queued, as CUDA launches them: the CPU ``out=`` kernel into the
    outputs' own layouts (a transposed ``out`` too), the CPU's bits; a bad dtype or shape
    raises at the call, nothing queued. An output to resize, or one sharing memory with an
    input, is computed by the host after the stream (with the CPU's warning)."""
    out = run("""
        import warnings
        a, b = torch.randn(5, 6), torch.randn(5, 6)
        da, db = a.to("sim"), b.to("sim")
        def outs(dev):
            return [torch.empty(5, 6, device=dev), torch.empty(6, 5, device=dev).t(),
                    torch.empty(5, device=dev), torch.empty(5, dtype=torch.long, device=dev),
                    torch.empty(10, 6, device=dev), torch.empty(5, 6, device=dev),
                    torch.empty(5, 6, dtype=torch.long, device=dev)]
        def calls(x, y, o):
            torch.add(x, y, alpha=2, out=o[0])
            torch.mul(x, y, out=o[1])
            torch.max(x, 1, out=(o[2], o[3]))
            torch.cat([x, y], out=o[4])
            torch.sort(x, 1, out=(o[5], o[6]))
            return o
        want = calls(a, b, outs("cpu"))
        for _ in range(2):                              # a layout's first call, then later ones
            got_outs = outs("sim")
            close_gate()
            timer = threading.Timer(10.0, gate.set)
            timer.start()
            got = calls(da, db, got_outs)
            assert not gate.is_set(), "an out= call waited for the stream"
            assert not torch.sim.current_stream().query()
            long = torch.empty(5, 6, dtype=torch.long, device="sim")
            raises_at_the_call(lambda: torch.add(da, db, out=long),
                               "can't be cast to the desired output type Long")
            assert not gate.is_set(), "a call its dtypes refuse waited for the stream"
            gate.set()
            timer.cancel()
            expanded = torch.empty(5, 6, device="sim").expand(3, 5, 6)   # the host's check
            raises_at_the_call(lambda: torch.add(da, db, out=expanded), "more than one element")
            for g, w in zip(got, want, strict=True):
                assert g.device.type == "sim" and g.dtype == w.dtype and g.stride() == w.stride()
                assert torch.equal(g.cpu(), w), (g, w)
        small = torch.empty(2, device="sim")
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.add(da, db, out=small)                # resized: the host's, with the warning
        assert any("resized" in str(w.message) for w in seen), seen
        c = da.clone()
        torch.add(c, db, out=c)                         # out= an input: the host's
        assert torch.equal(small.cpu(), a + b) and torch.equal(c.cpu(), a + b)
        print("ok")
    """)
    assert out.strip() == "ok"
