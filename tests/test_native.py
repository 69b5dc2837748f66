"""torchport's optional C++ library: the device guard, and the Python twins where it is off."""

from __future__ import annotations

import pytest

from tests.helpers import python_views_serve, run_python
from torchport.core import native

# Backward passes on sim:0 and sim:1, one inside a stream context, counting the Python
# guard's calls; checks the gradients against the CPU's and prints "calls <n>".
_BACKWARD_COUNTING_GUARD_CALLS = """
import torch, torchport.sim
from torchport.backend import _Guard
calls = []
python_type = _Guard.type_
_Guard.type_ = lambda self: calls.append(1) or python_type(self)
def grad(device):
    w = torch.arange(12., device=device).view(4, 3).sub(5).requires_grad_()
    (w.t() @ w).relu().sum().backward()
    return w.grad.cpu()
with torch.sim.stream(torch.sim.Stream()):
    on_sim = grad("sim")
assert torch.equal(on_sim, grad("cpu")) and torch.equal(grad("sim:1"), grad("cpu"))
print("calls", len(calls))
"""


def _guard_calls(**env: str) -> int:
    r = run_python(_BACKWARD_COUNTING_GUARD_CALLS, TORCHPORT_FALLBACK_WARN="0", **env)
    assert r.returncode == 0, r.stderr
    return int(r.stdout.split("calls")[-1])


@pytest.mark.skipif(native.load() is None, reason=f"no C++ library: {native.UNAVAILABLE}")
def test_the_cpp_guard_serves_without_entering_python():
    assert _guard_calls() == 0
    assert _guard_calls(TORCHPORT_NATIVE="0") > 0  # the Python guard is counted where it serves


def test_switched_off_by_the_environment():
    r = run_python("import torch, torchport.sim\n"
                   "from torchport.core import native\n"
                   "from torchport.backend import active_backend\n"
                   + python_views_serve() + "assert native.loaded() is None\nprint('ok')",
                   TORCHPORT_NATIVE="0")
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr
    assert "compiling" not in r.stderr and "NativeCodeWarning" not in r.stderr


def test_without_a_compiler_the_python_twins_serve(tmp_path):
    code = ("import warnings, torch\n"
            "with warnings.catch_warnings(record=True) as seen:\n"
            "    warnings.simplefilter('always')\n"
            "    import torchport.sim\n"
            "from torchport.backend import active_backend\n"
            + python_views_serve() +
            "print([str(w.message) for w in seen if 'C++ library' in str(w.message)])")
    env = {"TORCHPORT_CACHE_DIR": str(tmp_path), "CXX": str(tmp_path / "no-such-compiler")}
    first = run_python(code, **env)
    assert first.returncode == 0, first.stderr
    assert "unavailable" in first.stdout and "compiling" in first.stderr
    assert _guard_calls(**env) > 0  # the Python guard serves
    again = run_python(code, **env)  # the failure is remembered: no second attempt
    assert again.returncode == 0 and "unavailable" in again.stdout, again.stderr
    assert "compiling" not in again.stderr
