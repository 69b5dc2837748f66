"""Conformance of a torchport device against the CPU, over PyTorch's OpInfo database.

For every OpInfo of ``op_db`` and every sample input (per dtype) the op runs on
the CPU and on the backend's device (``--backend``, default ``sim``); results are
compared with ``torch.testing.assert_close`` (PyTorch's per-dtype tolerances),
mutated inputs too, and gradients for OpInfos that support autograd (float32/float64). Ops whose CPU result changes
with the seed (random ops) or is uninitialised memory (``empty*``) are
compared by shape, dtype and device; random ops declared in ``PROPERTIES`` (dropout) by
what their results must satisfy, as a device's generator is its own.
The path each overload took (native kernel, decomposition, CPU fallback) comes
from :mod:`torchport.ops.stats`. Failures with a known cause (``KNOWN``) are reported
as "known" with their reason, counted apart from passes and failures.

    python -m torchport.conformance                 # the representative subset, on sim
    python -m torchport.conformance --full          # every OpInfo (long)
    python -m torchport.conformance --ops 'add|mul' --dtypes float32,int64 --max-samples 4
    python -m torchport.conformance --strict        # TORCHPORT_SIM_STRICT=1 (device-only memory)
    python -m torchport.conformance --async         # TORCHPORT_SIM_ASYNC=1 (queued kernels)
    python -m torchport.conformance --backend mychip_torchport --subset --ops 'add|mm'

``--backend`` takes what ``torchport run -b`` takes: ``sim``, a ``torchport.backends``
package name, or a module path whose import registers the backend (imported in every
worker process before ``op_db``).

Writes ``reports/conformance.{json,md}`` (``reports/conformance-strict.{json,md}``
with ``--strict``, ``conformance-async`` with ``--async``; ``--out``/``--name`` change
that). The work runs
in worker processes (``--jobs``): a crash or hang of one op costs that op, not
the run. Exit status: 0 when nothing failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import types
import unittest
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

PROG = "python -m torchport.conformance"
DEFAULT_DTYPES = ("float32", "float64", "int64", "bool", "bfloat16", "float16", "complex64")
GRAD_DTYPES = ("float32", "float64")

# A representative subset (OpInfo names, regex): elementwise, reductions, linear
# algebra, convolution, indexing, shape ops, losses, random and factory ops, and ops
# that reach the decomposition and fallback paths.
SUBSET = (
    r"add|mul|div|sub|abs|exp|log1p|sigmoid|tanh|clamp|where|pow|remainder|logaddexp|"
    r"hypot|atan2|lerp|nan_to_num|sum|mean|amax|argmax|std|var|prod|cumsum|logsumexp|"
    r"sort|topk|matmul|mm|bmm|addmm|linalg\.vector_norm|nn\.functional\.conv2d|"
    r"nn\.functional\.linear|softmax|log_softmax|nn\.functional\.layer_norm|"
    r"nn\.functional\.gelu|nn\.functional\.relu|nn\.functional\.hardshrink|"
    r"nn\.functional\.embedding|nn\.functional\.cross_entropy|nn\.functional\.mse_loss|"
    r"nn\.functional\.max_pool2d|nn\.functional\.pad|index_select|index_put|gather|"
    r"scatter_add|masked_fill|masked_select|nonzero|cat|stack|flip|roll|tril|"
    r"repeat|expand|permute|transpose|view|reshape|narrow|squeeze|unfold|diagonal|"
    r"special\.entr|special\.bessel_j0|kthvalue|logcumsumexp|fft\.fft|"
    r"zeros_like|full|arange|linspace|eye|rand_like|randn|bernoulli|"
    r"nn\.functional\.dropout|empty_like"
)
SUBSET_DTYPES = ("float32", "float64", "int64", "bool", "bfloat16")
SUBSET_MAX_SAMPLES = 3

# Failures with a known cause: (regex over "<OpInfo id>/<dtype>" for forward results,
# "<OpInfo id>/<dtype>/grad" for gradients, "<OpInfo id>/error" for a crash or timeout;
# kind; reason). Kinds "limitation" (the backend does not do this) and "difference"
# (a legitimate numerical difference) turn a failure into "known": still counted and
# listed with its reason, never a pass. Kind "bug" keeps the failure a failure and
# gives its diagnosis. A known entry only ever applies to a result that failed.
KNOWN: list[tuple[str, str, str]] = [
    (r"nn\.functional\.linear_cross_entropy\.chunked.*/(bfloat16|float16)(/grad)?",
     "difference",
     "PyTorch chooses the accumulation policy per device type (_AUTO_DEFAULTS in "
     "torch/nn/modules/linear_cross_entropy_options.py: fp32 'accurate' accumulation on "
     "cpu, 'compact' on any other device), so half-precision results differ by an ULP or two"),
]


# Random OpInfos checked by their properties where their results are random: a device draws
# from its own generator (CUDA's Philox, not the CPU's mt19937), so equality with the CPU's
# draws is no test, and shapes alone prove nothing. (regex over the OpInfo id, kind: a
# ``Runner._<kind>`` method, what it checks.)
PROPERTIES: list[tuple[str, str, str]] = [
    (r"nn\.functional\.dropout", "dropout",
     "in training with 0 < p < 1: each element 0 or x/(1-p), also native_dropout's output "
     "from its mask; the keep ratio of 8192 elements within 6 standard deviations of 1-p "
     "(at the sample's p and at 0.2); a seed reproduces the mask, the generator moves on "
     "between calls, set_rng_state replays; the gradient is the output's mask over 1-p. "
     "Eval, p=0 and p=1 are deterministic and compared with the CPU"),
]


def property_kind(op: Any) -> str | None:
    """The ``PROPERTIES`` kind of an OpInfo, or ``None``."""
    return next((k for pattern, k, _ in PROPERTIES if re.fullmatch(pattern, opinfo_id(op))),
                None)


# ---- loading op_db -----------------------------------------------------------
def _stub_expecttest() -> None:
    """op_db's module imports ``expecttest`` (a PyTorch test dependency) only for a base class."""
    try:
        import expecttest  # noqa: F401
    except ImportError:
        m = types.ModuleType("expecttest")
        m.TestCase = unittest.TestCase  # type: ignore[attr-defined]
        sys.modules["expecttest"] = m


def load_op_db() -> list[Any]:
    """PyTorch's OpInfo list (imported after the device is registered)."""
    _stub_expecttest()
    import torch.backends
    frozen = torch.backends.flags_frozen()
    from torch.testing._internal.common_methods_invocations import op_db
    if not frozen:  # PyTorch's test utilities freeze cudnn flags; leave the process as it was
        torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True
    return list(op_db)


def opinfo_id(op: Any) -> str:
    return op.name + ("." + op.variant_test_name if op.variant_test_name else "")


def select(op_db: Sequence[Any], pattern: str | None) -> list[Any]:
    """OpInfos whose id (``name`` or ``name.variant``) or name fully matches ``pattern``."""
    if not pattern:
        return list(op_db)
    rx = re.compile(pattern)
    return [op for op in op_db if rx.fullmatch(opinfo_id(op)) or rx.fullmatch(op.name)]


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
        torch = self.torch
        torch.manual_seed(1234)
        again = self._call(op, self._clone_cpu(bundle))
        try:
            torch.testing.assert_close(again, ref, equal_nan=True, rtol=0, atol=0)
            return True
        except Exception:
            return False

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
        random = _uninitialized(op) or not self._same_with_seed(op, bundle, ref)
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
            if not self._same_with_seed(op, self._clone_cpu(bundle), self._call(op, cpu_in)):
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
        samples = []
        for i, s in enumerate(it):
            if self.max_samples is not None and i >= self.max_samples:
                break
            samples.append(s)
        return list(zip(samples, self._cpu_leaves(op, dtype, requires_grad, samples),
                        strict=True))

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


def known_cause(key: str) -> tuple[str, str] | None:
    """(kind, reason) of a failure ``"<id>/<dtype>[/grad]"`` or ``"<id>/error"``, if known."""
    for pattern, kind, reason in KNOWN:
        if re.fullmatch(pattern, key):
            return kind, reason
    return None


def apply_known(r: dict[str, Any]) -> dict[str, Any]:
    """Mark the failures of one OpInfo result with their known cause (see ``KNOWN``)."""
    for kind in ("dtypes", "grad"):
        for dt, v in r[kind].items():
            if v["status"] != "fail":
                continue
            cause = known_cause(f"{r['id']}/{dt}" + ("/grad" if kind == "grad" else ""))
            if cause is not None:
                v["known"] = {"kind": cause[0], "reason": cause[1]}
                if cause[0] != "bug":
                    v["status"] = "known"
    if r.get("error"):
        cause = known_cause(f"{r['id']}/error")
        if cause is not None:
            r["error_known"] = {"kind": cause[0], "reason": cause[1]}
    r["status"] = _overall(r)
    return r


def _overall(r: dict[str, Any]) -> str:
    if r.get("error") and r.get("error_known", {}).get("kind", "bug") == "bug":
        return "fail"
    sts = [v["status"] for v in (*r["dtypes"].values(), *r["grad"].values())]
    if "fail" in sts:
        return "fail"
    if "known" in sts or r.get("error"):
        return "known"
    return "pass" if "pass" in sts else "skip"


def load_backend(name: str) -> str:
    """Import backend ``name`` as ``torchport run -b`` does; the device type's name."""
    import typer

    from torchport.run import load_backend as _load

    try:
        return _load(name).name
    except typer.BadParameter as e:
        raise SystemExit(f"torchport.conformance: {e.message}") from None


def run_in_process(pattern: str | None, dtypes: Sequence[str] = DEFAULT_DTYPES,
                   max_samples: int | None = None, grad: bool = True,
                   op_timeout: float = 300.0, backend: str = "sim") -> list[dict[str, Any]]:
    """Run the selected OpInfos here, on ``backend`` (loaded if not registered yet)."""
    device = load_backend(backend)
    runner = Runner(device, max_samples=max_samples, grad=grad, op_timeout=op_timeout)
    return [runner.run_opinfo(op, dtypes) for op in select(load_op_db(), pattern)]


# ---- workers ---------------------------------------------------------------------
def serve(args: argparse.Namespace, run: Callable[[Any], dict[str, Any]]) -> int:
    """A worker's loop (the OpInfo runners share it): the OpInfos whose keys it was given,
    each one's start and ``run(op)`` result written to ``args.worker_out`` as it goes, so
    that a crash or a hang costs only the OpInfo it happened in."""
    ops = select(load_op_db(), args.ops)
    ids = set(json.loads(Path(args.worker_ids).read_text()))
    with open(args.worker_out, "a") as f:
        for i, op in enumerate(ops):
            key = f"{i}:{opinfo_id(op)}"
            if key not in ids:
                continue
            f.write(json.dumps({"start": key}) + "\n")
            f.flush()
            r = run(op)
            r["key"] = key
            f.write(json.dumps({"result": r}) + "\n")
            f.flush()
    return 0


def _worker(args: argparse.Namespace) -> int:
    device = load_backend(args.backend)  # before op_db: device bases are computed at import
    runner = Runner(device, max_samples=args.max_samples, grad=not args.no_grad,
                    op_timeout=args.op_timeout)
    return serve(args, lambda op: runner.run_opinfo(op, args.dtypes))


def _keys(pattern: str | None) -> list[str]:
    # Listing needs op_db but not the device: a light subprocess-free import here.
    ops = select(load_op_db(), pattern)
    return [f"{i}:{opinfo_id(op)}" for i, op in enumerate(ops)]


def worker_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment of worker processes: the run's sim modes, no op statistics, no
    fallback warnings, this torchport on the path."""
    env = {**os.environ, "TORCHPORT_FALLBACK_WARN": "0"}
    env.pop("TORCHPORT_OP_STATS", None)
    if args.strict:
        env["TORCHPORT_SIM_STRICT"] = "1"
    if args.asynchronous:
        env["TORCHPORT_SIM_ASYNC"] = "1"
    env["PYTHONPATH"] = worker_path(env)
    return env


def run_worker_pool(keys: list[str], jobs: int, command: Callable[[Path, Path], list[str]],
                    died: Callable[[str, str], dict[str, Any]], env: dict[str, str], *,
                    label: str, quiet: bool, progress: Any = None,
                    cwd: Path | None = None) -> list[dict[str, Any]]:
    """Run ``keys`` in ``jobs`` worker processes, each ``command(ids_file, out_file)``
    writing ``{"start": key}`` and ``{"result": r}`` lines for the keys of its ids file. A
    worker that dies costs the key it was running (``died(key, why)`` is its result) and a
    new worker takes the rest of its list; a worker that ends without starting any of its
    keys stops the run. ``progress(results so far)`` every minute; a count of ``label`` on stderr."""
    jobs = max(1, min(jobs, len(keys)))
    tmp = Path(tempfile.mkdtemp(prefix="torchport-conf-"))
    results: dict[str, dict[str, Any]] = {}
    procs: list[tuple[subprocess.Popen, Path, list[str], Path]] = []
    n = 0

    def launch(todo: list[str]) -> None:
        nonlocal n
        n += 1
        ids, out, err = tmp / f"ids{n}.json", tmp / f"out{n}.jsonl", tmp / f"err{n}.txt"
        ids.write_text(json.dumps(todo))
        p = subprocess.Popen(command(ids, out), cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                             stderr=open(err, "w"))
        procs.append((p, out, todo, err))

    for i in range(jobs):
        if keys[i::jobs]:
            launch(keys[i::jobs])
    shown, last_write, last_read = -1, time.monotonic(), time.monotonic()
    while procs:
        time.sleep(0.5)
        for entry in list(procs):
            p, out, todo, err = entry
            if p.poll() is None:
                continue
            procs.remove(entry)
            started = _read_worker(out, results)
            if started is not None and started not in results:  # the worker died on it
                tail = err.read_text(errors="replace").strip().splitlines()[-1:] \
                    if err.exists() else []
                results[started] = died(started, f"worker died (exit status {p.returncode})"
                                        + (f": {tail[0][:200]}" if tail else ""))
            rest = [k for k in todo if k not in results]
            if started is None and rest == todo:  # it ran none of its keys: it would again
                raise SystemExit(f"{label} worker ran none of its keys (exit {p.returncode});"
                                 f" see {tmp}")
            if rest:
                launch(rest)
        if time.monotonic() - last_read > 5:  # results so far of the running workers
            last_read = time.monotonic()
            for _, out, _, _ in procs:
                _read_worker(out, results)
        if progress is not None and time.monotonic() - last_write > 60:
            last_write = time.monotonic()
            progress([results[k] for k in keys if k in results])
        if not quiet and len(results) != shown:
            shown = len(results)
            print(f"\r{shown}/{len(keys)} {label}", end="", file=sys.stderr, flush=True)
    if not quiet:
        print(file=sys.stderr)
    shutil.rmtree(tmp, ignore_errors=True)
    return [results[k] for k in keys if k in results]


def _run_workers(args: argparse.Namespace, keys: list[str],
                 progress: Any = None) -> list[dict[str, Any]]:
    def command(ids: Path, out: Path) -> list[str]:
        cmd = [sys.executable, "-m", "torchport.conformance", "--worker",
               "--backend", args.backend,
               "--worker-ids", str(ids), "--worker-out", str(out),
               "--dtypes", ",".join(args.dtypes), "--op-timeout", str(args.op_timeout)]
        if args.ops:
            cmd += ["--ops", args.ops]
        if args.max_samples is not None:
            cmd += ["--max-samples", str(args.max_samples)]
        if args.no_grad:
            cmd.append("--no-grad")
        return cmd

    def died(key: str, why: str) -> dict[str, Any]:
        oid = key.split(":", 1)[1]
        return apply_known({"id": oid, "name": oid, "dtypes": {}, "grad": {}, "paths": {},
                            "key": key, "error": why})

    return run_worker_pool(keys, args.jobs, command, died, worker_env(args), label="OpInfos",
                           quiet=args.quiet, progress=progress)


def worker_path(env: dict[str, str]) -> str:
    """``PYTHONPATH`` for worker processes: this torchport first, then the current directory
    (where a ``--backend`` module path is found), then the caller's."""
    import torchport

    here = str(Path(torchport.__file__).resolve().parents[1])
    return os.pathsep.join(filter(None, [here, os.getcwd(), env.get("PYTHONPATH")]))


def _read_worker(out: Path, results: dict[str, dict[str, Any]]) -> str | None:
    """Add the finished results of a worker's output file to ``results``; return the key
    of the OpInfo it started last and did not finish (``None`` if none)."""
    started = None
    if not out.exists():
        return None
    for line in out.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line being written
            break
        if "start" in rec:
            started = rec["start"]
        else:
            results[rec["result"]["key"]] = rec["result"]
            started = None
    return started


# ---- report ------------------------------------------------------------------------
def core_overloads_by_slot() -> tuple[list[str], list[str]]:
    """Core ATen overloads (``torch.Tag.core``): (with a backend slot, decomposed above the
    backend by a CompositeImplicitAutograd kernel)."""
    import torch

    from torchport.ops.registry import _has_backend_slot

    slot, above = [], []
    for schema in torch._C._jit_get_all_schemas():
        if not schema.name.startswith("aten::"):
            continue
        base, overload = schema.name[len("aten::"):], schema.overload_name
        packet = getattr(torch.ops.aten, base, None)
        try:
            op = getattr(packet, overload or "default") if packet is not None else None
        except (AttributeError, RuntimeError):
            op = None
        if op is None or torch.Tag.core not in op.tags:
            continue
        name = base + ("." + overload if overload else "")
        (slot if _has_backend_slot(op) else above).append(name)
    return sorted(set(slot)), sorted(set(above))


_STATUSES = ("pass", "known", "fail", "skip")


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals per OpInfo, per (OpInfo, dtype) and per gradient dtype, and the paths."""
    tot: dict[str, Any] = {"opinfos": dict.fromkeys(_STATUSES, 0),
                           "dtypes": {}, "grad": {}, "samples": {"passed": 0, "failed": 0,
                                                                 "skipped": 0},
                           "paths": {"native": 0, "decomposed": 0, "fallback": 0, "view": 0}}
    for r in results:
        tot["opinfos"][r["status"]] += 1
        for kind in ("dtypes", "grad"):
            for dt, v in r[kind].items():
                d = tot[kind].setdefault(dt, dict.fromkeys(_STATUSES, 0))
                d[v["status"]] += 1
                for k in ("passed", "failed", "skipped"):
                    tot["samples"][k] += v.get(k, 0)
    for kind in ("dtypes", "grad"):
        a = dict.fromkeys(_STATUSES, 0)
        for d in tot[kind].values():
            for k in _STATUSES:
                a[k] += d[k]
        ran = a["pass"] + a["known"] + a["fail"]
        tot[kind + "_all"] = {**a, "pass_rate": round(a["pass"] / ran, 4) if ran else None}
    o = tot["opinfos"]
    ran = o["pass"] + o["known"] + o["fail"]
    tot["opinfo_pass_rate"] = round(o["pass"] / ran, 4) if ran else None
    # every path of every overload, summed over the OpInfos (calls)
    calls: dict[str, dict[str, int]] = {}
    for r in results:
        counts = r.get("path_counts") or {n: {p: 1} for n, p in r.get("paths", {}).items()}
        for n, ps in counts.items():
            c = calls.setdefault(n, {})
            for p, k in ps.items():
                c[p] = c.get(p, 0) + k
    main = {n: max(c.items(), key=lambda kv: kv[1])[0] for n, c in calls.items()}
    for p in main.values():
        tot["paths"][p] = tot["paths"].get(p, 0) + 1
    tot["overload_paths"] = dict(sorted(main.items()))
    tot["overload_path_calls"] = dict(sorted(calls.items()))
    slot, above = core_overloads_by_slot()
    core: dict[str, Any] = {"overloads": len(slot) + len(above), "with_backend_slot": len(slot),
                            "above_backend": above, "by_path": {}, "not_exercised": []}
    for n in slot:
        if n not in calls:
            core["not_exercised"].append(n)
            continue
        for p in calls[n]:
            core["by_path"].setdefault(p, []).append(n)
    tot["core"] = core
    return tot


def write_reports(results: list[dict[str, Any]], out_dir: Path, meta: dict[str, Any],
                  name: str = "conformance") -> dict:
    """``<name>.json`` (everything) and ``<name>.md`` (tables) in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    totals = summarize(results)
    (out_dir / f"{name}.json").write_text(json.dumps(
        {"meta": meta, "known": [{"pattern": p, "kind": k, "reason": r} for p, k, r in KNOWN],
         "totals": totals, "results": results}, separators=(",", ":")))
    dts = meta["dtypes"]
    mode = ("TORCHPORT_SIM_STRICT=1 (device memory not host-addressable: every byte "
            "through the runtime)" if meta["strict"] else "default (host-addressable memory)")
    if meta.get("asynchronous"):
        mode += ", TORCHPORT_SIM_ASYNC=1 (kernels queued on stream workers)"
    device = meta.get("device", "sim")
    setup = f"sim memory: {mode}" if device == "sim" else f"backend: {meta.get('backend')}"
    lines = [f"# torchport conformance: {device} vs CPU over PyTorch's OpInfo database", "",
             f"Command: `{meta['command']}`  ", f"PyTorch {meta['torch']}, {setup}, "
             f"dtypes: {', '.join(dts)}, max samples per OpInfo and dtype: "
             f"{meta['max_samples']}, wall time: {meta['seconds']:.0f}s"
             + ("" if meta.get("complete", True) else
                f" -- PARTIAL: {len(results)} of {meta['opinfos_selected']} OpInfos so far"), "",
             *([f"Code: {meta['code']}", ""] if meta.get("code") else []),
             f"Each sample runs on the CPU and on `{device}`; outputs (and inputs the op mutated) "
             "are compared with `torch.testing.assert_close` (PyTorch's per-dtype "
             "tolerances); gradients for float32/float64 when the OpInfo supports autograd. "
             "Random and `empty*` ops are compared by structure, shape, dtype and device, "
             "random samples of the ops in `PROPERTIES` (dropout) by their properties "
             "(*Property checks*). "
             "**known** = a failure with a known cause (a limitation of the backend or a "
             "legitimate numerical difference; see *Known failures*): counted apart, never "
             "as a pass. A skip always gives its reason.", "",
             "## Totals", "",
             "| | pass | known | fail | skip | pass rate |", "|---|---:|---:|---:|---:|---:|"]

    def row(label: str, d: dict[str, Any], rate: float | None = None) -> str:
        if rate is None:
            ran = d["pass"] + d["known"] + d["fail"]
            rate = d["pass"] / ran if ran else None
        pr = "-" if rate is None else f"{100 * rate:.1f}%"
        return (f"| {label} | {d['pass']} | {d['known']} | {d['fail']} | {d['skip']} "
                f"| {pr} |")
    lines.append(row("OpInfos", totals["opinfos"], totals["opinfo_pass_rate"]))
    lines.append(row("forward (OpInfo, dtype), all dtypes", totals["dtypes_all"]))
    for dt in dts:
        if dt in totals["dtypes"]:
            lines.append(row(f"forward {dt}", totals["dtypes"][dt]))
    if totals["grad"]:
        lines.append(row("gradient (OpInfo, dtype), all", totals["grad_all"]))
        for dt, d in sorted(totals["grad"].items()):
            lines.append(row(f"gradient {dt}", d))
    s = totals["samples"]
    lines += ["", f"Samples: {s['passed']} passed, {s['failed']} failed (known failures "
              f"included), {s['skipped']} skipped (the CPU itself raises, or nothing "
              "to differentiate).", "",
              "Overloads seen on the device, by their most frequent path: "
              + ", ".join(f"{k} {v}" for k, v in totals["paths"].items()), ""]
    core = totals["core"]
    lines += ["## Core ATen ops by path", "",
              f"PyTorch tags {core['overloads']} overloads `torch.Tag.core`; "
              f"{len(core['above_backend'])} decompose above the backend "
              f"(CompositeImplicitAutograd: {', '.join(core['above_backend'])}), "
              f"{core['with_backend_slot']} reach it. Every path a core overload took "
              "in this run (an overload counts once per path):", "",
              "| path | core overloads | which |", "|---|---:|---|"]
    for p in ("native", "view", "decomposed", "fallback"):
        names = sorted(core["by_path"].get(p, []))
        which = ", ".join(names) or "none"
        lines.append(f"| {p} | {len(names)} | {_md(which, None)} |")
    lines += ["", f"Core overloads with a backend slot that no sample reached: "
              f"{len(core['not_exercised'])}"
              + (f" ({', '.join(core['not_exercised'])})" if core["not_exercised"] else "")
              + (". `tests/test_sim_core_opset.py` checks that every one is a native sim "
                 "kernel or a torchport core kernel." if device == "sim" else "."), ""]
    fails, knowns = [], []
    for r in results:
        if r.get("error"):
            k = r.get("error_known")
            (knowns if k and k["kind"] != "bug" else fails).append(
                (r["id"], "(whole OpInfo)", r["error"], k))
        for kind in ("dtypes", "grad"):
            for dt, v in r[kind].items():
                label = dt if kind == "dtypes" else f"{dt} (grad)"
                err = f"{v.get('failed', 0)}/{v.get('samples', 0)} samples: " \
                    + "; ".join(v.get("errors", []))
                if v["status"] == "fail":
                    fails.append((r["id"], label, err, v.get("known")))
                elif v["status"] == "known":
                    knowns.append((r["id"], label, err, v.get("known")))
    lines += ["## Failures", ""]
    if not fails:
        lines.append("None.")
    else:
        lines += ["Every failure with its diagnosis where one is known "
                  "(`KNOWN` in `torchport/conformance/opinfo.py`).", "",
                  "| OpInfo | dtype | diagnosis | error |", "|---|---|---|---|"]
        for oid, label, err, k in fails:
            lines.append(f"| {oid} | {label} | {_md(k['reason']) if k else 'not diagnosed'} "
                         f"| {_md(err)} |")
    lines += ["", "## Known failures", ""]
    if not knowns:
        lines.append("None.")
    else:
        lines += ["| OpInfo | dtype | kind | reason | error |", "|---|---|---|---|---|"]
        for oid, label, err, k in knowns:
            lines.append(f"| {oid} | {label} | {k['kind']} | {_md(k['reason'])} "
                         f"| {_md(err)} |")
    checked = [(pattern, kind, what) for pattern, kind, what in PROPERTIES
               if any(re.fullmatch(pattern, r["id"]) for r in results)]
    if checked:
        lines += ["", "## Property checks", "",
                  "Random samples of these OpInfos are checked by what their results must "
                  "satisfy, not by equality with the CPU's draws (`PROPERTIES` in "
                  "`torchport/conformance/opinfo.py`); a sample that breaks one fails.", "",
                  "| OpInfos (regex) | checks |", "|---|---|"]
        lines += [f"| `{pattern}` | {_md(what, None)} |" for pattern, _, what in checked]
    lines += ["", "## Per OpInfo", "",
              "Cells: status and passed/run samples. Paths: how many overloads took each "
              "path (most frequent path per overload).", "",
              "| OpInfo | status | " + " | ".join(dts) + " | grad | paths |",
              "|---|---|" + "---|" * len(dts) + "---|---|"]
    for r in results:
        cells = [_cell(r["dtypes"].get(dt)) for dt in dts]
        grad = " ".join(f"{dt}:{_cell(v)}" for dt, v in r["grad"].items()) or "-"
        counts: dict[str, int] = {}
        for p in r.get("paths", {}).values():
            counts[p] = counts.get(p, 0) + 1
        paths = " ".join(f"{k}:{v}" for k, v in sorted(counts.items())) or "-"
        lines.append(f"| {r['id']} | {r['status']} | " + " | ".join(cells)
                     + f" | {grad} | {paths} |")
    lines += ["", "## Path per overload", "",
              "Every ATen overload that reached the device, with its calls per path "
              "(summed over the OpInfos); core overloads in bold.", "",
              "| overload | native | view | decomposed | fallback |", "|---|---:|---:|---:|---:|"]
    core_names = {n for ns in core["by_path"].values() for n in ns}
    for n, c in totals["overload_path_calls"].items():
        label = f"**{n}**" if n in core_names else n
        lines.append(f"| {label} | " + " | ".join(str(c.get(p, "")) for p in
                                                  ("native", "view", "decomposed", "fallback"))
                     + " |")
    skips: dict[str, int] = {}
    sample_skips: dict[str, int] = {}
    for r in results:
        for kind in ("dtypes", "grad"):
            for v in r[kind].values():
                if v["status"] == "skip":
                    reason = _reason(v.get("reason", "?"))
                    skips[reason] = skips.get(reason, 0) + 1
                else:
                    for m in v.get("skip_reasons", []):
                        reason = _reason(m)
                        sample_skips[reason] = sample_skips.get(reason, 0) + 1
    lines += ["", "## Skip reasons", "", "Whole (OpInfo, dtype) entries skipped:", "",
              "| reason | count |", "|---|---:|"]
    for reason, n in sorted(skips.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {_md(reason)} | {n} |")
    lines += ["", "Single samples skipped inside entries that ran (count of entries):", "",
              "| reason | entries |", "|---|---:|"]
    for reason, n in sorted(sample_skips.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {_md(reason)} | {n} |")
    (out_dir / f"{name}.md").write_text("\n".join(lines) + "\n")
    return totals


def _reason(text: str) -> str:
    """A skip reason, grouped: numbers and long exception texts shortened."""
    text = re.sub(r"\d+", "N", text)
    return text[:140].strip()


def _cell(v: dict[str, Any] | None) -> str:
    if v is None:
        return "-"
    if v["status"] == "skip":
        return "skip"
    return f"{v['status']} {v.get('passed', 0)}/{v.get('samples', 0)}"


def _md(text: str, limit: int | None = 300) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:limit]


# ---- command line --------------------------------------------------------------------
def add_mode_arguments(p: argparse.ArgumentParser, report: str, jobs: int) -> None:
    """The options every driver of this package shares: the sim mode (``--strict``,
    ``--async``), worker processes, the report's place and name, and the worker side."""
    p.add_argument("--strict", action="store_true", help="TORCHPORT_SIM_STRICT=1 (device-only "
                   "memory)")
    p.add_argument("--async", dest="asynchronous", action="store_true",
                   help="TORCHPORT_SIM_ASYNC=1 (kernels queued on stream workers)")
    p.add_argument("--jobs", type=int, default=jobs, help="worker processes")
    p.add_argument("--out", default=str(Path.cwd() / "reports"), help="report directory "
                   "(default: reports/ in the current directory)")
    p.add_argument("--name", help=f"report file name without extension (default: {report}, "
                   f"{report}-strict with --strict, {report}-async with --async)")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-ids", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)


def report_name(a: argparse.Namespace, report: str) -> str:
    """``--name``, or the report's name for the sim mode."""
    return a.name or "-".join([report] + ["strict"] * a.strict + ["async"] * a.asynchronous)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", "-b", default="sim", help="the backend under test: sim, a "
                   "torchport.backends name, or a module path (as torchport run -b)")
    p.add_argument("--full", action="store_true", help="every OpInfo of op_db")
    p.add_argument("--subset", action="store_true", help="the representative subset's dtypes "
                   "and samples (" + ",".join(SUBSET_DTYPES) + f"; {SUBSET_MAX_SAMPLES} "
                   "samples), over its OpInfos or those of --ops (the default without --ops "
                   "and --full)")
    p.add_argument("--ops", help="regular expression over OpInfo names (full match)")
    p.add_argument("--dtypes", help="comma-separated dtypes (default: "
                   + ",".join(DEFAULT_DTYPES) + ")")
    p.add_argument("--max-samples", type=int, default=None, help="samples per OpInfo and dtype")
    p.add_argument("--no-grad", action="store_true", help="skip the gradient checks")
    p.add_argument("--op-timeout", type=float, default=600.0, help="seconds per OpInfo")
    add_mode_arguments(p, "conformance", os.cpu_count() or 1)
    a = p.parse_args(argv)
    if isinstance(a.dtypes, str):
        a.dtypes = [d.strip() for d in a.dtypes.split(",") if d.strip()]
    if a.full and a.subset:
        p.error("--full and --subset exclude each other")
    if a.backend != "sim" and (a.strict or a.asynchronous):
        p.error("--strict and --async are modes of the sim backend")
    if a.full:
        a.ops = a.ops or None
        a.dtypes = a.dtypes or list(DEFAULT_DTYPES)
    elif a.subset or not a.ops and not a.worker:
        a.ops = a.ops or SUBSET
        a.dtypes = a.dtypes or list(SUBSET_DTYPES)
        if a.max_samples is None:
            a.max_samples = SUBSET_MAX_SAMPLES
    a.dtypes = a.dtypes or list(DEFAULT_DTYPES)
    a.name = report_name(a, "conformance")
    import torch
    for d in a.dtypes:
        if not isinstance(getattr(torch, d, None), torch.dtype):
            p.error(f"unknown dtype {d!r}")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return _worker(args)
    import torch

    t0 = time.perf_counter()
    device = load_backend(args.backend)  # a backend that does not load fails here, once
    keys = _keys(args.ops)
    if not keys:
        print(f"no OpInfo matches {args.ops!r}", file=sys.stderr)
        return 2
    def meta(done: bool) -> dict[str, Any]:
        return {"command": PROG + " " + " ".join(
            sys.argv[1:] if argv is None else argv), "torch": torch.__version__,
            **({} if device == "sim" else {"device": device, "backend": args.backend}),
            "strict": args.strict, "asynchronous": args.asynchronous, "dtypes": args.dtypes,
            "max_samples": args.max_samples,
            "ops": args.ops if args.ops != SUBSET else "subset", "jobs": args.jobs,
            "seconds": time.perf_counter() - t0, "complete": done,
            "opinfos_selected": len(keys)}

    results = _run_workers(  # partial reports every minute, in case the run is cut short
        args, keys, lambda part: write_reports(part, Path(args.out), meta(False), args.name))
    totals = write_reports(results, Path(args.out), meta(True), args.name)
    o, f = totals["opinfos"], totals["dtypes_all"]
    print(f"OpInfos: {o['pass']} pass, {o['known']} known, {o['fail']} fail, {o['skip']} skip; "
          f"forward (OpInfo, dtype): {f['pass']} pass, {f['known']} known, {f['fail']} fail, "
          f"{f['skip']} skip; reports in {args.out}/{args.name}.{{json,md}}")
    return 1 if o["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())
