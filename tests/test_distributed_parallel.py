"""Parallel training on sim over simccl: SyncBatchNorm, FSDP2, distributed checkpoints, DDP's
``find_unused_parameters``.

Like ``test_distributed.py`` (both use the launcher and model of ``tests/helpers.py``), each
test starts two worker processes running this file (``python test_distributed_parallel.py
<scenario> <rank> <port>``); a worker exits non-zero with a message when a check fails.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a worker script: make ``tests`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest  # noqa: E402

from tests.helpers import (  # noqa: E402
    WORLD,
    check_ranks,
    ddp_mlp,
    ddp_reference,
    init_rank,
    launch_workers,
)

HERE = Path(__file__).resolve()


def test_sync_batchnorm_matches_batchnorm_on_whole_batch() -> None:
    check_ranks(launch_workers(HERE, "syncbn", timeout=90.0), ok_line="syncbn ok")


def test_fsdp2_matches_ddp_and_checkpoints_round_trip(tmp_path: Path) -> None:
    check_ranks(launch_workers(HERE, "fsdp_dcp", {"TP_CKPT_DIR": str(tmp_path)}, timeout=90.0),
           ok_line="fsdp_dcp ok")


def _pinned_memory() -> bool:
    """Does this process's backend give pinned host memory (torchport's C++ hooks)?"""
    import torchport.sim

    return torchport.sim.BACKEND.pinned_memory


@pytest.mark.xfail("not _pinned_memory()", strict=True, reason=(
    "Without torchport's C++ library (TORCHPORT_NATIVE=0, no compiler), in PyTorch 2.13: "
    "with find_unused_parameters (or static_graph) the C++ Reducer "
    "(Reducer::all_reduce_local_used_map, torch/csrc/distributed/c10d/reducer.cpp) stages the "
    "used-parameter map through at::native::empty_like(..., pinned_memory=true) whenever the "
    "parameters are on PrivateUse1; the pinned CPU allocation asks "
    "PrivateUse1HooksInterface::getPinnedMemoryAllocator (aten/src/ATen/EmptyTensor.cpp, "
    "GetCPUAllocatorMaybePinned), which the Python hooks of torch/csrc/acc/Module.cpp do not "
    "forward to Python, so backward raises NotImplementedError"))
def test_ddp_find_unused_parameters_and_static_graph() -> None:
    check_ranks(launch_workers(HERE, "find_unused", timeout=90.0), ok_line="find_unused ok")


def test_storage_resize_in_place() -> None:
    """FSDP2's free/re-allocate of a device storage: every tensor on it sees the new block."""
    import torch

    import torchport.sim  # noqa: F401

    t = torch.arange(6.0, device="sim:1")
    view = t[2:]
    st = t.untyped_storage()
    held = torch.sim.memory_allocated(1)
    assert st.resize_(0) is st and st.nbytes() == 0 and view.untyped_storage().nbytes() == 0
    gc.collect()
    assert torch.sim.memory_allocated(1) < held  # the block went back to the allocator
    st.resize_(24)
    t.copy_(torch.arange(6.0) * 2)
    others = [torch.full((6,), -1.0, device="sim:1") for _ in range(4)]  # must not reuse it
    gc.collect()
    assert torch.equal(view.cpu(), torch.tensor([4.0, 6.0, 8.0, 10.0]))
    assert all(torch.equal(o.cpu(), torch.full((6,), -1.0)) for o in others)
    st.resize_(12)  # shrink, then grow: the kept prefix survives
    st.resize_(24)
    assert st.nbytes() == 24 and torch.equal(t[:3].cpu(), torch.tensor([0.0, 2.0, 4.0]))
    assert t.device == torch.device("sim", 1)
    cpu = torch.zeros(4).untyped_storage()  # other devices: PyTorch's own resize
    cpu.resize_(8)
    assert cpu.nbytes() == 8


def test_sync_batchnorm_kernels_single_process() -> None:
    """The five CUDA-only ops, one rank's worth, against BatchNorm on CPU (float32 and bf16)."""
    import torch

    import torchport.sim  # noqa: F401

    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(5, 3, 4, generator=gen).to(dtype)
        w = torch.rand(3, generator=gen).to(dtype) + 0.5
        b = torch.randn(3, generator=gen).to(dtype)
        dy = torch.randn(5, 3, 4, generator=gen).to(dtype)
        xr, wr, br = (t.float().requires_grad_() for t in (x, w, b))
        rm, rv = torch.zeros(3), torch.ones(3)
        y_ref = torch.nn.functional.batch_norm(xr, rm, rv, wr, br, True, 0.1, 1e-5)
        y_ref.backward(dy.float())
        d = "sim:0"
        xd, wd, bd, dyd = (t.to(d) for t in (x, w, b, dy))
        drm, drv = torch.zeros(3, device=d), torch.ones(3, device=d)
        mean, invstd = torch.batch_norm_stats(xd, 1e-5)
        count = torch.tensor([x.numel() // 3], dtype=torch.float32, device=d)
        mean, invstd = torch.batch_norm_gather_stats_with_counts(
            xd, mean[None], invstd[None], drm, drv, 0.1, 1e-5, count)
        y = torch.batch_norm_elemt(xd, wd, bd, mean, invstd, 1e-5)
        sum_dy, sum_dy_xmu, gw, gb = torch.batch_norm_backward_reduce(
            dyd, xd, mean, invstd, wd, True, True, True)
        gx = torch.batch_norm_backward_elemt(dyd, xd, mean, invstd, wd, sum_dy, sum_dy_xmu,
                                             count.int())
        assert y.dtype == dtype and gx.dtype == dtype and y.device == torch.device(d)
        for got, want in ((y, y_ref), (gx, xr.grad), (gw, wr.grad), (gb, br.grad),
                          (drm, rm), (drv, rv)):
            assert torch.allclose(got.cpu().float(), want.detach(), atol=tol, rtol=tol), \
                (dtype, got, want)


# =========================================================================== workers
def _batches(torch, steps: int, shape_x: tuple[int, ...], shape_y: tuple[int, ...]):
    """batches[rank][step][0] = (x, y), the same on every rank (each builds all of them)."""
    gen = torch.Generator().manual_seed(7)
    return [[[(torch.randn(*shape_x, generator=gen), torch.randn(*shape_y, generator=gen))]
             for _ in range(steps)] for _ in range(WORLD)]


def _same_on_all_ranks(torch, dist, tensors) -> bool:
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    copies = [torch.zeros_like(flat) for _ in range(WORLD)]
    dist.all_gather(copies, flat)
    return all(torch.equal(copies[0].cpu(), c.cpu()) for c in copies)


def _close(torch, failures: list[str], label: str, got, want, atol=1e-5, rtol=1e-4) -> None:
    got = got.detach().cpu()
    want = want.detach().cpu()
    if got.shape != want.shape or not torch.allclose(got, want, atol=atol, rtol=rtol):
        err = (got - want).abs().max().item() if got.shape == want.shape else "shape"
        failures.append(f"{label}: differs by {err}")


def _syncbn(rank: int, port: int) -> None:
    import warnings

    warnings.simplefilter("ignore")
    torch, dist, dev = init_rank(rank, port)
    from torch.nn.parallel import DistributedDataParallel as DDP

    failures: list[str] = []
    # 1. One step with unequal batch sizes (3 and 5): outputs, input gradients, running
    #    statistics and (summed) weight gradients equal BatchNorm2d on the concatenation.
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(3 + 2 * r, 4, 5, 5, generator=gen) for r in range(WORLD)]
    ws = [torch.randn(3 + 2 * r, 4, 5, 5, generator=gen) for r in range(WORLD)]
    ref = torch.nn.BatchNorm2d(4)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5, generator=gen)
        ref.bias.uniform_(-0.5, 0.5, generator=gen)
    sbn = torch.nn.SyncBatchNorm.convert_sync_batchnorm(
        torch.nn.Sequential(torch.nn.BatchNorm2d(4))).to(dev)
    sbn[0].load_state_dict(ref.state_dict())
    assert isinstance(sbn[0], torch.nn.SyncBatchNorm)
    x_all = torch.cat(xs).requires_grad_()
    y_all = ref(x_all)
    (y_all * torch.cat(ws)).sum().backward()
    x = xs[rank].to(dev).requires_grad_()
    y = sbn(x)
    (y * ws[rank].to(dev)).sum().backward()
    lo = sum(t.shape[0] for t in xs[:rank])
    hi = lo + xs[rank].shape[0]
    _close(torch, failures, "output", y, y_all[lo:hi])
    _close(torch, failures, "input grad", x.grad, x_all.grad[lo:hi])
    _close(torch, failures, "running_mean", sbn[0].running_mean, ref.running_mean)
    _close(torch, failures, "running_var", sbn[0].running_var, ref.running_var)
    for name in ("weight", "bias"):
        g = getattr(sbn[0], name).grad.clone()
        dist.all_reduce(g)  # each rank holds its share; DDP would reduce them
        _close(torch, failures, f"{name} grad", g, getattr(ref, name).grad)

    # 2. DDP training with SyncBatchNorm equals single-process training on the whole batch.
    def net():
        torch.manual_seed(11)
        return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1),
                                   torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                   torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 2))

    steps = 6
    batches = _batches(torch, steps, (4, 3, 4, 4), (4, 2))
    model = DDP(torch.nn.SyncBatchNorm.convert_sync_batchnorm(net()).to(dev))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    cpu = net()
    cpu_opt = torch.optim.SGD(cpu.parameters(), lr=0.05)
    for s in range(steps):
        xb, yb = (t.to(dev) for t in batches[rank][s][0])
        torch.nn.functional.mse_loss(model(xb), yb).backward()
        opt.step()
        opt.zero_grad()
        xc, yc = (torch.cat([b[s][0][i] for b in batches]) for i in (0, 1))
        torch.nn.functional.mse_loss(cpu(xc), yc).backward()
        cpu_opt.step()
        cpu_opt.zero_grad()
    if not _same_on_all_ranks(torch, dist, list(model.module.state_dict().values())):
        failures.append("DDP+SyncBatchNorm: ranks differ")
    for (n, a), b in zip(model.module.state_dict().items(), cpu.state_dict().values(),
                         strict=True):
        if a.dtype.is_floating_point:
            _close(torch, failures, f"DDP+SyncBatchNorm {n}", a, b, atol=1e-4, rtol=1e-3)
        elif not torch.equal(a.cpu(), b):
            failures.append(f"DDP+SyncBatchNorm {n}: {a} != {b}")
    dist.destroy_process_group()
    if failures:
        raise SystemExit("\n".join(failures))
    print("syncbn ok")


def _fsdp_dcp(rank: int, port: int) -> None:
    import warnings

    warnings.simplefilter("ignore")
    torch, dist, dev = init_rank(rank, port)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel as DDP

    failures: list[str] = []
    steps = 20
    batches = [[[b[0]] for b in per_rank] for per_rank in _batches(torch, steps, (4, 8), (4, 4))]

    def train(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for s in range(steps):
            x, y = (t.to(dev) for t in batches[rank][s][0])
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        return opt

    ddp = DDP(ddp_mlp().to(dev))
    train(ddp)
    fsdp = ddp_mlp().to(dev)
    fully_shard(fsdp.a)
    fully_shard(fsdp.b)
    fully_shard(fsdp)
    fsdp_opt = train(fsdp)
    ref = ddp_reference(steps, batches)
    full = {}
    for (n, p), q, r in zip(fsdp.named_parameters(), ddp.module.parameters(),
                            ref.parameters(), strict=True):
        if not isinstance(p, DTensor) or p.to_local().device != dev:
            failures.append(f"fsdp {n}: expected a DTensor sharded on {dev}, got {type(p)}")
            continue
        full[n] = p.full_tensor()
        if full[n].device != dev:
            failures.append(f"fsdp {n}: full_tensor() on {full[n].device}")
        _close(torch, failures, f"fsdp vs ddp {n}", full[n], q)
        _close(torch, failures, f"fsdp vs single process {n}", full[n], r)

    # Distributed checkpoints: DDP's state dict (replicated) and FSDP2's (sharded DTensors,
    # with the optimizer state) are saved by both ranks and loaded into fresh models.
    root = Path(os.environ["TP_CKPT_DIR"])
    dcp.save({"model": ddp.state_dict()}, checkpoint_id=str(root / "ddp"))
    ddp2 = DDP(ddp_mlp().to(dev))
    with torch.no_grad():
        for p in ddp2.parameters():
            p.zero_()
    sd = {"model": ddp2.state_dict()}
    dcp.load(sd, checkpoint_id=str(root / "ddp"))
    ddp2.load_state_dict(sd["model"])
    for (n, a), b in zip(ddp2.named_parameters(), ddp.parameters(), strict=True):
        if a.device != dev or not torch.equal(a.detach().cpu(), b.detach().cpu()):
            failures.append(f"dcp ddp {n}: not restored on {dev}")

    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(fsdp, fsdp_opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(root / "fsdp"))
    fsdp2 = ddp_mlp()
    with torch.no_grad():
        for p in fsdp2.parameters():
            p.zero_()
    fsdp2 = fsdp2.to(dev)
    fully_shard(fsdp2)
    opt2 = torch.optim.SGD(fsdp2.parameters(), lr=0.05)
    msd2, osd2 = get_state_dict(fsdp2, opt2)
    state = {"model": msd2, "optim": osd2}
    dcp.load(state, checkpoint_id=str(root / "fsdp"))
    set_state_dict(fsdp2, opt2, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    for n, p in fsdp2.named_parameters():
        _close(torch, failures, f"dcp fsdp {n}", p.full_tensor(), full[n], atol=0, rtol=0)
        if p.to_local().device != dev:
            failures.append(f"dcp fsdp {n}: loaded on {p.to_local().device}")
    dist.destroy_process_group()
    if failures:
        raise SystemExit("\n".join(failures))
    print("fsdp_dcp ok")


def _find_unused(rank: int, port: int) -> None:
    import warnings

    warnings.simplefilter("ignore")
    torch, dist, dev = init_rank(rank, port)
    from torch.nn.parallel import DistributedDataParallel as DDP

    steps = 5
    batches = [[[b[0]] for b in per_rank] for per_rank in _batches(torch, steps, (4, 8), (4, 4))]
    ref = ddp_reference(steps, batches, unused=True)
    failures: list[str] = []
    # Both modes reduce the map of used parameters through the same pinned staging buffer.
    for kw in ({"find_unused_parameters": True}, {"static_graph": True}):
        model = DDP(ddp_mlp(unused=True).to(dev), **kw)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for s in range(steps):
            x, y = (t.to(dev) for t in batches[rank][s][0])
            try:
                torch.nn.functional.mse_loss(model(x), y).backward()
            except NotImplementedError as e:  # the 2.13 limitation: fail fast, skip teardown
                print(f"{kw}: {e}", flush=True)
                os._exit(3)
            if model.module.unused.weight.grad is not None:
                failures.append(f"{kw}: the globally unused parameter got a gradient")
            opt.step()
            opt.zero_grad()
        for (n, p), q in zip(model.module.named_parameters(), ref.parameters(), strict=True):
            _close(torch, failures, f"{kw} {n}", p, q)
    dist.destroy_process_group()
    if failures:
        raise SystemExit("\n".join(failures))
    print("find_unused ok")


if __name__ == "__main__":
    _scenario, _rank, _port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    {"syncbn": _syncbn, "fsdp_dcp": _fsdp_dcp,
     "find_unused": _find_unused}[_scenario](_rank, _port)
