"""What the migration tool knows about CUDA APIs, in one place.

The rewriter consults these tables to decide whether a CUDA reference can be
renamed to the backend (``torch.cuda.X`` -> ``torch.sim.X``), must be left
alone and reported as *unsupported*, is harmless but has *no effect* on the
backend, or is *unknown* (renamed, but torch.<backend> is not known to provide
it).  Keeping the lists here means a backend author only has one file to edit
when the ``torch.sim`` mirror grows.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Literal

FindingKind = Literal["unsupported", "unknown", "no-effect"]

#: Names that ``torch.<backend>`` (the ``torch.cuda`` mirror registered by a
#: torchport backend) is known to provide.  ``torch.cuda.<name>`` for any of
#: these is renamed silently; any other ``torch.cuda.<name>`` is renamed too but
#: reported as "unknown" so a human checks it.
TORCH_BACKEND_MIRROR_APIS: frozenset[str] = frozenset(
    {
        "is_available",
        "device_count",
        "current_device",
        "set_device",
        "device",
        "device_of",
        "get_device_name",
        "get_device_properties",
        "get_device_capability",
        "synchronize",
        "memory_allocated",
        "max_memory_allocated",
        "memory_reserved",
        "max_memory_reserved",
        "memory_stats",
        "memory_summary",
        "reset_peak_memory_stats",
        "empty_cache",
        "mem_get_info",
        "set_per_process_memory_fraction",
        "manual_seed",
        "manual_seed_all",
        "seed",
        "seed_all",
        "initial_seed",
        "get_rng_state",
        "get_rng_state_all",
        "set_rng_state",
        "set_rng_state_all",
        "Stream",
        "Event",
        "current_stream",
        "default_stream",
        "set_stream",
        "stream",
        "amp",
        "is_bf16_supported",
        "get_amp_supported_dtype",
        "reset_max_memory_allocated",
        "ipc_collect",
        "is_initialized",
        "init",
    }
)

#: ``torch.cuda.<name>`` with no backend equivalent: never rewritten, reported.
UNSUPPORTED_CUDA_APIS: dict[str, str] = {
    "graph": "CUDA graphs have no equivalent on this backend",
    "graphs": "CUDA graphs have no equivalent on this backend",
    "CUDAGraph": "CUDA graphs have no equivalent on this backend",
    "make_graphed_callables": "CUDA graphs have no equivalent on this backend",
    "graph_pool_handle": "CUDA graphs have no equivalent on this backend",
    "jiterator": "torch.cuda.jiterator compiles CUDA C++ at runtime",
    "nvtx": "NVTX ranges are NVIDIA profiler markers; use torch.profiler.record_function",
    "comm": "torch.cuda.comm is CUDA-specific; use torch.distributed collectives",
    "nccl": "torch.cuda.nccl is CUDA-specific; use torch.distributed collectives",
}

#: Qualified-name prefixes of torch APIs reported wherever they are used.
#: Longest matching prefix wins.
TORCH_API_FINDINGS: dict[str, tuple[FindingKind, str]] = {
    "torch.cuda.amp.common": (
        "unsupported",
        "torch.cuda.amp.common only checks CUDA availability",
    ),
    "torch.cuda.amp.amp_definitely_not_available": (
        "unsupported",
        "only checks CUDA availability; use torch.<backend>.is_available()",
    ),
    "torch.backends.cudnn": (
        "no-effect",
        "cuDNN flags are accepted but have no effect on this backend",
    ),
    "torch.backends.cuda": (
        "no-effect",
        "CUDA backend flags (e.g. matmul.allow_tf32) have no effect on this backend",
    ),
    "torch.utils.cpp_extension.CUDAExtension": (
        "unsupported",
        "CUDAExtension builds CUDA kernels; port the kernels to the backend",
    ),
    "torch.utils.cpp_extension.CUDA_HOME": (
        "unsupported",
        "CUDA_HOME refers to a CUDA toolkit installation",
    ),
    "torch.distributed.Backend.NCCL": (
        "unsupported",
        "NCCL constant; pass the backend's collective library name as a string instead",
    ),
    "torch.distributed.is_nccl_available": (
        "unsupported",
        "NCCL-specific check; use torch.distributed.is_backend_available(<name>)",
    ),
    "torch.backends.cudnn.is_available": (
        "unsupported",
        "answers for cuDNN: False on this backend, so code branching on it takes the "
        "non-GPU path",
    ),
    "torch.backends.cudnn.version": (
        "unsupported",
        "the cuDNN version: None on this backend",
    ),
    "torch.backends.cuda.is_built": (
        "unsupported",
        "answers for CUDA: False on this backend, so code branching on it takes the "
        "non-GPU path",
    ),
    "torch.version.cuda": (
        "unsupported",
        "the CUDA toolkit version: None without CUDA, so code branching on it takes the "
        "non-GPU path",
    ),
    "torch.profiler.ProfilerActivity.CUDA": (
        "no-effect",
        "records CUDA kernels; there are none on this backend",
    ),
    "torch.autograd.ProfilerActivity.CUDA": (
        "no-effect",
        "records CUDA kernels; there are none on this backend",
    ),
}

#: Libraries that choose their device themselves, from fixed lists of vendors, and what
#: makes them choose the backend's device ("{device}" is its name). They find the device
#: only once the backend is registered, so a module importing one gets the backend import
#: even where it names no CUDA API (a Trainer script need not mention the GPU at all).
DEVICE_CHOOSING_LIBRARIES: dict[str, str] = {
    "transformers": "Trainer/TrainingArguments choose {device}:0 as they choose a GPU, "
                    "with bf16/fp16 (torchport.integrations.huggingface)",
    "accelerate": "Accelerator() chooses {device} as it chooses a GPU, with bf16/fp16 and "
                  "the device's GradScaler (torchport.integrations.huggingface)",
    "trl": "its trainers are transformers Trainers: they choose {device}:0 "
           "(torchport.integrations.huggingface)",
    "lightning": "Trainer(accelerator=\"{device}\") trains on the device; \"gpu\" and "
                 "\"auto\" choose it too (torchport.integrations.lightning)",
    "pytorch_lightning": "Trainer(accelerator=\"{device}\") trains on the device; \"gpu\" "
                         "and \"auto\" choose it too (torchport.integrations.lightning)",
}


#: Third-party CUDA-only libraries, reported where they are imported.
UNSUPPORTED_MODULES: dict[str, str] = {
    "cupy": "CuPy is a CUDA-only array library",
    "cupyx": "CuPy is a CUDA-only array library",
    "pynvml": "NVML queries NVIDIA drivers",
    "nvidia_smi": "NVML queries NVIDIA drivers",
    "pycuda": "PyCUDA is CUDA-only",
    "numba.cuda": "numba.cuda compiles CUDA kernels",
    "apex": "NVIDIA apex is CUDA-only; use torch.amp / torch.nn.parallel instead",
    "tensorrt": "TensorRT is NVIDIA-only",
    "torch_tensorrt": "TensorRT is NVIDIA-only",
}

#: Environment variables that only steer the CUDA runtime.
NO_EFFECT_ENV_VARS: dict[str, str] = {
    "CUDA_VISIBLE_DEVICES": "CUDA_VISIBLE_DEVICES does not select devices of this backend",
    "CUDA_LAUNCH_BLOCKING": "CUDA_LAUNCH_BLOCKING does not affect this backend",
}

#: Families of environment variables read by CUDA, its libraries or NCCL (by prefix),
#: reported wherever their name is spelled; the longest prefix wins.
CUDA_ENV_PREFIXES: dict[str, str] = {
    "CUDA_": "read by the CUDA runtime or toolkit; no effect on this backend",
    "NCCL_": "configures NCCL; the backend's collective library does not read it",
    "TORCH_NCCL_": "configures PyTorch's NCCL process group; the backend's collective "
                   "library does not read it",
    "PYTORCH_CUDA_": "configures PyTorch's CUDA allocator; no effect on this backend",
    "PYTORCH_NVML_": "NVML (NVIDIA driver) setting; no effect on this backend",
    "TORCH_CUDA_": "selects CUDA architectures for extension builds",
    "TORCH_CUDNN_": "cuDNN setting; no effect on this backend",
    "CUBLAS_": "configures cuBLAS; no effect on this backend",
    "CUBLASLT_": "configures cuBLASLt; no effect on this backend",
    "CUDNN_": "configures cuDNN; no effect on this backend",
    "NVIDIA_": "read by NVIDIA's container runtime or drivers; no effect on this backend",
}

_ENV_NAME_RE = re.compile(r"[A-Z][A-Z0-9]*(_[A-Z0-9]+)+")


def classify_env_var(name: str) -> tuple[FindingKind, str] | None:
    """A finding for a string spelling a CUDA/NCCL environment variable, else ``None``."""
    if name in NO_EFFECT_ENV_VARS:
        return "no-effect", NO_EFFECT_ENV_VARS[name]
    if not _ENV_NAME_RE.fullmatch(name):
        return None
    prefix = max((p for p in CUDA_ENV_PREFIXES if name.startswith(p)), key=len, default=None)
    return None if prefix is None else ("no-effect", CUDA_ENV_PREFIXES[prefix])


#: APIs that pick the device at run time (the current accelerator): a script using them
#: needs the backend imported even when nothing in it names CUDA.
DEVICE_GENERIC_APIS: frozenset[str] = frozenset({"torch.accelerator", "torch.get_device_module"})

#: GradScaler spellings whose ``device`` argument defaults to ``"cuda"``.
GRAD_SCALERS: frozenset[str] = frozenset(
    {"torch.amp.GradScaler", "torch.amp.grad_scaler.GradScaler", "torch.GradScaler"}
)

#: ``torch.cuda.amp`` callables the rewriter moves to ``torch.amp`` and how:
#: "device-arg" inserts the device type as first positional argument,
#: "device-kw" adds ``device_type=`` (the torch.amp decorators require it).
AMP_CALLABLES: dict[str, Literal["autocast", "device-arg", "device-kw"]] = {
    "autocast": "autocast",
    "GradScaler": "device-arg",
    "custom_fwd": "device-kw",
    "custom_bwd": "device-kw",
}

#: Calls whose first positional argument is a device (``torch.device("cuda")``...).
DEVICE_FIRST_ARG_CALLS: frozenset[str] = frozenset(
    {
        "torch.device",
        "torch.autocast",
        "torch.amp.autocast",
        "torch.amp.autocast_mode.autocast",
        "torch.amp.GradScaler",
        "torch.amp.grad_scaler.GradScaler",
        "torch.GradScaler",
        "torch.amp.is_autocast_available",
        "torch.set_default_device",
        "torch.get_autocast_dtype",
        "torch.set_autocast_dtype",
        "torch.is_autocast_enabled",
        "torch.set_autocast_enabled",
        "torch.get_device_module",
        "torch.Generator",
        "torch.Stream",
        "torch.Event",
    }
)

#: torch.utils.cpp_extension entry points that compile sources (reported when given .cu files).
CPP_EXTENSION_LOADERS: frozenset[str] = frozenset(
    {"torch.utils.cpp_extension.load", "torch.utils.cpp_extension.load_inline"}
)

#: Positional order of ``torch.cuda.amp.autocast``; torch.amp.autocast puts
#: ``device_type`` first and orders the rest differently, so positional
#: arguments are turned into keywords.
CUDA_AUTOCAST_POSITIONAL: tuple[str, ...] = ("enabled", "dtype", "cache_enabled")


def _longest_prefix(qname: str, table: Mapping[str, object]) -> str | None:
    best: str | None = None
    for prefix in table:
        if (qname == prefix or qname.startswith(prefix + ".")) and (
            best is None or len(prefix) > len(best)
        ):
            best = prefix
    return best


def classify_torch_api(qname: str) -> tuple[FindingKind, str] | None:
    """Classify a fully qualified torch name; ``None`` means nothing to report.

    ``torch.cuda.amp`` is handled by dedicated rewrite rules (it is in the mirror
    list), so only its CUDA-only corner ``torch.cuda.amp.common`` is a finding.
    """
    prefix = _longest_prefix(qname, TORCH_API_FINDINGS)
    if prefix is not None:
        return TORCH_API_FINDINGS[prefix]
    parts = qname.split(".")
    if parts[:2] == ["torch", "cuda"] and len(parts) >= 3:
        name = parts[2]
        if name in UNSUPPORTED_CUDA_APIS:
            return "unsupported", UNSUPPORTED_CUDA_APIS[name]
        if name in TORCH_BACKEND_MIRROR_APIS:
            return None
        return (
            "unknown",
            f"torch.cuda.{name} is not in the list of APIs the backend mirror is known "
            "to provide; it was renamed, check that it exists",
        )
    return None


def classify_module(qname: str) -> str | None:
    """Reason why importing ``qname`` is unsupported, or ``None``."""
    prefix = _longest_prefix(qname, UNSUPPORTED_MODULES)
    return None if prefix is None else UNSUPPORTED_MODULES[prefix]


def is_unsupported(qname: str) -> bool:
    """True when a reference to ``qname`` must be left as is (no equivalent)."""
    result = classify_torch_api(qname)
    return result is not None and result[0] == "unsupported"
