"""The OpenCL tests' worker process (tests/opencl_worker.py) and how a test runs code in it."""

import os

import pytest

from tests import helpers
from tests.helpers import ROOT


def worker_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    for k in ("TORCHPORT_SIM_STRICT", "TORCHPORT_SIM_ASYNC", "TORCHPORT_AUTOLOAD",
              "TORCHPORT_LAUNCH_BLOCKING"):
        env.pop(k, None)
    return {**env, **extra}


def worker(**env: str) -> helpers.Worker:
    """A worker process with the OpenCL backend registered, ``env`` added."""
    return helpers.Worker([str(ROOT / "tests" / "opencl_worker.py")], worker_env(**env), "OpenCL")


@pytest.fixture(scope="session")
def ocl():
    pytest.importorskip("pyopencl", reason="the opencl extra is not installed")
    w = worker()
    yield w
    w.close()


@pytest.fixture(scope="session")
def ocl2():
    """A worker with two OpenCL devices: PoCL's CPU driver twice (``POCL_DEVICES``),
    numbered the other way round (``ocl:0`` is the runtime's device 1), so that a
    physical index taken for ``torch.ocl``'s shows."""
    pytest.importorskip("pyopencl", reason="the opencl extra is not installed")
    try:
        w = worker(POCL_DEVICES="pthread pthread", TORCHPORT_OPENCL_PLATFORM="Portable",
                   TORCHPORT_VISIBLE_DEVICES="1,0")
    except RuntimeError as e:  # the worker ended: no such PoCL device
        pytest.skip(f"no OpenCL worker with POCL_DEVICES='pthread pthread': {e}")
    count = w.run("result = torch.ocl.device_count()")
    if count != 2:
        w.close()
        pytest.skip(f"PoCL gave {count} devices for POCL_DEVICES='pthread pthread'")
    yield w
    w.close()
