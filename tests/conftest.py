"""Shared fixtures: the sim backend, registered once per process.

``make test`` runs the suite in stages selected by marker (tests/README.md): default
(host-addressable) memory, and the ``modes`` modules again with ``TORCHPORT_SIM_STRICT=1``
(device-only memory) and ``TORCHPORT_SIM_ASYNC=1`` (asynchronous streams).
"""

import gc
import os
from pathlib import Path

import pytest
import torch

import torchport.sim  # noqa: F401  (registers the device)

STRICT = os.environ.get("TORCHPORT_SIM_STRICT", "") not in ("", "0")

# The sim chip's zero-copy view of its memory, in both memory modes: what a test's own
# host kernels compute on (``Backend.to_host`` copies where memory is device-only).
chip_view = next(d.to_cpu for ks in torchport.sim.BACKEND.kernel_sets for d in ks.decls
                 if d.kind == "host")


CONFORMANCE = Path(__file__).parent / "conformance"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fresh-interpreters", action="store_true",
                     help="start every child interpreter of helpers.run_python from nothing "
                          "(default: forked from one that has imported torch where that is "
                          "the same; tests/preloaded.py)")


def pytest_configure(config: pytest.Config) -> None:
    from tests import preloaded

    preloaded.enabled = not config.getoption("--fresh-interpreters")


def pytest_unconfigure(config: pytest.Config) -> None:
    from tests import preloaded

    preloaded.close()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The conformance subsets run in every mode stage (``modes``), like the core tests."""
    for item in items:
        if CONFORMANCE in item.path.parents:
            item.add_marker(pytest.mark.modes)


def pytest_collection_finish(session: pytest.Session) -> None:
    """What the imports and the collection made (torch's heap above all) moves to the
    collector's permanent generation: each full collection of the run then walks only what
    the tests made, not 10^6 objects that live until exit."""
    gc.freeze()


@pytest.fixture
def sim_backend():
    return torchport.sim.BACKEND


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def xfer():
    """torchport.transfer enabled for one test, disabled (and device 0 current) after."""
    import importlib

    tp = importlib.import_module("torchport.transfer")
    tp.enable()
    yield tp
    tp.disable()
    torch.sim.set_device(0)
