"""Conformance of a device (``sim`` by default) against the CPU, over PyTorch's nn.Module database.

A second yardstick next to the OpInfo run (:mod:`torchport.tools.conformance`): op-level
conformance misses what only whole modules do (fused RNN cells, batch norm running
statistics, attention fast paths, ``Module.to`` and serialization of device modules).

For every ModuleInfo of ``module_db``, its float32/float64 dtypes, training and eval
mode where they differ, and each sample input (``with_packed_sequence=True``, so the
RNNs see packed sequences), the module is built on the CPU with a fixed seed and copied
to the device with ``.to("sim")`` (``--backend``: another backend's device); both start from
the same parameters. Checks:

- ``forward``: the outputs (and that parameters tied on the CPU stay tied on the device);
- ``grad_input`` / ``grad_param``: gradients after ``backward`` of a random-weighted sum
  of the outputs;
- ``buffers``: the buffers after forward and backward (batch norm running statistics);
- ``noncontig``: outputs and gradients with every tensor input a strided copy;
- ``channels_last``: 4-D inputs in channels_last (the module too where its memory format
  affects the output): output values and strides;
- ``to_dtype``: ``.to(other float dtype)`` of the device module: state and outputs;
- ``pickle`` / ``save_load``: ``pickle`` and ``torch.save``/``torch.load`` of the device
  module (and its state_dict) give equal tensors on the device.

Results compare bit for bit (``torch.equal``) or else with ``torch.testing.assert_close``
(PyTorch's default tolerances); which one held is recorded. Modules whose CPU output
changes with the seed (dropout, RReLU in training) compare by shape, dtype and device.
Failures with a cause outside torchport's control are listed in ``KNOWN``.

    python -m tests.conformance.modules                      # every ModuleInfo
    python -m tests.conformance.modules --modules 'nn\\.(Linear|LSTM)' --max-samples 3
    python -m tests.conformance.modules --strict             # TORCHPORT_SIM_STRICT=1
    python -m tests.conformance.modules --async              # TORCHPORT_SIM_ASYNC=1
    python -m tests.conformance.modules --backend torchport.backends.reference  # device ref

On a backend other than ``sim`` the device computes with kernels of its own (and
decompositions), which round otherwise than the CPU's: a within-tolerance result there is
explained by ``KERNEL_ROUNDING`` unless ``KNOWN`` names a cause; a failure still fails.

Writes ``reports/modules.{json,md}`` (``modules-strict``, ``modules-async``,
``modules-<device>`` for another backend). The work
runs in worker processes (``--jobs``): a crash or hang costs one ModuleInfo. Exit status:
0 when nothing failed or crashed.
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import os
import pickle
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from torchport.tools.conformance.opinfo import (
    _md,
    _short,
    _stub_expecttest,
    add_mode_arguments,
    guarded,
    load_backend,
    report_name,
    run_worker_pool,
    worker_env,
)

ROOT = Path(__file__).resolve().parents[2]  # workers run -m tests.conformance.<driver>

DEVICE = "sim"  # the device under test: set by use_backend()
BACKEND = "sim"
DTYPES = ("float32", "float64")
CHECKS = ("forward", "grad_input", "grad_param", "buffers", "noncontig", "channels_last",
          "to_dtype", "pickle", "save_load", "lazy")
# bitwise: torch.equal; close: within assert_close's default tolerances; meta: a random
# module, compared by structure, shape, dtype and device; known: a failure with a cause
# outside torchport's control (KNOWN); fail: a wrong result; crash: the device raised (or
# the worker died, or timed out); skip: not applicable, or the CPU itself raises.
STATUSES = ("bitwise", "close", "meta", "known", "fail", "crash", "skip")
_RANK = {"skip": 0, "bitwise": 1, "meta": 2, "close": 3, "known": 4, "fail": 5, "crash": 6}

# Causes of differences: (regex over "<ModuleInfo>/<dtype>/<train|eval>/<check>", kind,
# reason). "tolerance" explains a result that held only within tolerance (PyTorch itself
# computes differently on non-CPU devices); "difference" and "limitation" turn a failure
# into "known"; "bug" gives the diagnosis of a torchport bug and leaves the result counted
# against it. An entry only ever applies to a result that was not bitwise.
_RNN_LAYERS = (
    "PyTorch takes another code path for multi-step RNN layers on non-CPU devices: "
    "FullLayer/FullBidirectionalLayer (`input.device().is_cpu()`) and PackedLayer/"
    "ReversedPackedLayer (`input.data.device().is_cpu()`) in aten/src/ATen/native/RNN.cpp "
    "precompute the input projection of all time steps in one `linear_ih` matmul "
    "(`pre_compute_input`) on the CPU only; elsewhere each step computes its own, so the "
    "weight gradients sum per step and round in another order")
_RNN_CELLS = (
    "PyTorch takes another code path for LSTM/GRU cells on non-CPU devices: LSTMCell/GRUCell "
    "in aten/src/ATen/native/RNN.cpp test `input.is_cuda() || input.is_xpu() || "
    "input.is_privateuseone()` and then compute the gate matmuls without bias and add both "
    "biases inside `_thnn_fused_lstm_cell`/`_thnn_fused_gru_cell`, where the CPU folds each "
    "bias into its `linear` (addmm); the sums round in another order")
_NUMERIC = "(forward|grad_input|grad_param|noncontig|channels_last|to_dtype)"
KNOWN: list[tuple[str, str, str]] = [
    (rf"nn\.RNN/.*/{_NUMERIC}", "tolerance", _RNN_LAYERS),
    (rf"nn\.(LSTM|GRU)/.*/{_NUMERIC}", "tolerance", _RNN_LAYERS + "; " + _RNN_CELLS),
    (rf"nn\.(LSTMCell|GRUCell)/.*/{_NUMERIC}", "tolerance", _RNN_CELLS),
    (r"nn\.GroupNorm/.*/channels_last", "tolerance",
     "PyTorch's autograd formula for native_group_norm (tools/autograd/derivatives.yaml) "
     "hands the backward the input and gradient in `input.suggest_memory_format()` on the CPU "
     "but contiguous on any other device (`grads[0].device().is_cpu() ? "
     "input.suggest_memory_format() : c10::MemoryFormat::Contiguous`), so with channels_last "
     "inputs the CPU runs its channels-last backward kernel and the device the contiguous "
     "one, which sum in another order"),
]

# Why a within-tolerance result on a backend other than sim is expected.
KERNEL_ROUNDING = (
    "the backend computes with kernels of its own and PyTorch's decompositions, not the "
    "CPU's ATen kernels: sums and products round in another order (the reference backend's "
    "numpy kernels accumulate in float64)")


def use_backend(name: str) -> str:
    """Register backend ``name`` (as ``torchport run -b`` takes it) for this process and
    make its device the one under test; the device's name."""
    global DEVICE, BACKEND
    DEVICE = load_backend(name)
    BACKEND = name
    return DEVICE


# The representative modules of the fast subset in ``make test``.
SUBSET = (r"nn\.(Linear|Conv2d|BatchNorm2d|LayerNorm|Embedding|LSTM|GRU|MultiheadAttention|"
          r"TransformerEncoderLayer|GroupNorm)")


# ---- loading module_db ---------------------------------------------------------------
def load_module_db() -> list[Any]:
    """PyTorch's ModuleInfo list (imported after the device is registered)."""
    _stub_expecttest()
    import torch.backends
    frozen = torch.backends.flags_frozen()
    from torch.testing._internal.common_modules import module_db
    if not frozen:  # PyTorch's test utilities freeze cudnn flags; leave the process as it was
        torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True
    return list(module_db)


def select(db: Sequence[Any], pattern: str | None) -> list[Any]:
    """ModuleInfos whose name (``nn.Linear``) fully matches ``pattern``."""
    if not pattern:
        return list(db)
    rx = re.compile(pattern)
    return [mi for mi in db if rx.fullmatch(mi.name)]


# ---- tensors in nested inputs and outputs -----------------------------------------------
def _map(v: Any, fn: Callable[[Any], Any], memo: dict[int, Any] | None = None) -> Any:
    """``fn`` over every tensor of nested tuples/lists/dicts and PackedSequences; the same
    tensor maps to the same result (attention takes a fast path when ``query is key``).
    A PackedSequence's ``batch_sizes`` stay as they are: PyTorch keeps them on the CPU."""
    import torch
    from torch.nn.utils.rnn import PackedSequence

    memo = {} if memo is None else memo

    def go(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            if id(x) not in memo:
                memo[id(x)] = fn(x)
            return memo[id(x)]
        if isinstance(x, PackedSequence):
            return PackedSequence(go(x.data), x.batch_sizes,
                                  None if x.sorted_indices is None else go(x.sorted_indices),
                                  None if x.unsorted_indices is None
                                  else go(x.unsorted_indices))
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            return type(x)(*(go(y) for y in x))
        if isinstance(x, (tuple, list)):
            return type(x)(go(y) for y in x)
        if isinstance(x, dict):
            return {k: go(y) for k, y in x.items()}
        return x
    return go(v)


def _leaves(v: Any, path: str = "") -> list[tuple[str, Any, bool]]:
    """(path, tensor, stays on the CPU) of every tensor in ``v``, in order."""
    import torch
    from torch.nn.utils.rnn import PackedSequence

    if isinstance(v, torch.Tensor):
        return [(path or "out", v, False)]
    if isinstance(v, PackedSequence):
        out = _leaves(v.data, path + ".data")
        out.append((path + ".batch_sizes", v.batch_sizes, True))
        for name in ("sorted_indices", "unsorted_indices"):
            t = getattr(v, name)
            if t is not None:
                out += _leaves(t, f"{path}.{name}")
        return out
    if isinstance(v, (tuple, list)):
        return [x for i, y in enumerate(v) for x in _leaves(y, f"{path}[{i}]")]
    if isinstance(v, dict):
        return [x for k, y in v.items() for x in _leaves(y, f"{path}[{k!r}]")]
    return []


def _bitwise(d: Any, c: Any) -> bool:
    """``torch.equal``, with NaNs in the same places counting as equal."""
    import torch

    if d.dtype != c.dtype or d.shape != c.shape:
        return False
    if torch.equal(d, c):
        return True
    if d.is_floating_point() or d.is_complex():
        dn, cn = d.isnan(), c.isnan()
        return bool(torch.equal(dn, cn) and torch.equal(d[~dn], c[~cn]))
    return False


def _significant_strides(t: Any) -> tuple[int, ...]:
    """Strides of the dimensions longer than 1 (the others carry no layout)."""
    return tuple(s if n > 1 else 0 for n, s in zip(t.shape, t.stride(), strict=True))


def compare(dev: Any, ref: Any, random: bool = False, strides: bool = False
            ) -> tuple[str, str | None]:
    """(status, message) of device results ``dev`` against CPU results ``ref``."""
    import torch

    dl, rl = _leaves(dev), _leaves(ref)
    if len(dl) != len(rl):
        return "fail", f"structure differs: {len(dl)} tensors on {DEVICE}, {len(rl)} on cpu"
    status, msgs = "bitwise", []
    for (path, d, stays_cpu), (_, c, _) in zip(dl, rl, strict=True):
        want = "cpu" if stays_cpu or c.device.type != "cpu" else DEVICE
        if d.device.type != want:
            return "fail", f"{path} on {d.device}, expected {want}"
        if d.shape != c.shape or d.dtype != c.dtype:
            return "fail", (f"{path}: shape/dtype {tuple(d.shape)}/{d.dtype} vs "
                            f"{tuple(c.shape)}/{c.dtype}")
        if random:
            status = "meta" if status == "bitwise" else status
            continue
        if strides and _significant_strides(d) != _significant_strides(c):
            return "fail", f"{path}: strides {d.stride()} on {DEVICE}, {c.stride()} on cpu"
        dc = d.detach().cpu()
        c = c.detach()
        if _bitwise(dc, c):
            continue
        try:
            torch.testing.assert_close(dc, c, equal_nan=True)
        except AssertionError as e:
            return "fail", f"{path}: " + _short(e)
        status = "close"
        diff = (dc.double() - c.double()).abs().nan_to_num(0).max().item() if dc.numel() else 0
        msgs.append(f"{path}: max abs diff {diff:.3g}")
    return status, ("; ".join(msgs)[:300] or None)


def _worst(results: Sequence[tuple[str, str | None]]) -> tuple[str, str | None]:
    worst = ("skip", None)
    for r in results:
        if _RANK[r[0]] > _RANK[worst[0]]:
            worst = r
    return worst


# ---- one sample -------------------------------------------------------------------------
class Runner:
    """Runs ModuleInfos on the device and the CPU (in the current process)."""

    def __init__(self, max_samples: int | None = None, timeout: float = 300.0) -> None:
        import torch

        import torchport.ops as tops

        self.torch = torch
        self.tops = tops
        self.max_samples = max_samples
        self.timeout = timeout
        self.cl = torch.channels_last

    # -- inputs
    def _cpu_copy(self, v: Any, layout: Callable[[Any], Any] | None = None) -> Any:
        def conv(x: Any) -> Any:
            c = x.detach().clone() if layout is None else layout(x.detach())
            return c.requires_grad_(True) if x.requires_grad else c
        return _map(v, conv)

    def _dev_copy(self, v: Any, layout: Callable[[Any], Any] | None = None) -> Any:
        """Tensors to the device (the strided layout made on the device from device data)."""
        def conv(x: Any) -> Any:
            d = x.detach().to(DEVICE)
            if layout is not None:
                d = layout(d)
            return d.requires_grad_(True) if x.requires_grad else d
        return _map(v, conv)

    @staticmethod
    def _strided(x: Any) -> Any:
        """A copy of ``x`` with equal values whose last dimension has stride 2."""
        if x.dim() == 0 or x.numel() <= 1:
            return x.clone()
        buf = x.new_zeros(*x.shape[:-1], 2 * x.shape[-1])
        v = buf[..., ::2]
        v.copy_(x)
        return v

    def _channels_last(self, x: Any) -> Any:
        return x.clone(memory_format=self.cl) if x.dim() == 4 else x.clone()

    # -- modules
    def _module(self, mi: Any, sample: Any, dtype: Any, training: bool) -> Any:
        """The module on the CPU, parameters from a fixed seed (lazy modules materialised
        on the CPU by a dry run, so the device copy starts from the same parameters)."""
        torch = self.torch
        ci = copy.deepcopy(sample.constructor_input)
        torch.manual_seed(0)
        m = self._construct(mi, ci, dtype).train(training)
        if mi.is_lazy:
            fi = sample.forward_input
            with torch.no_grad():
                m(*self._cpu_copy(fi.args), **self._cpu_copy(fi.kwargs))
        return m

    @staticmethod
    def _construct(mi: Any, ci: Any, dtype: Any) -> Any:
        """A lazy module takes its dtype as a factory argument (its parameters have no
        values to convert before the first call)."""
        if mi.is_lazy:
            return mi.module_cls(*ci.args, **{**ci.kwargs, "dtype": dtype})
        return mi.module_cls(*ci.args, **ci.kwargs).to(dtype)

    def _run(self, m: Any, args: Any, kwargs: Any, seed: int = 1234) -> Any:
        self.torch.manual_seed(seed)
        return m(*args, **kwargs)

    def _backward(self, out: Any, device: str) -> bool:
        """``backward`` of a random-weighted sum of the differentiable outputs (same weights
        on both sides); False when no output is differentiable."""
        torch = self.torch
        outs = [t for _, t, _ in _leaves(out) if t.requires_grad and t.is_floating_point()]
        if not outs:
            return False
        g = torch.Generator().manual_seed(7)
        total = sum((o * torch.randn(o.shape, dtype=o.dtype, generator=g).to(device)).sum()
                    for o in outs)
        total.backward()
        return True

    @staticmethod
    def _input_grads(args: Any, kwargs: Any) -> list[Any]:
        return [t.grad for _, t, _ in _leaves((args, kwargs)) if t.requires_grad]

    @staticmethod
    def _param_grads(m: Any) -> dict[str, Any]:
        return {n: p.grad for n, p in m.named_parameters()}

    @staticmethod
    def _ties(m: Any) -> list[list[str]]:
        groups: dict[int, list[str]] = {}
        for n, p in m.named_parameters(remove_duplicate=False):
            groups.setdefault(id(p), []).append(n)
        return sorted(g for g in groups.values() if len(g) > 1)

    def _grad_pairs(self, dev: Any, ref: Any) -> tuple[list[Any], list[Any]]:
        """Gradients side by side; a gradient on one side only is a failure."""
        d_out, r_out = [], []
        for d, r in zip(dev, ref, strict=True):
            if (d is None) != (r is None):
                raise AssertionError(f"gradient is {'None' if d is None else 'set'} on "
                                     f"{DEVICE}, {'None' if r is None else 'set'} on cpu")
            if d is not None:
                d_out.append(d)
                r_out.append(r)
        return d_out, r_out

    def _sample_checks(self, mi: Any, sample: Any, dtype: Any, training: bool,
                       serialize: bool) -> dict[str, tuple[str, str | None]]:
        res: dict[str, tuple[str, str | None]] = {}
        fi = sample.forward_input
        base = self._module(mi, sample, dtype, training)

        # reference, and whether the module is random (its output changes with the seed)
        m_cpu = copy.deepcopy(base)
        c_args, c_kwargs = self._cpu_copy(fi.args), self._cpu_copy(fi.kwargs)
        try:
            ref = self._run(m_cpu, c_args, c_kwargs)
        except Exception as e:
            return dict.fromkeys(CHECKS, ("skip", f"the CPU raises ({_short(e)[:120]})"))
        again = self._run(copy.deepcopy(base), self._cpu_copy(fi.args),
                          self._cpu_copy(fi.kwargs), seed=4321)
        random = compare_cpu(again, ref) != "bitwise"

        # forward, gradients, buffers
        try:
            m_dev = copy.deepcopy(base).to(DEVICE)
            d_args, d_kwargs = self._dev_copy(fi.args), self._dev_copy(fi.kwargs)
            out = self._run(m_dev, d_args, d_kwargs)
        except Exception as e:
            res["forward"] = ("crash", f"{DEVICE} raises {_short(e)}")
            for k in ("grad_input", "grad_param", "buffers"):
                res[k] = ("skip", "the forward crashed")
        else:
            st = compare(out, ref, random)
            if self._ties(m_dev) != self._ties(base):
                st = ("fail", f"tied parameters {self._ties(base)} on cpu, "
                              f"{self._ties(m_dev)} after .to({DEVICE!r})")
            res["forward"] = st
            try:
                has_grad = self._backward(ref, "cpu")
            except Exception as e:
                has_grad = False
                why = f"the CPU backward raises ({_short(e)[:120]})"
            else:
                why = "no differentiable output"
            if not has_grad:
                res["grad_input"] = res["grad_param"] = ("skip", why)
            else:
                try:
                    self._backward(out, DEVICE)
                except Exception as e:
                    res["grad_input"] = res["grad_param"] = (
                        "crash", f"{DEVICE} backward raises {_short(e)}")
                else:
                    res["grad_input"] = self._compare_grads(
                        self._input_grads(d_args, d_kwargs),
                        self._input_grads(c_args, c_kwargs), random, "inputs")
                    pd, pc = self._param_grads(m_dev), self._param_grads(m_cpu)
                    res["grad_param"] = self._compare_grads(
                        list(pd.values()), list(pc.values()), random, "parameters")
            bufs_d, bufs_c = dict(m_dev.named_buffers()), dict(m_cpu.named_buffers())
            if not bufs_c:
                res["buffers"] = ("skip", "no buffers")
            elif sorted(bufs_d) != sorted(bufs_c):
                res["buffers"] = ("fail", f"buffers {sorted(bufs_d)} vs {sorted(bufs_c)}")
            else:
                res["buffers"] = compare(bufs_d, {k: bufs_c[k] for k in bufs_d}, random)

        res["noncontig"] = self._layout_check(base, fi, random, self._strided)
        if any(t.dim() == 4 for _, t, _ in _leaves((fi.args, fi.kwargs))):
            res["channels_last"] = self._layout_check(
                base, fi, random, self._channels_last,
                channels_last=True, module_too=mi.module_memformat_affects_out)
        else:
            res["channels_last"] = ("skip", "no 4-D input")
        res["to_dtype"] = self._to_dtype(base, fi, dtype, random)
        res["lazy"] = self._lazy(mi, sample, dtype, training, fi, ref) if mi.is_lazy \
            else ("skip", "not a lazy module")
        if serialize:
            res["pickle"] = self._serialize(base, "pickle")
            res["save_load"] = self._serialize(base, "save_load")
        else:
            res["pickle"] = res["save_load"] = ("skip", "serialization checked in train mode")
        return res

    def _compare_grads(self, dev: list[Any], ref: list[Any], random: bool, what: str
                       ) -> tuple[str, str | None]:
        if not ref:
            return "skip", f"no {what} require grad"
        try:
            d, r = self._grad_pairs(dev, ref)
        except AssertionError as e:
            return "fail", str(e)
        if not r:
            return "skip", f"no gradient reaches the {what}"
        return compare(d, r, random)

    def _layout_check(self, base: Any, fi: Any, random: bool, layout: Callable[[Any], Any],
                      channels_last: bool = False, module_too: bool = False
                      ) -> tuple[str, str | None]:
        """Outputs (with strides for channels_last) and gradients with re-laid-out inputs,
        the same layout on both sides."""
        cl = channels_last
        m_cpu = copy.deepcopy(base)
        m_dev = copy.deepcopy(base)
        try:
            if module_too:  # 4-D parameters only: a 3-D conv's 5-D weight has no such format
                for m in (m_cpu, m_dev):
                    for t in [*m.parameters(), *m.buffers()]:
                        if t.dim() == 4:
                            t.data = t.data.contiguous(memory_format=self.cl)
            c_args, c_kwargs = self._cpu_copy(fi.args, layout), self._cpu_copy(fi.kwargs, layout)
            ref = self._run(m_cpu, c_args, c_kwargs)
            has_grad = self._backward(ref, "cpu")
        except Exception as e:
            return "skip", f"the CPU raises ({_short(e)[:120]})"
        try:
            m_dev.to(DEVICE)
            d_args, d_kwargs = self._dev_copy(fi.args, layout), self._dev_copy(fi.kwargs, layout)
            for (p, d, _), (_, c, _) in zip(_leaves((d_args, d_kwargs)),
                                            _leaves((c_args, c_kwargs)), strict=True):
                if _significant_strides(d) != _significant_strides(c):
                    return "fail", (f"input {p}: strides {d.stride()} on {DEVICE} after the "
                                    f"copy, {c.stride()} on cpu")
            out = self._run(m_dev, d_args, d_kwargs)
            if has_grad:
                self._backward(out, DEVICE)
        except Exception as e:
            return "crash", f"{DEVICE} raises {_short(e)}"
        parts = [compare(out, ref, random, strides=cl)]
        if has_grad:
            gi_d, gi_c = self._input_grads(d_args, d_kwargs), self._input_grads(c_args, c_kwargs)
            try:
                d, r = self._grad_pairs(gi_d + list(self._param_grads(m_dev).values()),
                                        gi_c + list(self._param_grads(m_cpu).values()))
            except AssertionError as e:
                return "fail", str(e)
            st, msg = compare(d, r, random)
            parts.append((st, f"grad: {msg}" if msg else None))
        return _worst(parts)

    def _to_dtype(self, base: Any, fi: Any, dtype: Any, random: bool
                  ) -> tuple[str, str | None]:
        """``.to(other dtype)`` of the device module: its state, then a forward pass."""
        torch = self.torch
        other = torch.float64 if dtype == torch.float32 else torch.float32

        def conv(x: Any) -> Any:
            return x.to(other) if x.is_floating_point() else x
        m_cpu = copy.deepcopy(base).to(other)
        cpu_state = {k: v.clone() for k, v in m_cpu.state_dict().items()}
        try:
            with torch.no_grad():
                ref = self._run(m_cpu, _map(fi.args, lambda x: conv(x.detach())),
                                _map(fi.kwargs, lambda x: conv(x.detach())))
        except Exception:
            ref = None
        try:
            m_dev = copy.deepcopy(base).to(DEVICE).to(other)
            state = compare(m_dev.state_dict(), cpu_state)
            if ref is None:
                return state
            with torch.no_grad():
                out = self._run(m_dev, _map(fi.args, lambda x: conv(x.detach().to(DEVICE))),
                                _map(fi.kwargs, lambda x: conv(x.detach().to(DEVICE))))
        except Exception as e:
            return "crash", f"{DEVICE} raises {_short(e)}"
        return _worst([state, compare(out, ref, random)])

    def _lazy(self, mi: Any, sample: Any, dtype: Any, training: bool, fi: Any, ref: Any
              ) -> tuple[str, str | None]:
        """A lazy module moved to the device before its first call: its parameters
        materialise on the device, shaped as on the CPU (values come from the device's
        generator, so the outputs compare by shape, dtype and device)."""
        torch = self.torch
        ci = copy.deepcopy(sample.constructor_input)
        torch.manual_seed(0)
        m = self._construct(mi, ci, dtype).train(training)
        ref_m = self._module(mi, sample, dtype, training)
        try:
            m.to(DEVICE)
            out = self._run(m, self._dev_copy(fi.args), self._dev_copy(fi.kwargs))
        except Exception as e:
            return "crash", f"{DEVICE} raises {_short(e)}"
        return _worst([compare(out, ref, random=True),
                       compare(dict(m.named_parameters()), dict(ref_m.named_parameters()),
                               random=True)])

    def _serialize(self, base: Any, how: str) -> tuple[str, str | None]:
        """A device module through pickle or torch.save/torch.load: the same class and
        equal tensors, still on the device, tied parameters still tied."""
        torch = self.torch
        try:
            m_dev = copy.deepcopy(base).to(DEVICE)
            if how == "pickle":
                back = pickle.loads(pickle.dumps(m_dev))
                states = [back.state_dict()]
            else:
                buf = io.BytesIO()
                torch.save(m_dev, buf)
                buf.seek(0)
                back = torch.load(buf, weights_only=False)
                buf = io.BytesIO()
                torch.save(m_dev.state_dict(), buf)
                buf.seek(0)
                states = [back.state_dict(), torch.load(buf, weights_only=True)]
        except Exception as e:
            return "crash", f"{DEVICE} raises {_short(e)}"
        if type(back) is not type(m_dev):
            return "fail", f"loaded a {type(back).__name__}, saved a {type(m_dev).__name__}"
        if self._ties(back) != self._ties(m_dev):
            return "fail", f"tied parameters {self._ties(m_dev)} became {self._ties(back)}"
        ref = base.state_dict()
        parts = [compare(s, ref) for s in states]
        st, msg = _worst(parts)
        # a round trip copies bytes: anything but bit for bit is wrong
        return ("fail", f"not bitwise: {msg}") if st == "close" else (st, msg)

    # -- one ModuleInfo
    def run_module(self, mi: Any) -> dict[str, Any]:
        """Results of one ModuleInfo: per dtype and mode, per sample, per check."""
        torch = self.torch
        t0 = time.perf_counter()
        out: dict[str, Any] = {"id": mi.name, "entries": []}
        modes = [True, False] if mi.train_and_eval_differ else [True]
        with guarded(out, self.timeout, self.tops, trace=(3, 400)):
            for name in DTYPES:
                dtype = getattr(torch, name)
                if dtype not in mi.supported_dtypes("cpu"):
                    continue
                for training in modes:
                    entry: dict[str, Any] = {"dtype": name,
                                             "mode": "train" if training else "eval",
                                             "samples": []}
                    out["entries"].append(entry)
                    torch.manual_seed(0)
                    samples = mi.module_inputs_func(mi, device="cpu", dtype=dtype,
                                                    requires_grad=True, training=training,
                                                    with_packed_sequence=True)
                    samples = [s for s in samples if s.forward_input is not None]
                    for i, s in enumerate(samples[:self.max_samples]):
                        checks = self._sample_checks(mi, s, dtype, training,
                                                     serialize=training == modes[0])
                        entry["samples"].append({
                            "i": i, "desc": s.desc,
                            "checks": {k: {"status": st, **({"msg": m} if m else {})}
                                       for k, (st, m) in checks.items()}})
        apply_known(out)
        out["seconds"] = round(time.perf_counter() - t0, 3)
        return out


def compare_cpu(a: Any, b: Any) -> str:
    """"bitwise" when two CPU results are equal bit for bit, else why not."""
    la, lb = _leaves(a), _leaves(b)
    if len(la) != len(lb):
        return "structure"
    for (_, x, _), (_, y, _) in zip(la, lb, strict=True):
        if not _bitwise(x.detach(), y.detach()):
            return "values"
    return "bitwise"


# ---- known causes ----------------------------------------------------------------------
def known_cause(key: str) -> tuple[str, str] | None:
    """(kind, reason) for ``"<ModuleInfo>/<dtype>/<mode>/<check>"``, if known."""
    for pattern, kind, reason in KNOWN:
        if re.fullmatch(pattern, key):
            return kind, reason
    return None


def apply_known(r: dict[str, Any]) -> dict[str, Any]:
    """Attach known causes to the results that were not bitwise; set the overall status."""
    for e in r["entries"]:
        for s in e["samples"]:
            for check, v in s["checks"].items():
                if v["status"] not in ("close", "fail", "crash"):
                    continue
                cause = known_cause(f"{r['id']}/{e['dtype']}/{e['mode']}/{check}")
                if cause is None:
                    if DEVICE != "sim" and v["status"] == "close":
                        v["reason"] = KERNEL_ROUNDING
                    continue
                kind, reason = cause
                if kind == "bug":  # diagnosed, still counted against torchport
                    v["diagnosis"] = reason
                elif v["status"] == "close":
                    v["reason"] = reason
                elif kind in ("difference", "limitation"):
                    v["status"], v["reason"], v["kind"] = "known", reason, kind
    r["status"] = _overall(r)
    return r


def _overall(r: dict[str, Any]) -> str:
    if r.get("error"):
        return "crash"
    sts = {v["status"] for e in r["entries"] for s in e["samples"] for v in s["checks"].values()}
    for st in ("crash", "fail", "known"):
        if st in sts:
            return st
    if sts & {"bitwise", "close", "meta"}:
        return "pass"
    return "skip"


def run_in_process(pattern: str | None, max_samples: int | None = None,
                   timeout: float = 300.0, backend: str = "sim") -> list[dict[str, Any]]:
    """Run the selected ModuleInfos here, on ``backend`` (loaded if not registered yet)."""
    use_backend(backend)

    runner = Runner(max_samples=max_samples, timeout=timeout)
    return [runner.run_module(mi) for mi in select(load_module_db(), pattern)]


def problems(results: Sequence[dict[str, Any]]) -> dict[str, list[str]]:
    """Every crash, failure and unexplained within-tolerance result, by ModuleInfo."""
    out: dict[str, list[str]] = {}
    for r in results:
        if r.get("error"):
            out.setdefault(r["id"], []).append("error: " + r["error"])
        for e in r["entries"]:
            for s in e["samples"]:
                for check, v in s["checks"].items():
                    bad = v["status"] in ("fail", "crash") or (
                        v["status"] == "close" and "reason" not in v)
                    if bad:
                        out.setdefault(r["id"], []).append(
                            f"{e['dtype']}/{e['mode']}/#{s['i']}/{check}: {v['status']} "
                            f"{v.get('msg', '')}")
    return out


# ---- workers ---------------------------------------------------------------------------
def _worker(args: argparse.Namespace) -> int:
    use_backend(args.backend)  # before module_db: device bases are computed at import

    db = load_module_db()
    ids = set(json.loads(Path(args.worker_ids).read_text()))
    runner = Runner(max_samples=args.max_samples, timeout=args.timeout)
    with open(args.worker_out, "a") as f:
        for i, mi in enumerate(db):
            key = f"{i}:{mi.name}"
            if key not in ids:
                continue
            f.write(json.dumps({"start": key}) + "\n")
            f.flush()
            r = runner.run_module(mi)
            r["key"] = key
            f.write(json.dumps({"result": r}) + "\n")
            f.flush()
    return 0


def _run_workers(args: argparse.Namespace, keys: list[str],
                 progress: Callable[[list[dict[str, Any]]], Any] | None = None
                 ) -> list[dict[str, Any]]:
    """The ModuleInfos ``keys`` in ``--jobs`` worker processes; a worker that dies costs the
    ModuleInfo it was running (a crash), and a new worker takes the rest of its list."""
    env = worker_env(args)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))

    def command(ids: Path, out: Path) -> list[str]:
        cmd = [sys.executable, "-m", "tests.conformance.modules", "--worker",
               "--worker-ids", str(ids), "--worker-out", str(out),
               "--timeout", str(args.timeout), "--backend", args.backend]
        if args.max_samples is not None:
            cmd += ["--max-samples", str(args.max_samples)]
        return cmd

    def died(key: str, why: str) -> dict[str, Any]:
        return apply_known({"id": key.split(":", 1)[1], "key": key, "entries": [],
                            "error": why})

    return run_worker_pool(keys, args.jobs, command, died, env, label="ModuleInfos",
                           quiet=args.quiet, progress=progress, cwd=ROOT)


# ---- report ----------------------------------------------------------------------------
def summarize(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Counts per check kind (over every sample of every dtype and mode) and per module."""
    checks = {c: dict.fromkeys(STATUSES, 0) for c in CHECKS}
    modules = dict.fromkeys(("pass", "known", "fail", "crash", "skip"), 0)
    for r in results:
        modules[r["status"]] += 1
        for e in r["entries"]:
            for s in e["samples"]:
                for c, v in s["checks"].items():
                    checks[c][v["status"]] += 1
    return {"checks": checks, "modules": modules, "module_infos": len(results)}


def _cell(r: dict[str, Any], check: str) -> str:
    counts: dict[str, int] = {}
    for e in r["entries"]:
        for s in e["samples"]:
            st = s["checks"][check]["status"]
            counts[st] = counts.get(st, 0) + 1
    if not counts:
        return "-"
    marks = {"bitwise": "=", "close": "~", "meta": "m", "known": "k", "fail": "FAIL ",
             "crash": "CRASH ", "skip": "-"}
    return " ".join(f"{marks[st]}{n}" for st, n in sorted(counts.items(),
                                                            key=lambda kv: -_RANK[kv[0]]))


def write_reports(results: list[dict[str, Any]], out_dir: Path, meta: dict[str, Any],
                  name: str = "modules") -> dict[str, Any]:
    """``<name>.json`` (everything) and ``<name>.md`` (tables) in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    totals = summarize(results)
    (out_dir / f"{name}.json").write_text(json.dumps(
        {"meta": meta, "known": [{"pattern": p, "kind": k, "reason": r} for p, k, r in KNOWN],
         "totals": totals, "results": results}, separators=(",", ":")))
    dev = meta.get("device", "sim")
    mode = ("TORCHPORT_SIM_STRICT=1 (device memory not host-addressable)" if meta["strict"]
            else "default (host-addressable memory)")
    if dev != "sim":
        mode = f"backend `{meta['backend']}` (its own memory and kernels)"
    if meta.get("asynchronous"):
        mode += ", TORCHPORT_SIM_ASYNC=1 (kernels queued on stream workers)"
    partial = "" if meta.get("complete", True) else (
        f" -- PARTIAL: {len(results)} of {meta['selected']} ModuleInfos so far")
    lines = [
        f"# torchport conformance: {dev} vs CPU over PyTorch's nn.Module database", "",
        f"Command: `{meta['command']}`  ",
        f"PyTorch {meta['torch']}, {'sim memory' if dev == 'sim' else 'device'}: {mode}, "
        f"dtypes: float32/float64 (where the "
        f"ModuleInfo has them), max samples per ModuleInfo, dtype and mode: "
        f"{meta['max_samples']}, wall time: {meta['seconds']:.0f}s{partial}", "",
        f"Each sample builds the module on the CPU from a fixed seed and copies it to `{dev}` "
        f"with `.to('{dev}')`; both run the sample. Checks: `forward` outputs (and tied "
        "parameters staying tied); `grad_input`/`grad_param` after `backward` of a "
        "random-weighted sum of the outputs; `buffers` after the call; `noncontig` "
        "(every tensor input a strided copy, on both sides); `channels_last` (4-D inputs, "
        "the module too where its memory format affects the output: values and output "
        "strides); `to_dtype` (`.to(float64/float32)` of the device module: state and "
        "outputs); `pickle` and `save_load` (`torch.save`/`torch.load` of the module and "
        "of its state_dict) giving equal tensors on the device; `lazy`: a lazy module moved "
        "to the device before its first call materialises its parameters there (lazy "
        "modules are otherwise materialised on the CPU by a dry run first).", "",
        "**bitwise** = `torch.equal`; **close** = only within `torch.testing.assert_close`'s "
        "default tolerances (see *Differences* for why); **meta** = a random module "
        "(output changes with the seed), compared by shape, dtype and device; **known** = a "
        "failure with a cause outside torchport's control; **crash** = the device raised "
        "(or the ModuleInfo's worker died or timed out).", "",
        "## Totals per check", "",
        "Counted per sample (ModuleInfo x dtype x mode x sample).", "",
        "| check | bitwise | close | meta | known | fail | crash | skip |",
        "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for c in CHECKS:
        d = totals["checks"][c]
        lines.append(f"| {c} | " + " | ".join(str(d[s]) for s in STATUSES) + " |")
    all_ = {s: sum(totals["checks"][c][s] for c in CHECKS) for s in STATUSES}
    lines.append("| **all** | " + " | ".join(f"**{all_[s]}**" for s in STATUSES) + " |")
    m = totals["modules"]
    lines += ["", f"ModuleInfos: {totals['module_infos']}: " + ", ".join(
        f"{v} {k}" for k, v in m.items()) + " (a ModuleInfo passes when every check "
        "passed bitwise, within tolerance or by metadata, or was skipped).", ""]

    # every difference, grouped
    groups: dict[tuple, dict[str, Any]] = {}
    for r in results:
        if r.get("error"):
            groups[(r["id"], "(whole ModuleInfo)", "crash", "")] = {
                "where": [], "n": 1, "msg": r["error"], "reason": ""}
        for e in r["entries"]:
            for s in e["samples"]:
                for c, v in s["checks"].items():
                    if v["status"] not in ("close", "known", "fail", "crash"):
                        continue
                    reason = v.get("reason") or (
                        "torchport bug: " + v["diagnosis"] if "diagnosis" in v else "")
                    g = groups.setdefault((r["id"], c, v["status"], reason),
                                          {"where": [], "n": 0, "msg": v.get("msg", ""),
                                           "reason": reason})
                    g["n"] += 1
                    w = f"{e['dtype']}/{e['mode']}"
                    if w not in g["where"]:
                        g["where"].append(w)
    order = {"crash": 0, "fail": 1, "known": 2, "close": 3}
    lines += ["## Differences", "",
              "Every result that was not bit for bit, grouped by ModuleInfo, check, status "
              "and reason (samples: how many; first message shown). A within-tolerance "
              "result without a reason is unexplained: the math should be the same.", ""]
    if not groups:
        lines.append("None.")
    else:
        lines += ["| ModuleInfo | check | status | samples | where | reason | message |",
                  "|---|---|---|---:|---|---|---|"]
        for (mid, c, st, _), g in sorted(groups.items(),
                                         key=lambda kv: (order[kv[0][2]], kv[0][0], kv[0][1])):
            lines.append(f"| {mid} | {c} | {st} | {g['n']} | {' '.join(g['where'])} | "
                         f"{_md(g['reason'], 1200) if g['reason'] else 'not explained'} | "
                         f"{_md(g['msg'])} |")
    lines += ["", "## Per ModuleInfo", "",
              "Cells: counts of samples per status: `=` bitwise, `~` close, `m` meta "
              "(random module), `k` known, `-` skipped.", "",
              "| ModuleInfo | status | dtypes/modes | samples | " + " | ".join(CHECKS) + " |",
              "|---|---|---|---:|" + "---|" * len(CHECKS)]
    for r in results:
        dm = " ".join(f"{e['dtype'].replace('float', 'f')}/{e['mode']}" for e in r["entries"])
        ns = sum(len(e["samples"]) for e in r["entries"])
        st = r["status"] + (f" ({_md(r['error'], 80)})" if r.get("error") else "")
        lines.append(f"| {r['id']} | {st} | {dm or '-'} | {ns} | "
                     + " | ".join(_cell(r, c) for c in CHECKS) + " |")
    skips: dict[tuple[str, str], int] = {}
    for r in results:
        for e in r["entries"]:
            for s in e["samples"]:
                for c, v in s["checks"].items():
                    if v["status"] == "skip":
                        k = (c, re.sub(r"\d{2,}", "N", v.get("msg", "?"))[:140])
                        skips[k] = skips.get(k, 0) + 1
    lines += ["", "## Skip reasons", "", "| check | reason | samples |", "|---|---|---:|"]
    for (c, reason), n in sorted(skips.items(), key=lambda kv: (kv[0][0], -kv[1])):
        lines.append(f"| {c} | {_md(reason)} | {n} |")
    lines += ["", "## Known causes", "", "`KNOWN` in `tests/conformance/modules.py`:", "",
              "| pattern | kind | reason |", "|---|---|---|"]
    for p, k, reason in KNOWN:
        lines.append(f"| `{_md(p)}` | {k} | {_md(reason, 1200)} |")
    (out_dir / f"{name}.md").write_text("\n".join(lines) + "\n")
    return totals


# ---- command line ----------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tests.conformance.modules", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modules", help="regular expression over ModuleInfo names (full match), "
                   "e.g. 'nn\\.(Linear|LSTM)'")
    p.add_argument("--max-samples", type=int, default=None,
                   help="samples per ModuleInfo, dtype and mode")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per ModuleInfo")
    p.add_argument("--backend", "-b", default="sim", help="the backend under test: sim, a "
                   "torchport.backends name, or a module path (as torchport run -b); the "
                   "report is modules-<device> unless --name says otherwise")
    add_mode_arguments(p, "modules", os.cpu_count() or 1)
    a = p.parse_args(argv)
    if a.backend != "sim" and (a.strict or a.asynchronous):
        p.error("--strict and --async are modes of the sim backend")
    a.named = a.name is not None
    a.name = report_name(a, "modules")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return _worker(args)
    import torch

    t0 = time.perf_counter()
    device = use_backend(args.backend)  # a backend that does not load fails here, once
    if device != "sim" and not args.named:
        args.name = f"modules-{device}"
    keys = [f"{i}:{mi.name}" for i, mi in enumerate(load_module_db())
            if not args.modules or re.fullmatch(args.modules, mi.name)]
    if not keys:
        print(f"no ModuleInfo matches {args.modules!r}", file=sys.stderr)
        return 2

    def meta(done: bool) -> dict[str, Any]:
        return {"command": "python -m tests.conformance.modules " + " ".join(
            sys.argv[1:] if argv is None else argv), "torch": torch.__version__,
            **({} if device == "sim" else {"device": device, "backend": args.backend}),
            "strict": args.strict, "asynchronous": args.asynchronous,
            "max_samples": args.max_samples, "modules": args.modules, "jobs": args.jobs,
            "seconds": time.perf_counter() - t0, "complete": done, "selected": len(keys)}

    results = _run_workers(  # partial reports every minute, in case the run is cut short
        args, keys, lambda part: write_reports(part, Path(args.out), meta(False), args.name))
    totals = write_reports(results, Path(args.out), meta(True), args.name)
    m = totals["modules"]
    print("ModuleInfos: " + ", ".join(f"{v} {k}" for k, v in m.items())
          + f"; reports in {args.out}/{args.name}.{{json,md}}")
    return 1 if m["fail"] or m["crash"] else 0


if __name__ == "__main__":
    sys.exit(main())
