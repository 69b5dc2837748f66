"""Every ``TORCHPORT_*`` environment variable: name, default, type, meaning, and who reads it.

The one place a setting is declared. ``torchport info`` and docs/configuration.md are
built from :data:`SETTINGS`, and every module reads its variables through :func:`get`,
which parses the text in the environment at call time (a module that needs a setting
on a hot path reads it once and keeps the value, as :mod:`torchport.ops.fallback`
does). A bad value raises :class:`SettingError` naming the variable, the value and
what is allowed.

A leaf module (standard library only), so any layer can import it without cycles.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class SettingError(ValueError):
    """A ``TORCHPORT_*`` variable holds a value its type does not allow."""


# ---- parsers: text -> value, ValueError where the text is not one -----------------------
_FLAGS = {"1": True, "true": True, "yes": True, "on": True,
          "0": False, "false": False, "no": False, "off": False}


def parse_flag(text: str) -> bool:
    """``"1"``/``"0"`` (also ``true``/``false``, ``yes``/``no``, ``on``/``off``)."""
    v = _FLAGS.get(text.strip().lower())
    if v is None:
        raise ValueError(f"{text!r} is not a flag; use 0 or 1")
    return v


def parse_count(text: str) -> int:
    """A whole number >= 0."""
    if not text.strip().isdigit():
        raise ValueError(f"{text!r} is not a whole number")
    return int(text)


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4,
          "tb": 1000**4, "tib": 1024**4}


def parse_size(text: str) -> int:
    """``"512MiB"``, ``"8GiB"``, ``"1.5GB"`` (powers of 1000) or a plain byte count."""
    m = _SIZE_RE.match(text)
    if not m or (m.group(2) or "").lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size; use e.g. 512MiB, 8GiB or 1073741824")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def parse_bytes(text: str) -> int:
    """``"1048576"``, ``"64KiB"``, ``"1MB"``, ``"2GiB"`` -> bytes; K, M, G, T are powers
    of 1024 with or without the ``i`` (unlike :func:`parse_size`)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"bad byte count {text!r}")
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2).upper()]
    return int(float(m.group(1)) * scale)


def parse_list(text: str) -> list[str]:
    """``"add.out, .*\\.Scalar"`` -> ``["add.out", ".*\\.Scalar"]`` (empty items dropped)."""
    return [p.strip() for p in text.split(",") if p.strip()]


def parse_range(text: str | None) -> tuple[int, int | None]:
    """``"100:200"`` -> (100, 200); ``"100:"`` -> (100, None); ``":50"`` -> (0, 50)."""
    if not text or not text.strip():
        return 0, None
    a, sep, b = text.partition(":")
    if not sep:
        raise ValueError(f"TORCHPORT_DUMP_RANGE: expected start:end, got {text!r}")
    return (int(a) if a.strip() else 0), (int(b) if b.strip() else None)


@dataclass(frozen=True)
class Kind:
    """A setting's type: its parser and, for errors, what a valid value is."""

    parse: Callable[[str], Any]
    what: str  # "is not <what>"
    allowed: str  # "use <allowed>"


KINDS: dict[str, Kind] = {
    "flag": Kind(parse_flag, "a flag", "0 or 1 (or true/false, yes/no, on/off)"),
    "count": Kind(parse_count, "a whole number", "a whole number >= 0"),
    "size": Kind(parse_size, "a size", "e.g. 512MiB, 8GiB or 1073741824"),
    "bytes": Kind(parse_bytes, "a byte count", "e.g. 1048576, 64KiB or 1MB (K, M, G = 1024^n)"),
    "str": Kind(str, "text", "any text"),
    "list": Kind(parse_list, "a comma list", "comma-separated items"),
    "range": Kind(parse_range, "a call range", "start:end, e.g. 100:200, 100: or :50"),
}

SCOPES = ("user", "backend", "test")  # backend: read by the sim backend's runtime


@dataclass(frozen=True)
class Setting:
    """One ``TORCHPORT_*`` variable."""

    name: str
    kind: str  # a key of KINDS
    default: str | None  # the text an unset variable stands for; None: unset means off/all
    meaning: str  # one line, for ``torchport info``
    doc: str = ""  # Markdown for docs/configuration.md (default: ``meaning``)
    scope: str = "user"  # one of SCOPES
    shown_default: str = ""  # the default as docs/configuration.md shows it
    what: str = ""  # overrides the kind's texts in the error message
    allowed: str = ""
    keep_empty: bool = False  # an empty value is a value (else it means the default)

    @property
    def documented_default(self) -> str:
        return self.shown_default or ("none" if self.default is None else f"`{self.default}`")

    @property
    def description(self) -> str:
        return self.doc or self.meaning

    def parse(self, text: str) -> Any:
        """``text`` as this setting's value; :class:`SettingError` where it is not one."""
        kind = KINDS[self.kind]
        try:
            return kind.parse(text)
        except ValueError:
            raise SettingError(f"{self.name}={text!r} is not {self.what or kind.what}; use "
                               f"{self.allowed or kind.allowed}") from None


_DECLARED = [
    Setting("TORCHPORT_BACKEND", "str", "sim", "backend for torchport run/coverage/info",
            "backend for `torchport run` / `coverage` / `info`"),
    Setting("TORCHPORT_SIM_DEVICES", "count", "2", "number of sim devices",
            "number of sim devices", scope="backend", what="a device count",
            allowed="a whole number such as 2"),
    Setting("TORCHPORT_SIM_MEMORY", "size", "8GiB", "memory per sim device",
            "memory per sim device (`512MiB`, `8GiB`, bytes)", scope="backend"),
    Setting("TORCHPORT_SIM_STRICT", "flag", "0", "1: device-only sim memory",
            "`1`: device-only memory (fake addresses, runtime copies only)", scope="backend"),
    Setting("TORCHPORT_SIM_ASYNC", "flag", "0", "1: sim streams run work on worker threads",
            "`1`: sim streams run runtime work on worker threads (see "
            "[streams](streams-rng-amp.md))", scope="backend"),
    Setting("TORCHPORT_OPENCL_PLATFORM", "str", None, "OpenCL platform of the ocl backend",
            "OpenCL platform the `ocl` backend (`import torchport.opencl`) uses: an index into "
            "pyopencl's platform list or a part of the platform's name (`Portable`, `NVIDIA`); "
            "unset: the first platform that lists a device", scope="backend"),
    Setting("TORCHPORT_OPENCL_DEVICES", "list", None, "OpenCL devices of the ocl backend",
            "comma list of device indices of that platform the `ocl` backend uses (unset: all)",
            scope="backend", allowed="comma-separated device indices such as 0,1"),
    Setting("TORCHPORT_LAUNCH_BLOCKING", "flag", "0", "1: every launch synchronous",
            "`1`: every launch synchronous (debugging)"),
    Setting("TORCHPORT_TRANSFER", "flag", "0", "1: run CUDA code on the device",
            "`1`: run CUDA code on the device (see [Running CUDA code unchanged]"
            "(cuda-code.md))"),
    Setting("TORCHPORT_AUTOLOAD", "str", None,
            "backend that import torch registers (set by torchport run)",
            "backend (as `--backend`) that every `import torch` registers, through PyTorch's "
            "device-backend autoload; `torchport run` exports it with `TORCHPORT_TRANSFER=1`, "
            "so processes the script starts (`torch.multiprocessing.spawn`, `multiprocessing`, "
            "`subprocess`) run on the device too (`TORCH_DEVICE_BACKEND_AUTOLOAD=0` turns "
            "autoload off)"),
    Setting("TORCHPORT_COVERAGE_CHILDREN", "str", None,
            "where child processes write op coverage (set by torchport coverage)"),
    Setting("TORCHPORT_UPSTREAM_DEVICE", "str", None,
            "the device a pytest process of torchport conformance --upstream tests (set by it)"),
    Setting("TORCHPORT_UPSTREAM_RESULTS", "str", None,
            "where a pytest process of torchport conformance --upstream writes its results "
            "(set by it)"),
    Setting("TORCHPORT_VISIBLE_DEVICES", "str", None, "devices to use (default: all)",
            "comma list of physical devices to use, renumbered from 0 (like "
            "`CUDA_VISIBLE_DEVICES`)", shown_default="all", keep_empty=True),
    Setting("TORCHPORT_HF_INTEGRATION", "flag", "1",
            "0: leave accelerate/transformers' device choice alone",
            "`0`: leave Hugging Face accelerate and transformers alone (see [Hugging Face "
            "Trainer and accelerate](cuda-code.md)); by default they choose the device as a "
            "GPU"),
    Setting("TORCHPORT_LIGHTNING_INTEGRATION", "flag", "1",
            "0: no Lightning accelerator for the device",
            "`0`: leave PyTorch Lightning alone (see [Integrations](integrations.md)); by "
            "default `Trainer(accelerator=\"<device>\")` trains on the device and `\"gpu\"`/"
            "`\"auto\"` choose it"),
    Setting("TORCHPORT_FALLBACK", "flag", "1",
            "0: ops without a kernel raise instead of running on CPU",
            "`0`: an op with no kernel raises `NotImplementedError` (naming op and dtypes) "
            "instead of running on the CPU"),
    Setting("TORCHPORT_FALLBACK_WARN", "flag", "1", "0: no warning when an op falls back",
            "`0`: no `FallbackWarning` (one per op) when an op first falls back"),
    Setting("TORCHPORT_FORCE_FALLBACK_OPS", "list", None, "regexes of overloads forced to the CPU",
            "comma-separated regexes matched in full against overload names (`add.out`, "
            "`.*\\.Scalar`, `addmm` or `addmm.default`): those ops run on the CPU"),
    Setting("TORCHPORT_OP_STATS", "flag", "0", "1: print op statistics at exit",
            "`1`: record op statistics for the whole process, print the table at exit"),
    Setting("TORCHPORT_NATIVE", "flag", "1", "0: no C++ device layer (Python stand-ins)",
            "`0`: no C++ library: view ops run the Python view kernels instead of PyTorch's "
            "C++ ones, and PyTorch's Python stand-ins replace the C++ device layer: the device "
            "guard resolves an index-less device name to 0 and has no streams or events "
            "(`torch.Stream`, `torch.Event`, `torch.accelerator.synchronize`), there is no "
            "`torch.Generator(device=...)`, `pin_memory()` returns unpinned copies (one "
            "warning), `torch.accelerator`'s memory API and profiler device time are "
            "unavailable, and autograd runs backward in the calling thread (see "
            "[Limitations](limitations.md))"),
    Setting("TORCHPORT_CACHE_DIR", "str", None, "the C++ library's build folder",
            "where the C++ library (view kernels and the device layer: guard, hooks, "
            "generators, allocator, profiler) is compiled, once per source, torch and Python "
            "version", shown_default="`~/.cache/torchport`"),
    Setting("TORCHPORT_AUTOCOMPARE", "list", None, "op regexes checked against CPU (autocompare)",
            "op regexes (same rules) checked against the CPU on every call (see [porting "
            "tools](porting-tools.md))"),
    Setting("TORCHPORT_AUTOCOMPARE_RAISE", "flag", "0", "1: autocompare mismatches raise",
            "`1`: the first autocompare mismatch raises"),
    Setting("TORCHPORT_DUMP_OPS", "count", "0", "op dump level 0-3",
            "`1`-`3`: print each device op (path; + argument metadata; + values) to stderr",
            what="a dump level", allowed="0, 1, 2 or 3"),
    Setting("TORCHPORT_DUMP_DIR", "str", None, "directory for op dumps",
            "write each op call's inputs/outputs (safetensors) and `manifest.jsonl` there"),
    Setting("TORCHPORT_DUMP_FILTER", "list", None, "op regexes to dump",
            "dump only these ops (op regexes)", shown_default="all"),
    Setting("TORCHPORT_DUMP_RANGE", "range", None, "start:end call range to dump",
            "dump only call indices `start:end`", shown_default="all"),
    Setting("TORCHPORT_DUMP_MAX_BYTES", "bytes", None, "largest tensor saved in a dump",
            "dump tensors up to this size (larger: statistics only)", shown_default="all"),
    Setting("TORCHPORT_DUMP_CPU", "flag", "0", "1: dump the CPU reference too",
            "`1`: dump the ATen ops of a CPU run in the same format (the reference)"),
    # Read by the test suite, not by torchport: `torchport info` lists them when set.
    Setting("TORCHPORT_FULL_MODELS", "flag", "0",
            "1: tests/test_models_hf.py runs all 29 architectures",
            "`1`: `tests/test_models_hf.py` runs all 29 architectures (`make conformance`), "
            "not its seven", scope="test"),
    Setting("TORCHPORT_FULL_SCRIPTS", "flag", "0",
            "1: tests/test_real_scripts.py runs every script every way",
            "`1`: `tests/test_real_scripts.py` runs every script every way (`make examples`), "
            "not its subset", scope="test"),
    Setting("TORCHPORT_FULL_ZOO", "flag", "0",
            "1: tests/test_zoo.py runs every zoo case both ways",
            "`1`: `tests/test_zoo.py` runs every case of `examples/zoo/` unchanged and migrated "
            "(`make zoo`), not its subset", scope="test"),
    Setting("TORCHPORT_ZOO_REPORT", "str", None, "file the zoo's step times go to",
            "`tests/test_zoo.py` appends each run's step time and the CPU's to this JSON-lines "
            "file (`make zoo`: `reports/zoo.jsonl`)", scope="test", shown_default="none"),
    Setting("TORCHPORT_TEST_BACKEND", "str", "sim",
            "backend the HF, zoo and Lightning tests run on",
            "backend (as `--backend`: `sim`, a `torchport.backends` name or a module path) that "
            "`tests/test_models_hf.py`, `tests/test_zoo.py` and "
            "`tests/test_integrations_lightning.py` run against; on any other than `sim` they "
            "compare within the dtype's default tolerances (its kernels round otherwise) and "
            "run under `pytest --noconftest` (`tests/conftest.py` registers `sim`; "
            "`make test-vendor`)", scope="test"),
]

#: name -> setting, in the order ``torchport info`` and docs/configuration.md list them.
SETTINGS: dict[str, Setting] = {s.name: s for s in _DECLARED}
_DEFAULTS: dict[str, Any] = {s.name: None if s.default is None else s.parse(s.default)
                             for s in _DECLARED}


def _declared(name: str) -> Setting:
    s = SETTINGS.get(name)
    if s is None:
        raise KeyError(f"{name} is not a torchport setting; declare it in "
                       f"src/torchport/core/settings.py")
    return s


def get(name: str) -> Any:
    """The value of setting ``name`` now: parsed from the environment, else its default
    (``None`` for a setting that is off/all when unset). An empty value means the default
    unless the setting keeps it (``TORCHPORT_VISIBLE_DEVICES=`` hides every device)."""
    s = _declared(name)
    text = os.environ.get(name)
    if text is None or (not s.keep_empty and not text.strip()):
        return _DEFAULTS[name]
    return s.parse(text)


def raw(name: str, default: str | None = None) -> str | None:
    """The text of setting ``name`` in the environment, unparsed (for messages)."""
    _declared(name)
    return os.environ.get(name, default)

