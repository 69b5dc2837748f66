"""``torch.compile`` (inductor) for ``ocl``: the OpenCL backend's own inductor code generator.

The worked example of a vendor's own ``Scheduling`` (``torchport.graph.enable_inductor(
backend, codegen="torchport.backends.opencl.inductor:OpenCLScheduling")``, in
:mod:`torchport.backends.opencl.graph`): inductor
schedules and fuses the graph as for any SIMD device (its ``SIMDScheduling``), and this
module writes each fused kernel as OpenCL C:

* one work-item per element of the kernel's pointwise range (``xindex``); a reduction is a
  loop over the reduced range inside the work-item (``r0_index``), so each output element is
  reduced in index order by one work-item: no atomics, no tree;
* inductor's index expressions (strides, broadcasting, views) are printed as C over the
  buffers' elements: every input is read where it lies, strided;
* the program inductor generates calls :class:`OpenCLProgram` objects with its tensors;
  each call finds ``(cl.Buffer, byte offset)`` of every tensor with the runtime's
  ``locate`` and enqueues the kernel on the current stream's queue of the tensors'
  device: ordered with the eager ops queued on that stream, and nothing runs on the host.

Extern kernels (``mm``, convolution, ...) stay device ops through torchport's op layer.
What this generator cannot write (an op, a dtype, a reduction kind) raises
:class:`OpenCLCodegenError` when the graph is compiled, naming it and the ways out.

This module is the scheduling, and the names the rest of torchport imports; the code
generator's parts: the kernel (:mod:`.inductor_kernel`), its C expressions
(:mod:`.inductor_exprs`), and the compiled program's launcher (:mod:`.inductor_launch`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sympy
import torch
from torch._inductor.codegen.common import IndentedBuffer
from torch._inductor.codegen.simd import SIMDScheduling
from torch._inductor.virtualized import V

from torchport.backends.opencl.inductor_exprs import OpenCLCodegenError
from torchport.backends.opencl.inductor_kernel import OpenCLKernel
from torchport.backends.opencl.inductor_launch import OpenCLProgram

__all__ = ["OpenCLCodegenError", "OpenCLKernel", "OpenCLProgram", "OpenCLScheduling"]


class OpenCLScheduling(SIMDScheduling):
    """Inductor's SIMD scheduling (fusion, node order, reduction loops) with OpenCL C
    kernels (:class:`OpenCLKernel`): the ``ocl`` device's own code generator."""

    kernel_type = OpenCLKernel  # type: ignore[assignment]

    @classmethod
    def get_backend_features(cls, device: torch.device) -> Any:
        from torch.utils._ordered_set import OrderedSet

        return OrderedSet()

    @classmethod
    def get_tiling_and_scores(cls, node_schedule: Any, numel: sympy.Expr,
                              reduction_numel: sympy.Expr = sympy.S.One,
                              coalesce_analysis: Any = None) -> tuple[Any, Any]:
        # one flat pointwise range and one reduction range: a work-item per element
        return cls.create_tiling([numel], [reduction_numel]), None

    def define_kernel(self, src_code: str, node_schedule: Sequence[Any], kernel: Any) -> str:
        wrapper = V.graph.wrapper_code
        if src_code in wrapper.src_to_kernel:
            return wrapper.src_to_kernel[src_code]
        name = f"ocl_kernel_{wrapper.next_kernel_suffix()}"
        wrapper.src_to_kernel[src_code] = name
        wrapper.add_import_once("from torchport.backends.opencl.inductor import OpenCLProgram")
        body = IndentedBuffer()
        body.writeline("OpenCLProgram('''")
        body.splice(src_code, strip=True)
        body.writeline("''')")
        wrapper.define_kernel(name, body.getvalue(), None, gpu=False)
        return name
