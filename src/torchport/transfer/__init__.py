"""Run unmodified CUDA code on the torchport device (``torch_npu.contrib.transfer_to_npu``-style).

``import torchport.transfer`` (after, or before, the backend registers),
``TORCHPORT_TRANSFER=1`` or ``torchport run script.py`` turn it on: importing this package
*is* the switch (as ``import torch_npu.contrib.transfer_to_npu`` is), so every module in it
is part of transfer, and tools that must not switch it on (``torchport run``'s launcher,
the ``TORCHPORT_TRANSFER`` hook :mod:`torchport.transfer_env`) live outside it. CUDA code
names the GPU in many ways, most of them parsed in C++ where a Python backend cannot hook,
so transfer rewrites every *Python entry point* that receives a device before the value
reaches C++:

* ``torch.device`` is replaced by a class whose metaclass maps ``"cuda"`` to the
  device while ``isinstance(x, torch.device)`` still checks against the real C
  type (device objects keep pickling through :mod:`copyreg`); ``torch.Generator`` likewise,
  so ``Generator(device="cuda")`` is a device generator (:mod:`.mapping`);
* factory functions (every ``torch.*`` op whose schema has a ``device``
  argument), ``Tensor.to/new_*/cuda/is_cuda/pin_memory``, ``Module.to``,
  ``torch.set_default_device``, ``init_process_group`` (:mod:`.entry_points`) and
  autocast/GradScaler (:mod:`.amp`);
* ``torch.cuda.*`` forwards, at call time, to ``torch.<device>`` (so names that
  layers add later, e.g. streams, are found), with clear errors or one-time
  warnings for what has no equivalent (graphs, jiterator, nvtx, extensions); so do
  its submodules (``torch.cuda.random``, ``.memory``, ``.streams``, ...), whose
  names are the same objects as ``torch.cuda``'s (:mod:`.cuda_module`);
* a serialization package maps storages tagged ``cuda:N`` to ``<device>:N``
  (:mod:`.checkpoints`).

Every patch is recorded, so :func:`disable` restores the exact previous objects;
:func:`enable` is idempotent (:mod:`.patches`). CPU code is untouched: only the values
``"cuda"``, ``"cuda:N"`` and CUDA ``torch.device`` objects are rewritten.

Not mappable: ``tensor.device.type`` is computed in C++ and reports the real
device type (``"sim"``), never ``"cuda"``.
"""

from __future__ import annotations

from torchport import backend as _backend_mod
from torchport.transfer.mapping import map_device
from torchport.transfer.patches import disable, enable, is_enabled
from torchport.transfer.patches import requested as requested  # for transfer_env
from torchport.transfer.state import _S, TransferError

__all__ = ["TransferError", "disable", "enable", "is_enabled", "map_device"]

if _backend_mod._ACTIVE is not None:
    enable()
else:
    _S.requested = True
