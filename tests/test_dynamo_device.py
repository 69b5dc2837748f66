"""TorchDynamo finds the device: ``get_interface_for_device("sim")`` answers from
``torch.sim`` (current device, count, streams, events, synchronize, memory)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.device_interface import get_interface_for_device

from tests.helpers import mode_independent, run_python

pytestmark = pytest.mark.modes


def test_the_interface_answers_from_the_device_module() -> None:
    di = get_interface_for_device("sim")
    assert get_interface_for_device(torch.device("sim", 1)) is di
    assert di.is_available() and di.device_count() == torch.sim.device_count()
    assert di.current_device() == torch.sim.current_device() == 0
    prev = di.exchange_device(1)
    try:
        assert prev == 0 and torch.sim.current_device() == 1 and di.current_device() == 1
    finally:
        di.set_device(0)
    assert di.get_device_properties(0) == torch.sim.get_device_properties(0)
    major, minor = torch.sim.get_device_capability(0)
    assert di.get_compute_capability(0) == major * 10 + minor
    assert di.is_bf16_supported() and di.is_dtype_supported(torch.bfloat16)
    x = torch.ones(1 << 10, device="sim")
    assert di.memory_allocated(0) == torch.sim.memory_allocated(0) >= x.nbytes
    s = di.Stream()
    s.wait_stream(di.current_stream())  # x is the default stream's work (a race, as on CUDA)
    with di.stream(s):
        assert di.current_stream() == s
        start, end = di.Event(enable_timing=True), di.Event(enable_timing=True)
        start.record()
        y = (x * 2).sum()
        end.record()
    di.synchronize()
    assert y.item() == 2048 and start.elapsed_time(end) >= 0
    assert di.get_raw_stream(0) == torch.sim.current_stream(0).stream_id
    assert isinstance(s, torch.Stream)


@mode_independent
def test_registered_when_dynamo_is_imported_after_torchport() -> None:
    code = ("import sys, torch, torchport.sim\n"
            "assert 'torch._dynamo' not in sys.modules\n"  # importing torchport loads no dynamo
            "from torch._dynamo.device_interface import get_interface_for_device\n"
            "di = get_interface_for_device('sim')\n"
            "assert di.device_count() == torch.sim.device_count()\n"
            "f = torch.compile(lambda a: (a * 2).sum(), backend='eager')\n"
            "assert f(torch.ones(4, device='sim')).item() == 8\n"
            "print('ok')")
    r = run_python(code, TORCHPORT_FALLBACK_WARN="0")
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_dynamo_skips_every_module_of_torchport_but_transfers_stand_ins() -> None:
    """Dynamo must not trace torchport's own frames (the device's kernels, which the
    dispatcher runs inside a compiled region), whichever layer folder holds them: only
    transfer's stand-ins for torch's functions are traced."""
    from pathlib import Path

    from torch._dynamo import trace_rules

    import torchport
    import torchport.sim  # noqa: F401

    root = Path(torchport.__file__).parent
    traced = [str(p.relative_to(root)) for p in sorted(root.rglob("*.py"))
              if not trace_rules.check_file(str(p)).skipped]
    assert traced == [str(p.relative_to(root)) for p in sorted((root / "transfer").glob("*.py"))]
