"""The CPU fallback, and the control of which path an op takes.

Registered as PrivateUse1's boxed fallback: every op without a device kernel
runs on the CPU (the path DIPU and torch_npu take for unsupported ops), made
schema-exact by :mod:`torchport.ops.hostexec`. Before falling back, an op with
a ``torch._decomp`` decomposition into device kernels is decomposed instead
(:mod:`torchport.ops.paths`).

Controls (environment variables, read when the backend registers; also
settable at run time):

* ``TORCHPORT_FORCE_FALLBACK_OPS`` -- comma-separated regular expressions,
  matched in full against overload names (``add.out``, ``.*\\.Scalar``): those
  ops run on the CPU even when a kernel exists (bisecting a wrong kernel, as
  DIPU's ``DIPU_FORCE_FALLBACK_OPS_LIST``). :func:`set_force_fallback`.
* ``TORCHPORT_FALLBACK=0`` -- no CPU fallback: an op without a kernel raises
  :class:`NotImplementedError` naming it and its dtypes. :func:`set_fallback_enabled`.
* ``TORCHPORT_FALLBACK_WARN=0`` -- silence the :class:`FallbackWarning`: one per op
  that first falls back, and at most one per line of user code (``print(t)`` runs
  several). :func:`set_fallback_warn`.

Porting tools (autocompare, op dumps) see every device op call through
:mod:`torchport.ops.hooks`: while one is registered the slow paths below call
:func:`hooks.dispatch` around each op.

Warm calls in C++: where the C++ host-op kernels compute (memory the host reads at the
device address, a synchronous runtime: :mod:`torchport.ops.native_hostops`), the
registered fallback is C++'s while nothing intercepts ops. An overload this module has run
on the CPU once, with no decomposition for it, warned about and not forced, whose schema
the host-op kernels serve, is then served in C++ (the CPU kernel on CPU tensors over the
device memory, 1-3 us over the CPU's call); every other call reaches the Python fallback
as before. Forcing, op statistics, tools and ``TORCHPORT_FALLBACK=0`` put the Python
registration back or make it decide again. On device-only memory (the host reaches it only
through the runtime's copies) the same C++ fallback serves those overloads through the
runtime's ``copy_d2h``/``copy_h2d`` (``native_staged.cpp``: the copies plus a few us) while
the default stream is current; on asynchronous runtimes with the sim's C++ queues C++
serves them as on a synchronous one once the current stream's queued work has run (the
Python fallback's order too).
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from torchport.core import native, settings
from torchport.core.libraries import keep_past_exit
from torchport.memory import tensors
from torchport.ops import derive, hooks, hostexec, paths, stats, switch, teardown
from torchport.ops.declarations import Decline
from torchport.ops.plan import plan_for

if TYPE_CHECKING:
    from torchport.core.contracts import DeviceBackend


class FallbackWarning(UserWarning):
    """An op ran on the CPU because the device has no kernel for it."""


class Route:
    """Per-overload switch read by a native kernel's wrapper (precomputed, cheap)."""

    __slots__ = ("forced", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self.forced = False


# ---- state ------------------------------------------------------------------
INTERCEPTING = False  # True when any op is forced, op statistics record or a tool intercepts
SLOW = False  # INTERCEPTING, or the interpreter is exiting (ops.teardown)
_PATTERNS: list[re.Pattern[str]] = []
_ROUTES: dict[str, Route] = {}  # overload name -> route of a native kernel
_FORCED_CACHE: dict[str, bool] = {}
_ENABLED: bool = settings.get("TORCHPORT_FALLBACK")
switch.FALLBACK_ENABLED = _ENABLED
_WARN: bool = settings.get("TORCHPORT_FALLBACK_WARN")


class _Warned(set):
    """The overloads warned about. One taken out warns again at its next call, which the
    Python fallback must then see: the overloads C++ serves are forgotten."""

    def discard(self, name: str) -> None:
        super().discard(name)
        _forget_learnt()

    def remove(self, name: str) -> None:
        super().remove(name)
        _forget_learnt()

    def clear(self) -> None:
        super().clear()
        _forget_learnt()


_WARNED: set[str] = _Warned()
_WARNED_SITES: set[tuple[str, int]] = set()  # user lines a fallback warning named
_HAS_CPU_KERNEL: dict[str, bool] = {}  # qualified op name (@key) -> the CPU can run it
_INTERNAL_DIRS = tuple(os.path.dirname(m.__file__ or "") + os.sep
                       for m in (torch, sys.modules["torchport"]))


_SLOW_LISTENERS: list[Callable[[bool], None]] = []


def on_slow_change(fn: Callable[[bool], None]) -> None:
    """Call ``fn(INTERCEPTING)`` whenever it changes: the kernels in C++, which nothing
    intercepts, give way to Python ones while it is set."""
    _SLOW_LISTENERS.append(fn)


def _refresh_slow() -> None:
    global SLOW, INTERCEPTING
    was, INTERCEPTING = INTERCEPTING, bool(_PATTERNS) or stats.ENABLED or hooks.ACTIVE
    SLOW = INTERCEPTING or teardown.ACTIVE
    if INTERCEPTING != was:
        for fn in _SLOW_LISTENERS:
            fn(INTERCEPTING)


stats.on_change(_refresh_slow)
hooks.on_change(_refresh_slow)
teardown.on_start(_refresh_slow)
_refresh_slow()  # TORCHPORT_OP_STATS=1 may have started recording already


def parse_patterns(text: str | None) -> list[str]:
    """``"add.out, .*\\.Scalar"`` -> ``["add.out", ".*\\.Scalar"]``."""
    return settings.parse_list(text) if text else []


def matches_any(patterns: Iterable[re.Pattern[str]], name: str) -> bool:
    """Does a pattern match overload ``name`` in full? A default overload (``addmm``)
    also answers to its ``.default`` spelling (``addmm.default``, as ``str(op)`` says)."""
    full = name if "." in name else name + ".default"
    return any(p.fullmatch(name) or p.fullmatch(full) for p in patterns)


class OpMatcher:
    """Overload names matched in full by a list of regular expressions (cached).

    The forced-fallback syntax, reused by the porting tools (``TORCHPORT_AUTOCOMPARE``,
    ``TORCHPORT_DUMP_FILTER``). ``None`` or an empty list matches every op."""

    def __init__(self, patterns: Iterable[str] | str | None, what: str = "pattern") -> None:
        if isinstance(patterns, str):
            patterns = parse_patterns(patterns)
        self.patterns: list[re.Pattern[str]] = []
        for p in patterns or ():
            try:
                self.patterns.append(re.compile(p))
            except re.error as e:
                raise ValueError(f"{what}: bad regular expression {p!r}: {e}") from None
        self._cache: dict[str, bool] = {}

    def __call__(self, name: str) -> bool:
        if not self.patterns:
            return True
        v = self._cache.get(name)
        if v is None:
            v = self._cache[name] = matches_any(self.patterns, name)
        return v

    def __repr__(self) -> str:
        return f"OpMatcher({[p.pattern for p in self.patterns]!r})"


def set_force_fallback(patterns: Iterable[str] | str | None) -> list[str]:
    """Force overloads whose name fully matches a pattern to the CPU; returns the old patterns.

    ``None`` or ``[]`` clears. A string is split on commas like the env variable."""
    global _PATTERNS
    if isinstance(patterns, str):
        patterns = parse_patterns(patterns)
    old = [p.pattern for p in _PATTERNS]
    compiled = []
    for p in patterns or ():
        try:
            compiled.append(re.compile(p))
        except re.error as e:
            raise ValueError(f"TORCHPORT_FORCE_FALLBACK_OPS: bad regular expression {p!r}: {e}") \
                from None
    _PATTERNS = compiled
    _FORCED_CACHE.clear()
    for r in _ROUTES.values():
        r.forced = is_forced(r.name)
    paths.forget_decisions()
    _refresh_slow()
    return old


def force_fallback_patterns() -> list[str]:
    """The current forced-fallback patterns."""
    return [p.pattern for p in _PATTERNS]


def is_forced(name: str) -> bool:
    """Is overload ``name`` (``"add.out"``) forced to the CPU?"""
    if not _PATTERNS:
        return False
    v = _FORCED_CACHE.get(name)
    if v is None:
        v = _FORCED_CACHE[name] = matches_any(_PATTERNS, name)
    return v


def set_fallback_enabled(enabled: bool) -> bool:
    """Allow (True) or forbid (False) the CPU fallback; returns the old setting."""
    global _ENABLED
    old, _ENABLED = _ENABLED, bool(enabled)
    switch.FALLBACK_ENABLED = _ENABLED
    if old != _ENABLED:
        _forget_learnt()  # its calls must reach the Python check again
    return old


def set_fallback_warn(warn: bool) -> bool:
    """Warn (once per op) when an op falls back; returns the old setting."""
    global _WARN
    old, _WARN = _WARN, bool(warn)
    if old != _WARN:
        _forget_learnt()  # an op first run unwarned warns at its next call
    return old


def route_for(name: str) -> Route:
    """The route of a native kernel (made at registration)."""
    r = _ROUTES.get(name)
    if r is None:
        r = _ROUTES[name] = Route(name)
        r.forced = is_forced(name)
    return r


def load_env() -> None:
    """Read ``TORCHPORT_FORCE_FALLBACK_OPS`` (at backend registration)."""
    patterns = settings.get("TORCHPORT_FORCE_FALLBACK_OPS")
    if patterns:
        set_force_fallback(patterns)


# ---- paths ------------------------------------------------------------------
def _dtype_text(args: tuple, kwargs: dict) -> str:
    ds = stats._dtypes(args, kwargs)
    return ", ".join(str(d).removeprefix("torch.") for d in ds) or "no tensors"


def _has_cpu_kernel(op: Any, cpu_key: str) -> bool:
    qualified = op.name() if cpu_key == "CPU" else f"{op.name()}@{cpu_key}"
    has_cpu = _HAS_CPU_KERNEL.get(qualified)
    if has_cpu is None:
        has_cpu = _HAS_CPU_KERNEL[qualified] = \
            torch._C._dispatch_has_computed_kernel_for_dispatch_key(op.name(), cpu_key)
    return has_cpu


def run_cpu(backend: DeviceBackend, op: Any, name: str, args: tuple, kwargs: dict,
            forced: bool = False, cpu_key: str = "CPU") -> Any:
    """The CPU fallback proper (raises when it is turned off and the op is not forced).
    ``cpu_key``: the CPU's dispatch key the op's kernel is looked up on (``QuantizedCPU``
    for quantized operands)."""
    if not _has_cpu_kernel(op, cpu_key):
        raise NotImplementedError(
            f"{name} ({_dtype_text(args, kwargs)}) has no {backend.name} kernel and PyTorch has "
            f"no CPU kernel to fall back to (a CUDA-only op); add a {backend.name} kernel for "
            f"it, or use an op the device supports")
    if not forced:
        if not _ENABLED:
            raise NotImplementedError(
                f"{name} ({_dtype_text(args, kwargs)}) has no {backend.name} kernel and the CPU "
                f"fallback is off (TORCHPORT_FALLBACK=0); add a kernel or enable the fallback")
        if _WARN and name not in _WARNED:
            _warn_once(backend, name, args, kwargs)
    if not stats.ENABLED:
        return hostexec.run_on_host(backend, op, args, kwargs)
    t0 = time.perf_counter()
    try:
        return hostexec.run_on_host(backend, op, args, kwargs)
    finally:
        stats.add(name, "fallback", args, kwargs, time.perf_counter() - t0)


def _warn_once(backend: DeviceBackend, name: str, args: tuple, kwargs: dict) -> None:
    """One :class:`FallbackWarning` per op, and at most one per user line: one line of user
    code (``print(t)``) can run a dozen ops the device lacks, and a dozen warnings there say
    no more than the first; the others are marked warned too, so they stay quiet later."""
    _WARNED.add(name)
    level, site = _user_frame()
    if site is not None and site in _WARNED_SITES:
        return
    if site is not None:
        _WARNED_SITES.add(site)
    warnings.warn(
        f"{name} ({_dtype_text(args, kwargs)}) has no {backend.name} kernel; running it on "
        f"the CPU (other ops of this line that fall back are not warned about: "
        f"torchport.ops.record() lists each op's path; TORCHPORT_FALLBACK_WARN=0 silences "
        f"this)", FallbackWarning, stacklevel=level)


def _user_frame() -> tuple[int, tuple[str, int] | None]:
    """The ``stacklevel`` naming the first frame outside torch and torchport -- the user's
    line that led to the op, as a warning about their code should -- and that line."""
    frame, level = sys._getframe(3), 3  # run_cpu's caller, as seen from warnings.warn
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL_DIRS):
        frame, level = frame.f_back, level + 1
    if frame is None:
        return 2, None
    return level, (frame.f_code.co_filename, frame.f_lineno)


# The overloads whose decomposition runs in this thread now. A decomposition learnt on
# one call may re-enter its own overload on another (``pow(x, 2)`` is ``x * x``, but
# ``pow(x, 3)`` is ``prims.pow``, which calls ``pow`` again): that inner call falls back.
_DECOMPOSING = threading.local()


def _choose_path(backend: DeviceBackend, op: Any, name: str, args: tuple,
                 kwargs: dict) -> tuple[str, Callable[..., Any] | None, bool]:
    """(path, decomposition, forced) for an op without a usable kernel."""
    forced = is_forced(name)
    if not forced and op not in getattr(_DECOMPOSING, "ops", ()):
        d = paths.decomposition_for(op, backend.name, args, kwargs, is_forced)
        if d is not None:
            refused = paths.cpu_refusal(op, args, kwargs)
            if refused is not None:  # the kernels refuse these dtypes: so does the device,
                # in the kernel's words for this call (its checks' order: an empty dim's
                # error comes before the dtype's), where the CPU kernel can say them
                if _ENABLED and _has_cpu_kernel(op, "CPU"):
                    return "fallback", None, False
                raise type(refused)(*refused.args)
            return "decomposed", d, False
    return "fallback", None, forced


def _run_path(backend: DeviceBackend, op: Any, name: str, args: tuple, kwargs: dict,
              d: Callable[..., Any] | None, forced: bool) -> Any:
    if d is not None:
        # CUDA's device checks first: the decomposition would write a CPU out=, or take a
        # CPU index its ops accept (``take`` becomes ``x.flatten()[index]``)
        hostexec.op_device(backend, op, plan_for(op), args, kwargs)
        try:
            if not stats.ENABLED:
                return _run_decomposition(backend, op, d, args, kwargs)
            t0 = time.perf_counter()
            try:
                return _run_decomposition(backend, op, d, args, kwargs)
            finally:
                stats.add(name, "decomposed", args, kwargs, time.perf_counter() - t0)
        except Exception as e:
            # the decomposition was chosen on the overload's first call; a call its pieces
            # refuse is the kernel's to answer (its error class: ``aminmax`` over an empty
            # dim raises IndexError, the pieces RuntimeError), as the CPU kernel does
            # -- unless it may have written an argument the kernel also reads (an in-place
            # self, running statistics): run again, the op would apply twice
            plan = plan_for(op)
            if not _ENABLED or type(e).__module__.startswith("torchport") \
                    or not _has_cpu_kernel(op, "CPU") \
                    or set(plan.written_args) - set(plan.out_args):
                raise
    return run_cpu(backend, op, name, args, kwargs, forced)


def next_path(backend: DeviceBackend, op: Any, name: str, args: tuple, kwargs: dict,
              call: hooks.OpCall | None = None) -> Any:
    """No usable kernel: a decomposition into device kernels, else the CPU."""
    path, d, forced = _choose_path(backend, op, name, args, kwargs)
    if call is not None:
        call.path = f"{path} (declined)"
    return _run_path(backend, op, name, args, kwargs, d, forced)


def _run_decomposition(backend: DeviceBackend, op: Any, d: Callable[..., Any], args: tuple,
                       kwargs: dict) -> Any:
    """Run a decomposition; its result must land in the op's ``out=``/in-place arguments.

    Some ``.out`` decompositions (those wrapped to compute in a wider dtype) fill a
    converted copy of ``out`` and return a new tensor; copy it where the schema says. A
    functional op's result is a new tensor, as its kernels make it: one a decomposition
    gives as a view of an input (``take``'s ``flat[index]`` selects for a 0-dim index)
    is copied. Outputs to resize are resized first, as the meta kernel lays them out, with
    PyTorch's own warning (a Python reference's wrapper words it otherwise)."""
    plan = plan_for(op)
    if plan.write_args:  # the decompositions' out= wrapper would resize an input
        derive.check_outs_not_inputs_to_resize(op, args, kwargs)
    if plan.out_args:
        names = derive.out_names(op)
        outs = [kwargs[n] for n in names if isinstance(kwargs.get(n), torch.Tensor)]
        # the kernel's overlap checks: the pieces would write an out= over its own inputs
        derive.check_overlap(op, args, kwargs, outs,
                             [*args, *(v for k, v in kwargs.items() if k not in names)])
        for name, (shape, stride, _) in zip(names, derive.output_specs(op, args, kwargs),
                                            strict=False):
            out = kwargs.get(name)
            if isinstance(out, torch.Tensor) and tuple(out.shape) != shape:
                backend.resize_device_tensor(out, shape, stride)
    active = getattr(_DECOMPOSING, "ops", None)
    if active is None:
        active = _DECOMPOSING.ops = set()
    active.add(op)
    try:
        r = d(*args, **kwargs)
    finally:
        active.discard(op)
    if not plan.write_args:
        return r if plan.is_view else _unaliased(r, args, kwargs)
    if plan.num_returns == 1:
        return _land(r, plan.return_alias[0], plan.arg_names, args, kwargs)
    return tuple(_land(x, a, plan.arg_names, args, kwargs)
                 for x, a in zip(r, plan.return_alias, strict=True))


def _unaliased(r: Any, args: tuple, kwargs: dict) -> Any:
    """``r`` (a result or a tuple of them), each tensor in an input's storage copied."""
    outs = [r] if isinstance(r, torch.Tensor) else list(r) if isinstance(r, (tuple, list)) \
        else []
    if not any(isinstance(x, torch.Tensor) for x in outs):
        return r
    inputs = {tensors.storage_ptr(t) for t in hostexec._iter_tensors(args, kwargs)
              if t.layout == torch.strided and t.numel()}

    def fresh(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.layout == torch.strided and x.numel() \
                and tensors.storage_ptr(x) in inputs:
            return x.clone()
        return x
    if isinstance(r, torch.Tensor):
        return fresh(r)
    values = [fresh(x) for x in r]
    return type(r)(*values) if hasattr(r, "_fields") else type(r)(values)  # named tuples too


def _land(r: Any, alias: str | None, names: tuple[str, ...], args: tuple, kwargs: dict) -> Any:
    if alias is None or not isinstance(r, torch.Tensor):
        return r
    target = kwargs[alias] if alias in kwargs else args[names.index(alias)]
    if r is target:
        return target
    if target.shape != r.shape:
        target.resize_(r.shape)
    target.copy_(r)
    return target


def run_native_slow(backend: DeviceBackend, op: Any, route: Route, fn: Callable[..., Any],
                    args: tuple, kwargs: dict) -> Any:
    """A native kernel's call while ops are forced, recorded or intercepted, or the
    interpreter exits."""
    if hooks.ACTIVE and not hooks.busy():
        result = hooks.dispatch(
            op, route.name, "fallback" if route.forced else "native", args, kwargs,
            lambda call: _native(backend, op, route, fn, args, kwargs, call))
    else:
        result = _native(backend, op, route, fn, args, kwargs, None)
    return teardown.keep(result) if teardown.ACTIVE else result


def _native(backend: DeviceBackend, op: Any, route: Route, fn: Callable[..., Any], args: tuple,
            kwargs: dict, call: hooks.OpCall | None) -> Any:
    if route.forced:
        return run_cpu(backend, op, route.name, args, kwargs, forced=True)
    t0 = time.perf_counter()
    outer = stats.swap_subpath(None)  # the kernel notes its own sub-path
    try:
        result = fn(*args, **kwargs)
    except Decline:
        stats.swap_subpath(outer)
        if stats.ENABLED:
            stats.add_decline(route.name)
        return next_path(backend, op, route.name, args, kwargs, call)
    except BaseException:
        stats.swap_subpath(outer)
        raise
    sub = stats.swap_subpath(outer)
    if stats.ENABLED:
        stats.add(route.name, "native", args, kwargs, time.perf_counter() - t0,
                  sub or "kernel")
    return result


def _run_view(plan: Any, op: Any, args: tuple, kwargs: dict) -> Any:
    if stats.ENABLED:
        t0 = time.perf_counter()
        r = hostexec.run_view_op(op, args, kwargs)
        stats.add(plan.overload_name, "view", args, kwargs, time.perf_counter() - t0)
        return r
    return hostexec.run_view_op(op, args, kwargs)


def _intercepted(backend: DeviceBackend, op: Any, plan: Any, args: tuple, kwargs: dict) -> Any:
    """The fallback's call while a tool intercepts ops: the path is chosen first."""
    name = plan.overload_name
    if plan.is_view:
        return hooks.dispatch(op, name, "view", args, kwargs,
                              lambda call: _run_view(plan, op, args, kwargs))
    path, d, forced = _choose_path(backend, op, name, args, kwargs)
    return hooks.dispatch(op, name, path, args, kwargs,
                          lambda call: _run_path(backend, op, name, args, kwargs, d, forced))


def make_fallback(backend: DeviceBackend) -> Callable[..., Any]:
    """The boxed fallback registered for every op without a kernel."""
    load_env()
    hooks.load_env()

    def fallback(keyset: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        plan = plan_for(op)
        if hooks.ACTIVE and not hooks.busy():
            result = _intercepted(backend, op, plan, args, kwargs)
        elif plan.is_view:  # metadata only: PyTorch's own kernel, no CPU round trip
            result = _run_view(plan, op, args, kwargs) if stats.ENABLED \
                else hostexec.run_view_op(op, args, kwargs)
        else:
            result = next_path(backend, op, plan.overload_name, args, kwargs)
            if _DENSE is not None and _DENSE.in_cpp and op not in _LEARNT:
                _learn(op, plan)
        return teardown.keep(result) if teardown.ACTIVE else result
    return fallback



# ---- the learnt fallback in C++ ----------------------------------------------------
# Where the C++ host-op kernels compute (host-addressable memory, a synchronous runtime:
# native_hostops), the device's boxed fallback is C++'s while nothing intercepts ops: it
# serves the overloads learnt here with the host-op kernel (a warm fallback call without
# Python) and calls the Python fallback for everything else, which learns. While ops are
# forced, recorded or intercepted, and where C++ cannot serve, the Python fallback is the
# registration, as PyTorch's Python fallback calls it.
_LEARNT: set[Any] = set()  # overloads taught to C++ (or found unservable there)
# C++'s fallback and the host-op kernels' switch (torchport.ops.native_hostops, a layer above,
# connects itself as it is imported: connect_cpp); None until then, when only Python serves
_CPP: Any = None


def connect_cpp(controls: Any) -> None:
    """The module that installs, feeds and removes C++'s fallback (``install_fallback``,
    ``uninstall_fallback``, ``serve_fallback``, ``servable``, ``learn_fallback``,
    ``forget_fallback``): the host-op kernels' layer, which sits above this one."""
    global _CPP
    _CPP = controls


class _Registration:
    """A device dispatch key's boxed fallback: the Python one, or (the dense key) C++'s;
    ``routes``: overloads whose kernel for the key is the fallback too (ops PyTorch gives
    the device a composite kernel of, which CUDA never runs)."""

    def __init__(self, backend: DeviceBackend, fn: Callable[..., Any], key: str,
                 routes: Sequence[Any] = ()) -> None:
        self.backend = backend
        self.fn = fn
        self.key = key
        self.routes = list(routes)
        self.lib: torch.library.Library | None = None
        self.routes_lib: torch.library.Library | None = None
        self.in_cpp = False  # C++'s fallback is registered
        self.closed = False  # the exit fallback has replaced this one
        self.swapped = False  # C++'s has been registered once

    def python(self) -> None:
        """Register the Python fallback (in place of C++'s)."""
        if self.in_cpp:
            _CPP.uninstall_fallback()
            self.in_cpp = False
        if self.lib is None:
            # (the first one the backend's own; later ones, after C++'s, kept alike)
            self.lib = keep_past_exit(torch.library.Library("_", "IMPL")) if self.swapped \
                else self.backend.library("_")
            self.lib.fallback(self.fn, self.key, with_keyset=True)
        if self.routes and self.routes_lib is None:
            self.routes_lib = keep_past_exit(torch.library.Library("aten", "IMPL"))
            for op in self.routes:
                self.routes_lib.impl(plan_for(op).overload_name, _routed(self.fn, op),
                                     self.key, with_keyset=True)

    def cpp(self) -> bool:
        """Register C++'s fallback in place of the Python one; False where it cannot."""
        if self.in_cpp:
            return True
        if _CPP is None:
            self.python()
            return False
        self._drop_python()
        self.swapped = True
        self.in_cpp = _CPP.install_fallback(self.fn, self.routes)
        if not self.in_cpp:
            self.python()
        return self.in_cpp

    def _drop_python(self) -> None:
        for lib in (self.lib, self.routes_lib):
            if lib is not None:
                lib._destroy()
        self.lib = self.routes_lib = None

    def release(self) -> None:
        """Remove whichever is registered (the exit fallback takes the key)."""
        self.closed = True
        if self.in_cpp:
            _CPP.uninstall_fallback()
            self.in_cpp = False
        else:
            self._drop_python()


def _routed(fn: Callable[..., Any], op: Any) -> Callable[..., Any]:
    """The boxed fallback ``fn`` as the kernel of overload ``op``."""
    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        return fn(keyset, op, *args, **kwargs)
    return kernel


_DENSE: _Registration | None = None  # the PrivateUse1 fallback's


def serve_learnt(on: bool) -> None:
    """C++'s fallback serving the learnt overloads (``on``: the C++ host-op kernels compute
    and nothing intercepts ops), or the Python fallback registered. Called by
    :mod:`torchport.ops.native_hostops` when it switches."""
    reg = _DENSE
    if reg is None or reg.closed:
        return
    if _CPP is None:
        reg.python()
        return
    if on and reg.cpp():
        _CPP.serve_fallback(True)
        return
    _CPP.serve_fallback(False)
    reg.python()


def _learn(op: Any, plan: Any) -> None:
    """After a call of ``op`` the Python fallback ran on the CPU: let C++ serve its later
    calls where its path is the CPU's for every call (no decomposition was found for it,
    it is not forced, the fallback is on and has warned) and its schema is one the C++
    host-op kernels serve."""
    if teardown.ACTIVE or INTERCEPTING or not _ENABLED or not paths.takes_cpu(op) \
            or (_WARN and plan.overload_name not in _WARNED):
        return
    _LEARNT.add(op)
    if _CPP.servable(op):
        _CPP.learn_fallback(op)


def _forget_learnt() -> None:
    """The learnt overloads decide their paths in Python again (kernels, forced ops or
    the fallback's settings changed)."""
    _LEARNT.clear()
    if _CPP is not None:
        _CPP.forget_fallback()


paths.on_forget(_forget_learnt)


def register(backend: DeviceBackend, fn: Callable[..., Any], key: str,
             routes: Sequence[Any] = ()) -> None:
    """Register ``fn(keyset, op, *args, **kwargs)`` as the boxed fallback of dispatch key
    ``key`` (for the dense key, C++'s fallback calls it where C++ serves: see
    :func:`serve_learnt`), and as the kernel of the overloads ``routes`` for that key. From
    torchport's exit handler on, the C++ library's exit fallback calls it instead of
    PyTorch's registration, which imports ``torch`` to find an op it meets for the first
    time: an op first met in a finaliser during the interpreter's teardown would raise
    (native_exit_fallback.cpp)."""
    global _DENSE
    reg = _Registration(backend, fn, key, routes)
    reg.python()
    if key == "PrivateUse1":
        _DENSE = reg
    teardown.on_start(lambda: _native_at_exit(backend, reg, fn, key))


def _native_at_exit(backend: DeviceBackend, reg: _Registration,
                    fn: Callable[..., Any], key: str) -> None:
    install = native.python_function("torchport_exit_fallback_install",
                                     [ctypes.py_object, ctypes.py_object, ctypes.c_char_p],
                                     ctypes.c_int)
    if install is None:
        return
    reg.release()
    try:
        install(fn, torch.ops, key.encode())
    except RuntimeError:  # the Python registration again, as before
        backend.library("_").fallback(fn, key, with_keyset=True)
