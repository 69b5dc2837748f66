"""A process with the OpenCL backend registered, running test code sent by
tests/test_opencl_*.py (the test process itself has the sim: one backend per process).

Reads JSON lines ``{"code": ...}`` on stdin, runs each in one namespace (``torch``,
``torchport``, ``ocl`` = torchport.opencl), answers ``{"ok": bool, "error": traceback,
"result": what the code assigned to ``result``}``.
"""

import json
import sys
import traceback
import warnings

import torch

import torchport
import torchport.opencl as ocl

torchport.ops.set_fallback_warn(False)
warnings.simplefilter("ignore", UserWarning)
namespace = {"torch": torch, "torchport": torchport, "ocl": ocl}
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    code = json.loads(line)["code"]
    try:
        torch.manual_seed(0)
        namespace.pop("result", None)
        exec(compile(code, "<opencl test>", "exec"), namespace)
        answer = {"ok": True, "result": namespace.get("result")}
    except BaseException:  # reported to the test
        answer = {"ok": False, "error": traceback.format_exc()}
    print(json.dumps(answer), flush=True)
