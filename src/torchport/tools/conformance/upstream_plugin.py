"""The pytest plugin of ``torchport conformance --upstream``: runs PyTorch's device-generic
test files (``instantiate_device_type_tests``) on the CPU or on a torchport device.

Loaded with ``-p`` (and ``--noconftest``, so that the checkout's own conftest stays out)
by :mod:`torchport.tools.conformance.upstream`, which sets:

* ``TORCHPORT_UPSTREAM_DEVICE``: ``cpu`` (plain PyTorch: no backend is loaded, only the
  ``...CPU`` test classes are made), or the backend under test as ``torchport run -b`` takes
  it. The backend is registered here, before the test files import
  ``torch.testing._internal``, which builds its device test bases (PrivateUse1's among
  them) at import; only those classes are made.
* ``TORCHPORT_UPSTREAM_RESULTS``: a file that receives every test's start and outcome as
  JSON lines as they happen, so a process that crashes or is killed still names the test
  it died in.

Tests of classes that are not device-generic are deselected (both runs would run the same
CPU code). PyTorch's test utilities need ``expecttest``, a test dependency a vendor's
environment may lack: a minimal one stands in for it then.
"""

from __future__ import annotations

import json
import os
import re
import sys
import textwrap
import types
import unittest
from typing import Any

from torchport.tools.conformance.upstream import DEVICE_VARIABLE, RESULTS_VARIABLE


def _expecttest_stand_in() -> None:
    """``expecttest``'s two names common_utils uses, comparing as it does when not accepting."""
    try:
        import expecttest  # noqa: F401
        return
    except ImportError:
        pass

    class TestCase(unittest.TestCase):
        longMessage = True

        def assertExpectedInline(self, actual: str, expect: str, skip: int = 0,  # noqa: N802
                                 ignore_comments: bool = False,
                                 ignore_empty_lines: bool = False) -> None:
            expect = textwrap.dedent(expect).removeprefix("\n")
            if ignore_empty_lines:
                actual = "\n".join(x for x in actual.splitlines() if x.strip())
                expect = "\n".join(x for x in expect.splitlines() if x.strip())
            self.assertMultiLineEqual(expect.rstrip("\n"), actual.rstrip("\n"))

        def assertExpectedRaisesInline(self, exc_type: Any, fn: Any, expect: str,  # noqa: N802
                                       *args: Any, **kwargs: Any) -> None:
            try:
                fn(*args, **kwargs)
            except exc_type as e:
                self.assertExpectedInline(str(e), expect, skip=1)
                return
            self.fail("Did not raise when expected to")

    m = types.ModuleType("expecttest")
    m.ACCEPT = False  # type: ignore[attr-defined]
    m.TestCase = TestCase  # type: ignore[attr-defined]
    sys.modules["expecttest"] = m


def _hardware_classification_stand_in() -> None:
    """``common_utils.HardwareClassification``, a label test files newer than the installed
    PyTorch import: both runs, the CPU's too, must collect the same tests."""
    import torch.testing._internal.common_utils as cu

    if not hasattr(cu, "HardwareClassification"):
        import enum

        class HardwareClassification(enum.Enum):
            GENERIC = "generic"
            ACCELERATOR = "accelerator"
            CPU = "cpu"

        cu.HardwareClassification = HardwareClassification  # type: ignore[attr-defined]


def _setup() -> str:
    """Register the device under test (if not the CPU); its type's name."""
    device = os.environ.get(DEVICE_VARIABLE, "cpu")
    _expecttest_stand_in()
    if device == "cpu":
        os.environ["PYTORCH_TESTING_DEVICE_ONLY_FOR"] = "cpu"
        name = "cpu"
    else:
        from torchport.tools.run import load_backend

        name = load_backend(device).name  # before torch.testing._internal builds its bases
        os.environ["PYTORCH_TESTING_DEVICE_ONLY_FOR"] = "privateuse1"
    _hardware_classification_stand_in()
    return name


DEVICE = _setup()
_GENERIC_CLASS = re.compile(rf"(CPU|PRIVATEUSE1|{re.escape(DEVICE.upper())})$")
_RESULTS = os.environ.get(RESULTS_VARIABLE)


def _emit(record: dict[str, Any]) -> None:
    if _RESULTS:
        with open(_RESULTS, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def pytest_collection_modifyitems(session: Any, config: Any, items: list[Any]) -> None:
    keep = [i for i in items if getattr(i, "cls", None) is not None
            and _GENERIC_CLASS.search(i.cls.__name__)]
    drop = [i for i in items if i not in keep]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_collection_finish(session: Any) -> None:
    _emit({"event": "collected", "device": DEVICE, "nodeids": [i.nodeid for i in session.items]})


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    _emit({"event": "start", "nodeid": nodeid})


def pytest_runtest_logreport(report: Any) -> None:
    rec: dict[str, Any] = {"event": "report", "nodeid": report.nodeid, "when": report.when,
                           "outcome": report.outcome}
    if hasattr(report, "wasxfail"):
        rec["xfail"] = True
    lr = report.longrepr
    if report.failed and lr is not None:
        crash = getattr(lr, "reprcrash", None)
        rec["message"] = (crash.message if crash is not None else str(lr))[:1000]
    elif report.skipped and isinstance(lr, tuple) and len(lr) == 3:
        rec["message"] = str(lr[2])[:300]
    _emit(rec)
