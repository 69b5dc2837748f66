"""Training-step time of small models on sim vs native CPU, in the same run.

Each model trains with its own optimizer on random data; one "run" is ``--steps``
training steps (forward, backward, optimizer step, loss read back with
``.item()`` as a training loop does); times are the medians of ``--repeat`` runs,
per step, and the ratio is the median of the ratios of back-to-back sim/CPU run pairs
(robust to this kind of machine changing speed between seconds). Large-batch cases are dominated by kernel time (the sim computes
with the same ATen CPU kernels), small-batch ones by the per-op host cost.

    .venv/bin/python benchmarks/models.py [--repeat 5] [--steps 10] [--only mlp-large]

``--python-floor`` adds a reference: the CPU step inside an empty ``TorchDispatchMode``
(one Python call per ATen op, nothing else), timed in the same alternation; its ratio to
the CPU is what a Python layer between PyTorch and the kernels costs by itself.

``--from-host`` moves each step's batch from host memory inside the step (``x.to(device)``,
as a loop over a DataLoader does; on the CPU a no-op), rather than once before the runs.

``--python-views`` adds the sim step with the Python view kernels instead of PyTorch's C++
ones (``torchport.ops.native_views``), switched in this process, in the same alternation.

``--compile`` times four sides of each case, alternating: eager CPU, eager sim, and both
compiled the way PyTorch's tutorials compile training (``torch.compile(model)``, whose
backward AOTAutograd compiles too, and ``torch.compile(optimizer.step)``; the loss, the
``zero_grad`` and the ``.item()`` stay eager), with the ratios of compiled sim to eager sim,
eager CPU and compiled CPU, and each compiled side's first and second call (the compiles:
forward and backward, then the optimizer step again once its state exists), with
inductor's caches off so that both sides compile from nothing. A fifth side, the compiled
sim step with autograd's device thread off, gives the engine's hand-off to that thread
(PyTorch's share of a device's step, as on CUDA) as a line of its own, and the rest of the
step against compiled CPU. ``--compile --inference`` times forward passes under
``no_grad`` (eval mode, the predictions read back to the host) instead of training steps.

``--allocator`` prints, instead of times, each case's allocations a step that missed the
caching allocator's exact-size reuse (its slow path) after warm-up, and the memory it then
holds: counts, not times, so they do not move with this kind of machine's speed.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from torchport.backend import active_backend
from torchport.tools.run import load_backend

DEVICE = "sim"  # the device the sides labelled "sim" run on (``--backend`` picks another)
FROM_HOST = False  # each step moves its batch from host memory (``--from-host``)


@dataclass
class Case:
    name: str
    batch: str  # "large" or "small"
    make_model: Callable[[], nn.Module]
    make_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    optimizer: str = "sgd"


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 10))


def _tiny_mlp() -> nn.Module:
    """A step of about 50 tiny ops (600 us on the CPU): the host's cost per op decides."""
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.LayerNorm(64), nn.Linear(64, 64),
                         nn.ReLU(), nn.Linear(64, 10))


def _narrow_mlp() -> nn.Module:
    """The shape vendors' kernel-light backends were first measured on: 32-64-64-10."""
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 10))


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 8 * 8, 10))


class _Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(1000, 128)
        self.enc = nn.TransformerEncoderLayer(128, 4, 256, dropout=0.0, batch_first=True)
        self.head = nn.Linear(128, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.emb(x))).flatten(0, 1)


def _images(n: int) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    return lambda: (torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,)))


def _vectors(n: int, width: int = 256) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    return lambda: (torch.randn(n, width), torch.randint(0, 10, (n,)))


def _tokens(n: int) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    return lambda: (torch.randint(0, 1000, (n, 32)), torch.randint(0, 1000, (n * 32,)))


CE = nn.functional.cross_entropy
CASES = [
    Case("mlp-large", "large", _mlp, _vectors(1024), CE),
    Case("cnn-large", "large", _cnn, _images(128), CE),
    Case("transformer-large", "large", _Transformer, _tokens(64), CE, "adamw"),
    Case("mlp-small", "small", _mlp, _vectors(8), CE),
    Case("cnn-small", "small", _cnn, _images(4), CE),
    Case("transformer-small", "small", _Transformer, _tokens(2), CE, "adamw"),
    Case("mlp-ln-tiny", "small", _tiny_mlp, _vectors(8, 64), CE, "adamw"),
    Case("mlp-narrow-b8", "small", _narrow_mlp, _vectors(8, 32), CE),
    Case("mlp-narrow-b256", "small", _narrow_mlp, _vectors(256, 32), CE),
]


class _EmptyMode(TorchDispatchMode):
    """Every ATen op through one Python call that only runs it."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        return func(*args, **(kwargs or {}))


def make_step(case: Case, device: str, python_floor: bool = False,
              compiled: bool = False) -> Callable[[], float]:
    """One training step of ``case`` on ``device`` (same seed, so same model and data);
    ``python_floor``: inside an empty ``TorchDispatchMode``; ``compiled``: the model and the
    optimizer step through ``torch.compile``."""
    torch.manual_seed(0)
    model = case.make_model().to(device)
    host_batch = case.make_batch()
    x, y = (t.to(device) for t in host_batch)
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-3) if case.optimizer == "adamw"
           else torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    forward = torch.compile(model) if compiled else model
    opt_step = torch.compile(opt.step) if compiled else opt.step

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        xs, ys = (t.to(device) for t in host_batch) if FROM_HOST else (x, y)
        loss = case.loss(forward(xs), ys)
        loss.backward()
        opt_step()
        return loss.item()

    def step_in_mode() -> float:
        with _EmptyMode():
            return step()

    return step_in_mode if python_floor else step


def time_case(case: Case, steps: int, repeat: int, python_floor: bool = False,
              python_views: bool = False) -> dict[str, tuple[float, float]]:
    """Per side (``sim``, ``cpu``, and ``floor`` and ``pyviews`` if asked), the median
    seconds per training step and the median of its ratios to the CPU over back-to-back
    runs. The runs alternate their order, so that a noisy neighbour or a clock change hits
    both sides of a ratio alike."""
    fns = {"sim": make_step(case, DEVICE), "cpu": make_step(case, "cpu")}
    if python_floor:
        fns["floor"] = make_step(case, "cpu", python_floor=True)
    views = active_backend().view_kernels
    if python_views:
        fns["pyviews"] = fns["sim"]  # the same model and memory, its views through Python

    def timed(d: str, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            fns[d]()
        return (time.perf_counter() - t0) / n

    def run(d: str, n: int) -> float:
        """Seconds per step of ``n`` steps of side ``d``."""
        if d != "pyviews":
            return timed(d, n)
        views.use(False)
        try:
            return timed(d, n)
        finally:
            views.use(True)

    runs: dict[str, list[float]] = {d: [] for d in fns}
    for d in fns:
        run(d, 3)
    order = list(fns)
    for i in range(repeat):
        for d in (order if i % 2 == 0 else order[::-1]):
            runs[d].append(run(d, steps))
    return {d: (statistics.median(r), statistics.median(
        [a / c for a, c in zip(r, runs["cpu"], strict=True)])) for d, r in runs.items()}


def make_inference(case: Case, device: str, compiled: bool = False) -> Callable[[], torch.Tensor]:
    """One inference call of ``case``'s model on ``device``: the model in eval mode, its
    forward under ``torch.no_grad()`` (compiled with ``torch.compile`` if asked), and its
    predictions (the output's argmax) read back to the host, as a serving loop reads them."""
    torch.manual_seed(0)
    model = case.make_model().to(device).eval()
    x = case.make_batch()[0].to(device)
    forward = torch.compile(model) if compiled else model

    def infer() -> torch.Tensor:
        with torch.no_grad():
            return forward(x).argmax(-1).cpu()

    return infer


TRAIN_SIDES = ("cpu", "sim", "ccpu", "csim", "csim-t0")
INFER_SIDES = ("cpu", "sim", "ccpu", "csim")


def time_compiled_case(case: Case, steps: int, repeat: int, inference: bool = False
                       ) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """(median seconds per step of each side, the median ratios of back-to-back runs, and
    the seconds of the first and second calls of ``ccpu`` and ``csim``).

    Sides: ``cpu``/``sim`` eager, ``ccpu``/``csim`` compiled; training adds ``csim-t0``, the
    compiled sim step with autograd's device thread off (its backward in the calling
    thread, as the engine runs the CPU's), so that ``csim - csim-t0`` is the engine's
    hand-off to its device thread, PyTorch's share of the step (two context switches, as on
    CUDA). ``inference``: one forward under ``no_grad`` and its output read back, instead of
    a training step. Inductor's caches are off while the compiled sides compile, so neither
    reuses the other's kernels."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.fail_on_recompile_limit_hit = True  # never time eager silently
    sides = INFER_SIDES if inference else TRAIN_SIDES
    make = make_inference if inference else make_step
    fns = {d: make(case, "cpu" if "cpu" in d else DEVICE, compiled=d not in ("cpu", "sim"))
           for d in sides if d != "csim-t0"}
    compile_s: dict[str, float] = {}
    with torch.compiler.config.patch(force_disable_caches=True):
        for d in ("ccpu", "csim"):
            for k in ("1st", "2nd"):
                t0 = time.perf_counter()
                fns[d]()
                compile_s[f"{d} {k}"] = time.perf_counter() - t0
    if "csim-t0" in sides:
        fns["csim-t0"] = fns["csim"]  # the same compiled step, backward in this thread
    runs: dict[str, list[float]] = {d: [] for d in sides}
    for d in sides:
        for _ in range(3):
            fns[d]()
    for i in range(repeat):
        for d in (sides if i % 2 == 0 else sides[::-1]):
            torch.autograd.set_multithreading_enabled(d != "csim-t0")
            try:
                t0 = time.perf_counter()
                for _ in range(steps):
                    fns[d]()
                runs[d].append((time.perf_counter() - t0) / steps)
            finally:
                torch.autograd.set_multithreading_enabled(True)
    medians = {d: statistics.median(r) for d, r in runs.items()}
    pairs = [("csim", "sim"), ("csim", "cpu"), ("csim", "ccpu"), ("ccpu", "cpu")]
    if not inference:
        pairs.append(("csim-t0", "ccpu"))
    ratios = {f"{a}/{b}": statistics.median([p / q for p, q in zip(runs[a], runs[b],
                                                                   strict=True)])
              for a, b in pairs}
    if not inference:
        ratios["handoff"] = statistics.median(
            [a - b for a, b in zip(runs["csim"], runs["csim-t0"], strict=True)])
    torch._dynamo.reset()
    return medians, ratios, compile_s


def print_compiled(steps: int, repeat: int, only: str | None, inference: bool = False) -> None:
    """One line per case: ms per step of each side, the ratios, and the compile times.
    Training lines end with the engine's hand-off (``handoff ms``: compiled sim with
    autograd's device thread minus without) and the compiled sim step without it against
    compiled CPU (``t0/ccpu``): compiled training is at compiled CPU plus the hand-off when
    that ratio is at 1."""
    sides = INFER_SIDES if inference else TRAIN_SIDES
    keys = ["csim/sim", "csim/cpu", "csim/ccpu", "ccpu/cpu"]
    print(f"{'model':<20}{'batch':>6}"
          + "".join(f"{d + ' ms':>{max(9, len(d) + 4)}}" for d in sides)
          + "".join(f"{k:>10}" for k in keys)
          + ("" if inference else f"{'handoff ms':>11}{'t0/ccpu':>9}")
          + f"{'compile cpu s':>15}{'compile sim s':>15}")
    for case in CASES:
        if only and only not in case.name:
            continue
        m, r, c = time_compiled_case(case, steps, repeat, inference)
        print(f"{case.name:<20}{case.batch:>6}"
              + "".join(f"{m[d] * 1e3:>{max(9, len(d) + 4)}.2f}" for d in sides)
              + "".join(f"{r[k]:>10.2f}" for k in keys)
              + ("" if inference else f"{r['handoff'] * 1e3:>11.2f}{r['csim-t0/ccpu']:>9.2f}")
              + f"{c['ccpu 1st']:>8.1f}+{c['ccpu 2nd']:<6.1f}{c['csim 1st']:>8.1f}+"
                f"{c['csim 2nd']:<6.1f}", flush=True)


def slow_allocations(case: Case, steps: int) -> tuple[float, int]:
    """(allocations a step through the allocator's slow path, bytes reserved) for the sim
    step of ``case``, after five warm-up steps, starting from an empty cache."""
    gc.collect()
    module = getattr(torch, DEVICE)
    module.empty_cache()
    alloc = active_backend().allocators[0]
    step = make_step(case, DEVICE)
    for _ in range(5):
        step()
    if hasattr(alloc, "slow_mallocs"):  # the C++ allocator counts them
        before = alloc.slow_mallocs
        for _ in range(steps):
            step()
        return (alloc.slow_mallocs - before) / steps, module.memory_reserved()
    calls = 0
    slow = alloc._malloc

    def counted(*args: object) -> object:
        nonlocal calls
        calls += 1
        return slow(*args)
    alloc._malloc = counted
    try:
        for _ in range(steps):
            step()
    finally:
        del alloc._malloc
    return calls / steps, module.memory_reserved()


def print_allocations(steps: int, only: str | None) -> None:
    print(f"{'model':<20}{'slow allocs/step':>18}{'reserved MiB':>14}")
    for case in CASES:
        if not only or only in case.name:
            n, reserved = slow_allocations(case, steps)
            print(f"{case.name:<20}{n:>18.1f}{reserved / 2**20:>14.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--only", default=None, help="run the cases whose name contains this")
    p.add_argument("--python-floor", action="store_true",
                   help="also time the CPU step inside an empty TorchDispatchMode")
    p.add_argument("--python-views", action="store_true",
                   help="also time the sim step with the Python view kernels")
    p.add_argument("--allocator", action="store_true",
                   help="print slow-path allocations per step instead of times")
    p.add_argument("--compile", action="store_true",
                   help="time eager and torch.compile'd steps on CPU and sim (and the compiles)")
    p.add_argument("--inference", action="store_true",
                   help="with --compile: forward passes under no_grad instead of training steps")
    p.add_argument("-b", "--backend", default="sim",
                   help="the device's backend, as torchport run's -b: sim, reference (kernel-"
                        "light, device-only memory), bare_sim (the sim with no kernels), a module")
    p.add_argument("--from-host", action="store_true",
                   help="each step moves its batch from host memory (x.to(device), as a loop "
                        "over a DataLoader does), not once before")
    args = p.parse_args()
    global DEVICE, FROM_HOST
    FROM_HOST = args.from_host
    backend = load_backend(args.backend)
    DEVICE = backend.name
    memory = "host-addressable" if backend.runtime.host_addressable else "device-only"
    if args.compile:
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of "
              f"{args.repeat} runs x {args.steps} steps; compile: first call + second call; "
              f"the 'sim' columns: device {DEVICE}, {memory} memory")
        print_compiled(args.steps, args.repeat, args.only, args.inference)
        return
    if args.allocator:
        print_allocations(args.steps, args.only)
        return
    torch.set_num_threads(torch.get_num_threads())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of "
          f"{args.repeat} runs x {args.steps} steps; the 'sim' columns: device {DEVICE}, "
          f"{memory} memory")
    extra = (f"{'floor ms':>10}{'floor':>8}" if args.python_floor else "") + (
        f"{'pyviews ms':>12}{'pyviews':>9}" if args.python_views else "")
    print(f"{'model':<20}{'batch':>7}{'sim ms':>10}{'cpu ms':>10}{'ratio':>8}{'target':>8}"
          + extra)
    for case in CASES:
        if args.only and args.only not in case.name:
            continue
        t = time_case(case, args.steps, args.repeat, args.python_floor, args.python_views)
        target = 1.10 if case.batch == "large" else 2.0
        (ts, ratio), (tc, _) = t["sim"], t["cpu"]
        line = (f"{case.name:<20}{case.batch:>7}{ts * 1e3:>10.2f}{tc * 1e3:>10.2f}"
                f"{ratio:>8.2f}{target:>8.2f}")
        if "floor" in t:
            line += f"{t['floor'][0] * 1e3:>10.2f}{t['floor'][1]:>8.2f}"
        if "pyviews" in t:
            line += f"{t['pyviews'][0] * 1e3:>12.2f}{t['pyviews'][1]:>9.2f}"
        print(line)


if __name__ == "__main__":
    main()
