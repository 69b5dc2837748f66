"""The compiled program's side of ``ocl``'s inductor kernels: :class:`OpenCLProgram`, what the
program inductor generates calls with its tensors.

Apart from the code generator (:mod:`.inductor_kernel`, :mod:`.inductor_exprs`) because it
runs when a compiled program loads and runs, not when a graph is compiled: it builds the
kernel's OpenCL C per device, with the helpers (``tp_floordiv``, ``tp_mod``,
``tp_round_half``) the generated C calls, finds each tensor's ``(cl.Buffer, byte offset)``
and enqueues the kernel on the current stream's queue. It imports nothing of inductor.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pyopencl as cl
import torch

import torchport
from torchport.backends.opencl.runtime import REPORT_INDEX, build_program

_NP = {torch.float32: np.float32, torch.int64: np.int64, torch.int32: np.int32,
       torch.int16: np.int16, torch.int8: np.int8, torch.uint8: np.uint8, torch.bool: np.uint8}
_HELPERS = """#pragma OPENCL FP_CONTRACT OFF
inline float tp_round_half(float v) {
  ushort h; vstore_half_rte(v, 0, (__private half*)&h); return vload_half(0, (__private const half*)&h);
}
inline long tp_floordiv(long a, long b) { long q = a / b; return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q; }
inline long tp_mod(long a, long b) { long r = a % b; return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r; }
"""
_OPTIONS = ["-cl-fp32-correctly-rounded-divide-sqrt"]  # IEEE division and sqrt, as the CPU


class OpenCLProgram:
    """One generated kernel as the compiled program calls it: built per device on first
    use, enqueued with ``(buffer, offset)`` of each tensor on the current stream."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.checks = "report_index(" in source  # reads indices from tensors: checks them
        self.kernels: dict[int, cl.Kernel] = {}
        self.lock = threading.Lock()  # a kernel object's arguments are set, then enqueued
        self.kernel(0)  # built when the program loads: a build error is a compile error

    @staticmethod
    def runtime() -> Any:
        b = torchport.current_backend()
        if b is None or b.name != "ocl":
            raise RuntimeError("an OpenCL compiled kernel needs the ocl backend registered")
        return b.runtime

    def kernel(self, index: int) -> cl.Kernel:
        k = self.kernels.get(index)
        if k is None:
            rt = self.runtime()
            head = _HELPERS + (REPORT_INDEX if self.checks else "")
            if rt.fp64[index]:
                head = "#pragma OPENCL EXTENSION cl_khr_fp64 : enable\n" + head
            program = build_program(rt.contexts[index], head + self.source, _OPTIONS)
            k = self.kernels[index] = program.all_kernels()[0]
        return k

    _placeholders: dict[int, cl.Buffer] = {}

    @classmethod
    def placeholder(cls, rt: Any, index: int) -> cl.Buffer:
        """A small buffer standing for an empty tensor's (which has no memory)."""
        buf = cls._placeholders.get(index)
        if buf is None:
            buf = cls._placeholders[index] = cl.Buffer(rt.contexts[index],
                                                      cl.mem_flags.READ_WRITE, 256)
        return buf

    def __call__(self, xnumel: int, rnumel: int, *args: Any) -> None:
        if xnumel == 0:
            return
        tensors = [a for a in args if isinstance(a, torch.Tensor) and a.device.type != "cpu"]
        index = torchport.device_index(tensors[0])
        rt = self.runtime()
        flat: list[Any] = [np.int64(xnumel), np.int64(rnumel)]
        for a in args:
            if isinstance(a, torch.Tensor) and a.device.type == "cpu" and a.dim() == 0:
                flat.append(_NP[a.dtype](a.item()))  # read now: the program's order
            elif isinstance(a, torch.Tensor):
                if a.device.type != "ocl" or torchport.device_index(a) != index:
                    raise RuntimeError(f"ocl compiled kernel: a tensor on {a.device}; the "
                                       f"kernel's tensors are on {tensors[0].device}")
                if a.numel() == 0:  # owns no memory, and no work-item reads it
                    buf, off = self.placeholder(rt, index), 0
                else:
                    buf, off = rt.locate(index, torchport.device_address(a))
                flat += [buf, np.uint64(off)]
            else:
                flat.append(np.int64(a))
        k = self.kernel(index)
        stream = torchport.current_stream(tensors[0])
        if self.checks:
            word, code = rt.error_word(index, stream, "index (compiled kernel)", lookup=True)
            flat += [word, np.int64(code)]
        queue = rt.queue(index, stream)
        with self.lock:
            k(queue, (int(xnumel),), None, *flat)

