"""What differs between the torch releases and builds torchport supports, in one place.

torchport runs on torch 2.13, 2.14 and 2.15, CPU and CUDA builds (docs/compatibility.md
lists every difference and how it is handled). Each difference is detected here from
the installed torch itself (an attribute, an op, a build flag), never from its version
number, so a release that backports a change, or a build that lacks a feature, takes
the right branch; the other layers ask this module instead of probing torch themselves.

A leaf (it imports torch and the standard library only), below every other layer.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator

import torch

#: ``(major, minor)`` of the installed torch: for messages and reports only, never a branch.
TORCH_VERSION: tuple[int, int] = tuple(  # type: ignore[assignment]
    int(p) for p in re.findall(r"\d+", torch.__version__)[:2])

#: The build: ``"cuda"``, ``"rocm"`` or ``"cpu"`` (the default Linux wheel is a CUDA one,
#: also on machines with no GPU).
BUILD: str = ("rocm" if getattr(torch.version, "hip", None) else
              "cuda" if torch.version.cuda else "cpu")

#: ``torch._C``'s broadcast, scatter and gather (``nn.DataParallel``'s copies): compiled
#: into CUDA and ROCm builds only, for CUDA devices only.
COMM_NAMES = ("_broadcast_coalesced", "_broadcast", "_broadcast_out", "_scatter",
              "_scatter_out", "_gather", "_gather_out")
#: Those this build has (none on a CPU build), as torch has them before any backend
#: registers (the C++ library loads with torch, so its functions are there at once).
BUILD_COMM: frozenset[str] = frozenset(n for n in COMM_NAMES if hasattr(torch._C, n))


def cuda_usable() -> bool:
    """A CUDA (or ROCm) device can run work here: a GPU build on a machine with a GPU and
    a driver. A CUDA build on a machine without one answers False, as a CPU build does."""
    return BUILD != "cpu" and torch.cuda.is_available()


def aten_overload(name: str) -> torch._ops.OpOverload | None:
    """ATen's ``base.overload`` (``"norm.Scalar"``; ``"exp"`` is ``exp.default``), or
    ``None`` where this torch lacks it: lists of ops name the ones later releases added
    (torch 2.14's ``linalg_matrix_sqrth``) and each release registers what it has."""
    base, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, base, None)
    if packet is None:
        return None
    try:
        return getattr(packet, overload or "default")
    except AttributeError:
        return None


@contextlib.contextmanager
def quiet_cuda_home() -> Iterator[None]:
    """Import ``torch.utils.cpp_extension`` without its warning that a CUDA build on a
    machine without the CUDA toolkit finds "No CUDA runtime" (torchport compiles C++
    for the CPU only: the warning would mislead)."""
    log = logging.getLogger("torch.utils.cpp_extension")
    level = log.level
    if BUILD != "cpu":
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def build_summary() -> str:
    """The build in words, for ``torchport info``: ``"CPU build"``, ``"CUDA 13.0 build, no
    usable GPU"``."""
    if BUILD == "cpu":
        return "CPU build"
    version = torch.version.cuda if BUILD == "cuda" else torch.version.hip
    usable = "GPU usable" if cuda_usable() else "no usable GPU"
    return f"{'CUDA' if BUILD == 'cuda' else 'ROCm'} {version} build, {usable}"
