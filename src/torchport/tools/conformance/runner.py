"""One OpInfo on the CPU and on the device: its samples per dtype compared with PyTorch's
tolerances (mutated inputs and gradients too), random ops by their properties, each
sample under a timeout; and a run of a selection in this process."""

from __future__ import annotations

import contextlib
import math
import signal
import time
import traceback
from collections.abc import Iterator, Sequence
from typing import Any

from torchport.tools.conformance.catalog import (
    DEFAULT_DTYPES,
    GRAD_DTYPES,
    apply_known,
    load_op_db,
    opinfo_id,
    property_kind,
    select,
)


# ---- one OpInfo -----------------------------------------------------------------
class _Timeout(Exception):
    pass


def _uninitialized(op: Any) -> bool:
    """Ops whose result is uninitialised memory (``empty*``): only metadata is comparable."""
    return op.name.split(".")[-1].startswith(("empty", "new_empty"))


def _alarm(signum: int, frame: Any) -> None:
    raise _Timeout()


@contextlib.contextmanager
def guarded(out: dict[str, Any], timeout: float, tops: Any,
            trace: tuple[int, int] | None = (2, 300)) -> Iterator[None]:
    """One entry's run (an OpInfo, a ModuleInfo): a wall-clock limit (SIGALRM, where
    there is one) and fallback warnings off; a timeout or a harness error is recorded in
    ``out["error"]`` (with the end of its traceback: ``trace`` = frames, characters),
    never hidden and never raised."""
    use_alarm = timeout > 0 and hasattr(signal, "SIGALRM")
    if use_alarm:
        old = signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(int(math.ceil(timeout)))
    old_warn = tops.set_fallback_warn(False)
    try:
        yield
    except _Timeout:
        out["error"] = f"timeout after {timeout:.0f}s"
    except Exception as e:  # a harness problem, reported, never hidden
        out["error"] = "harness: " + _short(e) + (
            "" if trace is None else " " + traceback.format_exc(limit=trace[0])[-trace[1]:])
    finally:
        if use_alarm:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
        tops.set_fallback_warn(old_warn)


def _short(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().replace("\n", " ")
    return text[:400]


class Runner:
    """Runs OpInfos on the device and the CPU (in the current process; the backend of
    ``device`` registered)."""

    def __init__(self, device: str = "sim", max_samples: int | None = None,
                 grad: bool = True, op_timeout: float = 300.0) -> None:
        import torch
        from torch.utils import _pytree

        import torchport.ops as tops

        self.torch = torch
        self.pytree = _pytree
        self.tops = tops
        self.device = device
        self.max_samples = max_samples
        self.grad = grad
        self.op_timeout = op_timeout

    # -- conversions
    def _to_dev(self, v: Any, keep_grad: bool = False, keep_cpu: frozenset[int] = frozenset()
                ) -> Any:
        """Tensors to the device, except the leaves ``keep_cpu`` (flattened positions) that
        the OpInfo makes on the CPU whatever the device (``tensor_split``'s indices)."""
        torch = self.torch
        leaves, spec = self.pytree.tree_flatten(v)

        def conv(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                d = x.detach().to(self.device)
                if keep_grad and x.requires_grad:
                    d.requires_grad_(True)
                return d
            if isinstance(x, torch.device) and x.type == "cpu":
                return torch.device(self.device)
            if x == "cpu" and isinstance(x, str):
                return self.device
            return x
        return self.pytree.tree_unflatten(
            [self._clone_cpu(x, keep_grad) if i in keep_cpu else conv(x)
             for i, x in enumerate(leaves)], spec)

    def _clone_cpu(self, v: Any, keep_grad: bool = False) -> Any:
        torch = self.torch

        def conv(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                c = x.detach().clone()
                if keep_grad and x.requires_grad:
                    c.requires_grad_(True)
                return c
            return x
        return self.pytree.tree_map(conv, v)

    def _to_cpu(self, v: Any) -> Any:
        torch = self.torch
        return self.pytree.tree_map(
            lambda x: x.detach().cpu() if isinstance(x, torch.Tensor) else x, v)

    def _tensors(self, v: Any) -> list[Any]:
        return [x for x in self.pytree.tree_flatten(v)[0] if isinstance(x, self.torch.Tensor)]

    def _call(self, op: Any, bundle: tuple) -> Any:
        inp, args, kwargs = bundle
        return op(inp, *args, **kwargs)

    def _same_with_seed(self, op: Any, bundle: tuple, ref: Any) -> bool:
        """Does the CPU give ``ref`` again under another seed? (No: a random sample, which a
        device with a generator of its own -- CUDA's, OpenCL's -- draws otherwise.)"""
        torch = self.torch
        torch.manual_seed(4321)
        again = self._call(op, self._clone_cpu(bundle))
        try:
            torch.testing.assert_close(again, ref, equal_nan=True, rtol=0, atol=0)
            return True
        except Exception:
            return False

    def _draws(self, op: Any, bundle: tuple) -> bool:
        """Does the CPU call draw random numbers? op_db wraps some random ops so that they
        seed the generator themselves (``wrapper_set_seed``: attention with dropout), so a
        second seed does not show them: the ops they dispatch do."""
        torch = self.torch
        from torch.utils._python_dispatch import TorchDispatchMode

        seeded = torch.Tag.nondeterministic_seeded

        class Draws(TorchDispatchMode):
            found = False

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
                if seeded in func.tags:
                    Draws.found = True
                return func(*args, **(kwargs or {}))
        try:
            with Draws():
                self._call(op, self._clone_cpu(bundle))
        except Exception:  # noqa: BLE001 (a call the mode cannot trace: judged by the seed)
            return False
        return Draws.found

    def _random(self, op: Any, bundle: tuple, ref: Any) -> bool:
        return _uninitialized(op) or not self._same_with_seed(op, bundle, ref) \
            or self._draws(op, bundle)

    def _check_meta(self, dev_out: Any, ref: Any) -> None:
        """Random ops: same structure, shapes, dtypes; results on the device."""
        torch = self.torch
        d_leaves, d_spec = self.pytree.tree_flatten(dev_out)
        r_leaves, r_spec = self.pytree.tree_flatten(ref)
        if len(d_leaves) != len(r_leaves):
            raise AssertionError(f"structure differs: {d_spec} vs {r_spec}")
        for d, r in zip(d_leaves, r_leaves, strict=True):
            if isinstance(r, torch.Tensor):
                if not isinstance(d, torch.Tensor):
                    raise AssertionError(f"expected a tensor, got {type(d).__name__}")
                if d.shape != r.shape or d.dtype != r.dtype:
                    raise AssertionError(f"shape/dtype {tuple(d.shape)}/{d.dtype} vs "
                                         f"{tuple(r.shape)}/{r.dtype}")

    def _check_devices(self, dev_out: Any, cpu_out: Any) -> None:
        torch = self.torch
        d_leaves = self.pytree.tree_flatten(dev_out)[0]
        c_leaves = self.pytree.tree_flatten(cpu_out)[0]
        if len(d_leaves) != len(c_leaves):
            return
        for d, c in zip(d_leaves, c_leaves, strict=True):
            if isinstance(d, torch.Tensor) and isinstance(c, torch.Tensor):
                want = self.device if c.device.type == "cpu" else c.device.type
                if d.device.type != want:
                    raise AssertionError(f"result on {d.device}, expected {want}")

    def run_sample(self, op: Any, sample: Any,
                   keep_cpu: frozenset[int] = frozenset()) -> tuple[str, str | None]:
        """(status, message) of one sample: pass / fail / skip."""
        torch = self.torch
        kind = property_kind(op)
        if kind is not None:
            checked = getattr(self, "_" + kind)(op, sample, grad=False)
            if checked is not None:
                return checked
        bundle = (sample.input, tuple(sample.args), dict(sample.kwargs))
        torch.manual_seed(1234)
        cpu_in = self._clone_cpu(bundle)
        try:
            ref = self._call(op, cpu_in)
        except Exception as e:
            return "skip", f"the CPU raises ({_short(e)})"
        random = self._random(op, bundle, ref)
        dev_in = self._to_dev(bundle, keep_cpu=keep_cpu)
        try:
            out = self._call(op, dev_in)
        except Exception as e:
            return "fail", f"{self.device} raises {_short(e)}"
        try:
            self._check_devices(out, ref)
            if random:
                self._check_meta(out, ref)
            else:
                torch.testing.assert_close(self._to_cpu(out), ref, equal_nan=True)
                # inputs the op mutated must match too
                torch.testing.assert_close(self._tensors(self._to_cpu(dev_in)),
                                           self._tensors(cpu_in), equal_nan=True)
        except Exception as e:
            return "fail", _short(e)
        return "pass", None

    def run_grad_sample(self, op: Any, sample: Any,
                        keep_cpu: frozenset[int] = frozenset()) -> tuple[str, str | None]:
        """Gradients of a sample's differentiable outputs on the device vs the CPU."""
        torch = self.torch
        kind = property_kind(op)
        if kind is not None:
            checked = getattr(self, "_" + kind)(op, sample, grad=True)
            if checked is not None:
                return checked
        bundle = (sample.input, tuple(sample.args), dict(sample.kwargs))
        cpu_in = self._clone_cpu(bundle, keep_grad=True)
        leaves = [x for x in self.pytree.tree_flatten(cpu_in)[0]
                  if isinstance(x, torch.Tensor) and x.requires_grad]
        if not leaves:
            return "skip", "no input requires grad"
        try:
            torch.manual_seed(1234)
            ref = sample.output_process_fn_grad(self._call(op, cpu_in))
            if not self._same_with_seed(op, self._clone_cpu(bundle), self._call(op, cpu_in)) \
                    or self._draws(op, bundle):
                return "skip", "random op"
            outs = [x for x in self.pytree.tree_flatten(ref)[0]
                    if isinstance(x, torch.Tensor) and x.requires_grad]
            if not outs:
                return "skip", "no differentiable output"
            g = torch.Generator().manual_seed(7)
            gos = [torch.randn(o.shape, dtype=o.dtype, generator=g) for o in outs]
            ref_grads = torch.autograd.grad(outs, leaves, gos, allow_unused=True)
        except Exception as e:
            return "skip", f"the CPU backward raises ({_short(e)})"
        dev_in = self._to_dev(bundle, keep_grad=True,
                              keep_cpu=keep_cpu)
        d_leaves = [x for x in self.pytree.tree_flatten(dev_in)[0]
                    if isinstance(x, torch.Tensor) and x.requires_grad]
        try:
            out = sample.output_process_fn_grad(self._call(op, dev_in))
            d_outs = [x for x in self.pytree.tree_flatten(out)[0]
                      if isinstance(x, torch.Tensor) and x.requires_grad]
            d_grads = torch.autograd.grad(d_outs, d_leaves, [x.to(self.device) for x in gos],
                                          allow_unused=True)
        except Exception as e:
            return "fail", f"{self.device} backward raises {_short(e)}"
        try:
            torch.testing.assert_close(
                [None if x is None else x.cpu() for x in d_grads], list(ref_grads),
                equal_nan=True)
        except Exception as e:
            return "fail", "grad: " + _short(e)
        return "pass", None

    # -- random ops checked by their properties (PROPERTIES)
    def _dropout(self, op: Any, sample: Any, grad: bool) -> tuple[str, str | None] | None:
        """``nn.functional.dropout`` (so ``native_dropout``) by its properties (see
        ``PROPERTIES``); ``None`` for a deterministic sample (compared with the CPU)."""
        torch = self.torch
        args, kwargs = tuple(sample.args), dict(sample.kwargs)
        p = kwargs.get("p", args[0] if args else 0.5)
        training = kwargs.get("training", args[1] if len(args) > 1 else True)
        x = sample.input.detach()
        if not (training and 0 < p < 1 and x.numel()):
            return None
        scale = 1.0 / (1.0 - p)
        try:
            dx = x.to(self.device).requires_grad_(grad)
            out = self._call(op, (dx, args, kwargs))  # the OpInfo's call (it seeds)
            gx = None
            if grad:
                g = torch.randn(out.shape, dtype=out.dtype,
                                generator=torch.Generator().manual_seed(7))
                (gx,) = torch.autograd.grad(out, dx, g.to(self.device))
        except Exception as e:
            return "fail", f"{self.device} {'backward ' if grad else ''}raises {_short(e)}"
        try:
            if out.device.type != self.device or out.shape != x.shape or out.dtype != x.dtype:
                raise AssertionError(f"result {tuple(out.shape)}/{out.dtype} on {out.device}")
            got = out.detach().cpu()
            kept = got != 0
            if grad:  # where x is 0 the mask is unknown
                nz = x != 0
                torch.testing.assert_close(gx.cpu()[nz], g.mul(kept).mul_(scale)[nz],
                                           msg=lambda m: f"grad is not the mask / (1-p): {m}")
                return "pass", None
            torch.testing.assert_close(got, x.mul(kept).mul_(scale),
                                       msg=lambda m: f"elements not 0 or x/(1-p): {m}")
            self._dropout_generator(x, p, scale)
        except Exception as e:
            return "fail", _short(e)
        return "pass", None

    def _dropout_generator(self, x: Any, p: float, scale: float) -> None:
        """The device generator's side of dropout: keep ratios, seeding, state replay, and
        ``native_dropout``'s mask and output."""
        torch = self.torch
        dropout = torch.nn.functional.dropout
        big = torch.ones(8192, dtype=x.dtype, device=self.device)
        for q in (p, 0.2):
            torch.manual_seed(1234)
            a, b = dropout(big, q).cpu(), dropout(big, q).cpu()
            torch.manual_seed(1234)
            again = dropout(big, q).cpu()
            ratio = (a != 0).double().mean().item()
            bound = 6 * math.sqrt(q * (1 - q) / big.numel())
            if abs(ratio - (1 - q)) > bound:
                raise AssertionError(f"keep ratio {ratio:.4f} at p={q}: expected "
                                     f"{1 - q:.4f} +- {bound:.4f}")
            if not torch.equal(a, again):
                raise AssertionError(f"manual_seed did not reproduce the mask (p={q})")
            if torch.equal(a, b):
                raise AssertionError(f"two calls drew the same mask (p={q})")
        mod = torch.get_device_module(self.device)
        state = mod.get_rng_state()
        dx = x.to(self.device)
        out, mask = torch.native_dropout(dx, p, True)
        mod.set_rng_state(state)
        out2, mask2 = torch.native_dropout(dx, p, True)
        if mask.dtype != torch.bool or mask.shape != x.shape:
            raise AssertionError(f"native_dropout's mask is {mask.dtype} {tuple(mask.shape)}")
        if not (torch.equal(mask.cpu(), mask2.cpu()) and torch.equal(out.cpu(), out2.cpu())):
            raise AssertionError("set_rng_state did not replay native_dropout")
        torch.testing.assert_close(out.cpu(), x.mul(mask.cpu()).mul_(scale),
                                   msg=lambda m: f"native_dropout's output is not x * mask "
                                                 f"/ (1-p): {m}")

    def _samples(self, op: Any, dtype: Any, requires_grad: bool
                 ) -> list[tuple[Any, frozenset[int]]]:
        """The samples, each with the flattened positions of its leaves kept on the CPU."""
        self.torch.manual_seed(0)
        it = op.sample_inputs("cpu", dtype, requires_grad=requires_grad)
        samples: list[Any] = []
        for s in it:
            if self.max_samples is not None and len(samples) >= self.max_samples:
                break
            if self._reaches_device(s):
                samples.append(s)
        return list(zip(samples, self._cpu_leaves(op, dtype, requires_grad, samples),
                        strict=True))

    def _reaches_device(self, sample: Any) -> bool:
        """Does the sample pass the op a tensor or a device (the CPU's, which the device run
        replaces)? ``arange(1, 3)`` passes neither: its result is on the CPU in both runs, and
        says nothing about the device, so it is neither run nor counted."""
        torch = self.torch
        return any(isinstance(x, (torch.Tensor, torch.device)) or x == "cpu" and isinstance(x, str)
                   for x in self.pytree.tree_flatten(
                       (sample.input, tuple(sample.args), dict(sample.kwargs)))[0])

    def _cpu_leaves(self, op: Any, dtype: Any, requires_grad: bool,
                    samples: list[Any]) -> list[frozenset[int]]:
        """Find the tensors an OpInfo creates on the CPU whatever the device.

        PyTorch's device tests make samples on the device under test; a few sample
        functions put some tensors on the CPU regardless (``tensor_split``'s
        ``tensor_indices_or_sections``, which must be a CPU tensor). The same
        samples made for the ``meta`` device show which: those leaves stay on the
        CPU for the device run. Samples that cannot be made on ``meta`` move whole."""
        torch = self.torch
        keeps = [frozenset[int]()] * len(samples)
        if not any(sum(isinstance(x, torch.Tensor) for x in self.pytree.tree_flatten(
                (s.input, tuple(s.args), dict(s.kwargs)))[0]) > 1 for s in samples):
            return keeps  # one tensor per sample: the input, made on the device
        try:
            torch.manual_seed(0)
            metas = []
            for i, m in enumerate(op.sample_inputs("meta", dtype, requires_grad=requires_grad)):
                if i >= len(samples):
                    break
                metas.append(m)
        except Exception:
            return keeps
        for n, (s, m) in enumerate(zip(samples, metas, strict=False)):
            a = self.pytree.tree_flatten((s.input, tuple(s.args), dict(s.kwargs)))[0]
            b = self.pytree.tree_flatten((m.input, tuple(m.args), dict(m.kwargs)))[0]
            if len(a) != len(b) or any(
                    isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor)
                    or isinstance(x, torch.Tensor) and (x.shape != y.shape or x.dtype != y.dtype)
                    for x, y in zip(a, b, strict=True)):
                continue  # not the same sample
            keeps[n] = frozenset(i for i, (x, y) in enumerate(zip(a, b, strict=True))
                                 if isinstance(x, torch.Tensor) and y.device.type == "cpu")
        return keeps

    def _run_kind(self, op: Any, dtype: Any, grad: bool) -> dict[str, Any]:
        res: dict[str, Any] = {"samples": 0, "passed": 0, "failed": 0, "skipped": 0,
                               "errors": [], "skip_reasons": []}
        try:
            samples = list(self._samples(op, dtype, grad))
        except Exception as e:
            return {**res, "status": "skip", "reason": f"no samples ({_short(e)})"}
        for s, keep in samples:
            st, msg = (self.run_grad_sample if grad else self.run_sample)(op, s, keep)
            res["samples"] += 1
            key = {"pass": "passed", "fail": "failed", "skip": "skipped"}[st]
            res[key] += 1
            if st == "fail" and len(res["errors"]) < 3:
                res["errors"].append(msg)
            if st == "skip" and msg not in res["skip_reasons"] and len(res["skip_reasons"]) < 3:
                res["skip_reasons"].append(msg)
        if res["failed"]:
            res["status"] = "fail"
        elif res["passed"]:
            res["status"] = "pass"
        else:
            res["status"] = "skip"
            res["reason"] = ("no samples" if not res["samples"]
                             else "; ".join(res["skip_reasons"]) or "all samples skipped")
        return res

    def run_opinfo(self, op: Any, dtypes: Sequence[str]) -> dict[str, Any]:
        """Results of one OpInfo for the asked dtypes (and gradients)."""
        torch = self.torch
        t0 = time.perf_counter()
        supported = op.supported_dtypes("cpu")
        out: dict[str, Any] = {"id": opinfo_id(op), "name": op.name, "dtypes": {}, "grad": {}}
        with guarded(out, self.op_timeout, self.tops):
            with self.tops.record() as rec:
                for name in dtypes:
                    dt = getattr(torch, name)
                    if dt not in supported:
                        out["dtypes"][name] = {"status": "skip",
                                               "reason": "dtype not supported by the op on CPU"}
                        continue
                    out["dtypes"][name] = self._run_kind(op, dt, False)
                    if self.grad and name in GRAD_DTYPES:
                        if not op.supports_autograd:
                            out["grad"][name] = {"status": "skip",
                                                 "reason": "op does not support autograd"}
                        elif dt not in op.supported_backward_dtypes("cpu"):
                            out["grad"][name] = {"status": "skip",
                                                 "reason": "backward dtype not supported on CPU"}
                        else:
                            out["grad"][name] = self._run_kind(op, dt, True)
        out["paths"] = {n: rec.path_of(n) for n in sorted(rec.ops) if rec.path_of(n)}
        # every path each overload took (an overload may take several: a Decline)
        out["path_counts"] = {n: dict(rec.ops[n].paths) for n in sorted(rec.ops)
                              if rec.ops[n].paths}
        apply_known(out)
        out["seconds"] = round(time.perf_counter() - t0, 3)
        return out


def load_backend(name: str) -> str:
    """Import backend ``name`` as ``torchport run -b`` does; the device type's name."""
    import typer

    from torchport.tools.run import load_backend as _load

    try:
        return _load(name).name
    except typer.BadParameter as e:
        raise SystemExit(f"torchport.tools.conformance: {e.message}") from None


def run_in_process(pattern: str | None, dtypes: Sequence[str] = DEFAULT_DTYPES,
                   max_samples: int | None = None, grad: bool = True,
                   op_timeout: float = 300.0, backend: str = "sim") -> list[dict[str, Any]]:
    """Run the selected OpInfos here, on ``backend`` (loaded if not registered yet)."""
    device = load_backend(backend)
    runner = Runner(device, max_samples=max_samples, grad=grad, op_timeout=op_timeout)
    return [runner.run_opinfo(op, dtypes) for op in select(load_op_db(), pattern)]
