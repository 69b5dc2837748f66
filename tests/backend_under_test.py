"""The backend that the model, zoo and Lightning suites test: ``sim`` unless
``TORCHPORT_TEST_BACKEND`` names another (as ``--backend`` takes it).

``sim`` computes with the CPU's own kernels, so those suites compare bit for bit there. A
vendor-shaped backend (``torchport.backends.reference``, ``torchport.opencl``) computes with
kernels of its own, which round otherwise: there the suites compare within the dtype's
default tolerances (:func:`assert_matches`). One process holds one backend and
``tests/conftest.py`` registers ``sim``, so another backend runs under ``pytest --noconftest``.
"""

from __future__ import annotations

import sys

import torch

from torchport.core import settings

NAME: str = settings.get("TORCHPORT_TEST_BACKEND")
EXACT: bool = NAME == "sim"  # bit for bit: the device runs the CPU's kernels


def load() -> str:
    """Register the backend under test in this process; its device type."""
    from torchport.tools.run import load_backend

    if not EXACT and "torchport.sim" in sys.modules:
        raise RuntimeError(
            f"TORCHPORT_TEST_BACKEND={NAME}: this process already registered sim (tests/"
            f"conftest.py); run pytest with --noconftest")
    return load_backend(NAME).name


# Off sim, a float32 value computed through a whole model (a gradient, weights after
# optimizer steps) may differ by more than one op's rounding: a 2-layer transformer's
# gradients carry the differences of a few hundred float32 ops, and AdamW divides each
# gradient by its own root mean square, so an element whose gradient is zero in exact
# arithmetic (a key projection's bias, which softmax cancels) moves by normalised rounding
# noise. Checked against float64 on the CPU, the CPU's own float32 gradients of DeiT are off
# as much (2.6e-5 of the largest). Weights after AdamW steps (``lr``) may differ by a
# fraction of a step where a gradient is rounding noise (the reference backend: at most
# 3.9e-4 after three steps at lr 1e-2, DeiT's key bias); ``STEP_FRACTION`` of a step is
# allowed, where a lost or wrong update would leave a whole step.
DEEP_RTOL = 1e-4
DEEP_ATOL = 1e-4  # times the largest magnitude of the CPU's tensor
STEP_FRACTION = 0.1


def assert_matches(got: torch.Tensor | None, want: torch.Tensor | None, what: str,
                   deep: bool = False, lr: float = 0.0) -> None:
    """``got`` (any device) equals the CPU's ``want``: bit for bit on ``sim``, within
    ``torch.testing``'s default tolerances for the dtype on another backend (``deep``: a
    float32 value computed through a whole model, within ``DEEP_RTOL``/``DEEP_ATOL``, plus
    ``STEP_FRACTION * lr`` for weights after optimizer steps of learning rate ``lr``)."""
    if got is None or want is None:
        assert got is None and want is None, f"{what}: got {got is None}, want {want is None}"
        return
    tol: dict[str, float] = {"rtol": 0, "atol": 0} if EXACT else {}
    if not EXACT and deep and want.dtype == torch.float32 and want.numel():
        scale = want.detach().abs().nan_to_num(0, 0, 0).max().item()
        tol = {"rtol": DEEP_RTOL, "atol": max(DEEP_ATOL * scale, 1e-5) + STEP_FRACTION * lr}
    torch.testing.assert_close(got.detach().cpu(), want.detach().cpu(), equal_nan=True,
                               **tol, msg=lambda m: f"{what} differs from the CPU: {m}")
