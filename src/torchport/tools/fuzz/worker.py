"""A fuzz worker process: ``python -m torchport.tools.fuzz.worker cpu|sim|backend MODULE``.

Programs run in long-lived worker processes, so that a crash or a hang on the device costs
one worker (restarted by :mod:`.runner`), not the fuzzer, and so that the CPU reference
never loads torchport. The sim mode comes from the environment the runner gives the process
(``TORCHPORT_SIM_STRICT``/``TORCHPORT_SIM_ASYNC``), as for any user; ``backend MODULE`` runs
on the device of another backend (``--backend`` of the command line).

Protocol on stdin/stdout: frames of a 4-byte big-endian length and a pickle. The worker
sends ``{"ready": True}`` once imported, then answers each ``{"source": text}`` with
``{"trace": ...}`` (see :func:`.prelude.run`) or ``{"error": text}``.
"""

from __future__ import annotations

import gc
import os
import pickle
import struct
import sys
import traceback
from typing import IO, Any


def write_frame(f: IO[bytes], obj: Any) -> None:
    """Send one pickled frame."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    f.write(struct.pack(">I", len(data)) + data)
    f.flush()


def read_frame(f: IO[bytes]) -> Any:
    """Receive one pickled frame; None at end of input."""
    head = f.read(4)
    if len(head) < 4:
        return None
    (n,) = struct.unpack(">I", head)
    return pickle.loads(f.read(n))


def serve(role: str, backend: str = "") -> None:
    """Answer programs until stdin closes. ``role`` is ``cpu`` (the reference: torch only),
    ``sim`` (the device, in the mode the environment selects) or ``backend`` (the device
    that module ``backend`` registers)."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything a program prints goes to the log, not into the protocol
    sys.stdout = sys.stderr
    import torch

    from torchport.tools.fuzz import prelude
    dev, dev1 = ("cpu", "cpu") if role == "cpu" else ("sim", "sim:1")
    if role == "sim":
        import torchport.sim  # noqa: F401
    elif role == "backend":
        from torchport.tools.run import load_backend

        dev = load_backend(backend).name
        dev1 = f"{dev}:1"
    prelude.Recorder.announce = True
    torch.set_warn_always(True)  # warn-once warnings: every time, in both processes
    write_frame(out, {"ready": True})
    stdin = sys.stdin.buffer
    while True:
        req = read_frame(stdin)
        if req is None:
            return
        ns: dict[str, Any] = {k: getattr(prelude, k) for k in dir(prelude)
                              if not k.startswith("__")}
        try:
            exec(compile(req["source"], "<fuzz program>", "exec"), ns)  # noqa: S102
            reply: dict[str, Any] = {"trace": prelude.run(ns["program"], dev, dev1)}
        except BaseException:  # noqa: BLE001 - a program's own failure, reported
            reply = {"error": traceback.format_exc(limit=4)}
        del ns
        gc.collect()
        write_frame(out, reply)


if __name__ == "__main__":
    serve(sys.argv[1] if len(sys.argv) > 1 else "cpu", sys.argv[2] if len(sys.argv) > 2 else "")
