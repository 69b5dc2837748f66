"""The OpenCL tests' worker process (tests/opencl_worker.py) and how a test runs code in it."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def worker_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    for k in ("TORCHPORT_SIM_STRICT", "TORCHPORT_SIM_ASYNC", "TORCHPORT_AUTOLOAD",
              "TORCHPORT_LAUNCH_BLOCKING"):
        env.pop(k, None)
    return {**env, **extra}


class Worker:
    def __init__(self, **env: str) -> None:
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "opencl_worker.py")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=worker_env(**env), cwd=ROOT)
        self._answer()  # {"ready": true}

    def run(self, code: str) -> object:
        """Run ``code`` in the worker; its exception fails the test with its traceback.
        Returns the value the code left in ``result`` (JSON), if any."""
        self.proc.stdin.write(json.dumps({"code": textwrap.dedent(code)}) + "\n")
        self.proc.stdin.flush()
        answer = self._answer()
        if not answer["ok"]:
            pytest.fail(answer["error"], pytrace=False)
        return answer.get("result")

    def _answer(self) -> dict:
        while True:  # skip what else the worker prints
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the OpenCL worker ended (exit {self.proc.wait()})")
            if line.startswith("{"):
                return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="session")
def ocl():
    pytest.importorskip("pyopencl", reason="the opencl extra is not installed")
    w = Worker()
    yield w
    w.close()


@pytest.fixture(scope="session")
def ocl2():
    """A worker with two OpenCL devices: PoCL's CPU driver twice (``POCL_DEVICES``),
    numbered the other way round (``ocl:0`` is the runtime's device 1), so that a
    physical index taken for ``torch.ocl``'s shows."""
    pytest.importorskip("pyopencl", reason="the opencl extra is not installed")
    try:
        w = Worker(POCL_DEVICES="pthread pthread", TORCHPORT_OPENCL_PLATFORM="Portable",
                   TORCHPORT_VISIBLE_DEVICES="1,0")
    except RuntimeError as e:  # the worker ended: no such PoCL device
        pytest.skip(f"no OpenCL worker with POCL_DEVICES='pthread pthread': {e}")
    count = w.run("result = torch.ocl.device_count()")
    if count != 2:
        w.close()
        pytest.skip(f"PoCL gave {count} devices for POCL_DEVICES='pthread pthread'")
    yield w
    w.close()
