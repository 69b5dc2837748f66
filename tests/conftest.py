"""Shared fixtures: the sim backend, registered once per process.

The suite runs twice in ``make test``: default (host-addressable) memory and
``TORCHPORT_SIM_STRICT=1`` (device-only memory) for the core tests.
"""

import os

import pytest
import torch

import torchport.sim  # noqa: F401  (registers the device)

STRICT = os.environ.get("TORCHPORT_SIM_STRICT", "") not in ("", "0")


@pytest.fixture
def sim_backend():
    return torchport.sim.BACKEND


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
