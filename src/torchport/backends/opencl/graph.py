"""Graph mode for ``ocl``: ``torch.compile`` (inductor) with the backend's own code generator
(:mod:`torchport.backends.opencl.inductor`, imported when inductor first needs it), and
pyopencl kept out of TorchDynamo's tracing.

A compiled function runs eager device code between its graphs (after a graph break,
autograd's engine in ``loss.backward()``): the backend's kernels are skipped by dynamo as
all of torchport is, but they call pyopencl, whose Python frames -- its modules and the
kernel invokers it generates per kernel, named ``<generated: 'pyopencl invoker for ...'>``
-- dynamo would otherwise try to trace, as it would any library code the device's kernels
call.
"""

from __future__ import annotations

import types

from torchport.core import lazy
from torchport.core.contracts import DeviceBackend
from torchport.graph.inductor import enable_inductor

SCHEDULING = "torchport.backends.opencl.inductor:OpenCLScheduling"
_INVOKERS = "<generated: 'pyopencl invoker"


def enable(backend: DeviceBackend) -> None:
    """Make ``backend`` (the ``ocl`` backend, before or after registering) compilable."""
    enable_inductor(backend, codegen=SCHEDULING)
    lazy.when_imported("torch._dynamo.trace_rules", _skip_pyopencl)


def _skip_pyopencl(trace_rules: types.ModuleType) -> None:
    trace_rules.add("pyopencl")
    if _INVOKERS not in trace_rules.SKIP_DIRS:  # generated code: a file name, no folder
        trace_rules.SKIP_DIRS.append(_INVOKERS)
        trace_rules._recompile_re()
