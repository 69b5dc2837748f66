"""Offline migration of CUDA PyTorch code to a torchport backend (``torchport migrate``).

Rewrites with a concrete syntax tree (libcst) so formatting and comments
survive and ``"cuda"`` is only changed where it names a device.  This package
never imports torch: the tool must run where the backend (or even a working
torch) is not installed.

Rules (backend ``sim``; another ``NAME`` gives ``torch.NAME``, ``"NAME:1"``,
``"NAMEccl"``):

* ``import torchport.sim`` is added after the first top-level ``import torch``
  (before an earlier statement that already needs the backend; at the top,
  after the docstring and ``__future__`` imports, when torch is only imported
  with ``from torch import ...``), once, with ``# noqa: F401`` so linters do
  not delete it, to the files that were changed for the device, that use
  ``torch.accelerator``, or that are scripts (``if __name__ == "__main__":``)
  importing torch (their device may come from the command line or a library).
  Other files (a CPU-only helper module) are left byte-identical.
* ``torch.cuda.X`` -> ``torch.sim.X`` in attribute chains (through any alias
  of ``torch``) and imports (``import torch.cuda as tc`` -> ``import torch.sim
  as tc``, ``from torch.cuda import X`` -> ``from torch.sim import X``,
  ``from torch import cuda`` -> ``from torch import sim as cuda``).
* ``torch.cuda.amp``: we chose upstream's device-generic ``torch.amp``:
  ``torch.cuda.amp.autocast(...)`` -> ``torch.amp.autocast("sim", ...)``
  (positional ``enabled, dtype, cache_enabled`` become keywords),
  ``GradScaler(...)`` -> ``torch.amp.GradScaler("sim", ...)``,
  ``custom_fwd``/``custom_bwd`` get ``device_type="sim"``; imports from
  ``torch.cuda.amp`` move to ``torch.amp``.  References that are not calls
  (``ctx = torch.cuda.amp.autocast``) or calls with ``*args`` keep CUDA's
  signature via the mirror ``torch.sim.amp``.
* ``x.cuda()`` -> ``x.to("sim")``, ``.cuda(1)`` -> ``.to("sim:1")``; a
  variable argument proven an int (``int(...)``, ``rank: int``, an argparse
  ``type=int`` option) -> ``.to(f"sim:{rank}")``, proven not None (a
  ``torch.device``, a string, a guard ``if x is not None:``) -> ``.to(x)``,
  else ``.to("sim" if x is None else x)`` (``.cuda(None)`` is the current
  device); other arguments kept.
* ``"cuda"``/``"cuda:N"`` (also f-strings, ``%``/``.format``/``+`` templates,
  both arms of ``a if c else b``) in device positions: ``torch.device``,
  ``device=``/``*_device=``/``device_type=`` keywords, ``.to(...)``,
  ``map_location`` (strings, dict keys/values, lambda bodies), ``torch.load``'s
  2nd argument, ``torch.autocast``/``torch.amp.*`` first argument, comparisons
  with ``x.device.type``/``*device*``/a name holding a device string,
  assignments to and parameters named ``*device*``, ``{"device": ...}``
  entries, argparse ``--device`` defaults.  Outside them only what is a device
  string in practice (exactly ``"cuda"``/``"cuda:N"``, ``f"cuda:{i}"``,
  ``"cuda:%d" % i``...) and only as a value: of any assignment
  (``dev = "cuda"``, ``args.accel = "cuda"``), ``return``, default, keyword
  argument, dict value, ``for`` iterable.  Log messages and dict keys are left;
  an exact ``"cuda"`` left anywhere is reported.
* ``torch.amp.GradScaler()`` (device ``"cuda"`` by default) gets ``"sim"``.
* ``"nccl"`` -> ``"simccl"`` in ``init_process_group``, ``backend=`` and
  ``*backend*`` assignments/comparisons (``"cpu:gloo,cuda:nccl"`` too).
* ``x.is_cuda`` -> ``x.is_sim``.
* Reported, not rewritten: unsupported APIs (CUDA graphs, jiterator, nvtx,
  comm, nccl, CUDA extensions and ``.cu`` sources, cupy/pynvml/numba.cuda/...,
  ``torch.version.cuda``, cuDNN availability checks, ``.cuda`` methods
  referenced or defined, CUDA tensor type names, ``"cuda"``/``"nccl"``
  strings left unchanged), "no effect" flags (``torch.backends.cudnn``/
  ``torch.backends.cuda``, ``ProfilerActivity.CUDA``, CUDA/NCCL/cuBLAS
  environment variables such as ``CUDA_VISIBLE_DEVICES``, ``NCCL_DEBUG``,
  ``PYTORCH_CUDA_ALLOC_CONF``).  ``torch.cuda.X`` not in
  :data:`TORCH_BACKEND_MIRROR_APIS` is renamed and reported as "unknown".
"""

from __future__ import annotations

from torchport.tools.migrate.apis import TORCH_BACKEND_MIRROR_APIS, UNSUPPORTED_CUDA_APIS
from torchport.tools.migrate.model import (
    Backend,
    BackendSpecError,
    Change,
    Failure,
    Finding,
    MigrationResult,
    Skipped,
)
from torchport.tools.migrate.rewriter import SourceResult, migrate_source, rewrite_source
from torchport.tools.migrate.tree import MigrationError, migrate_path

__all__ = [
    "TORCH_BACKEND_MIRROR_APIS",
    "UNSUPPORTED_CUDA_APIS",
    "Backend",
    "BackendSpecError",
    "Change",
    "Failure",
    "Finding",
    "MigrationError",
    "MigrationResult",
    "Skipped",
    "SourceResult",
    "migrate_path",
    "migrate_source",
    "rewrite_source",
]
