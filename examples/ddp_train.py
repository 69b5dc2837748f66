"""Data-parallel training on the sim device, one device per rank.

    .venv/bin/torchrun --nproc_per_node=2 examples/ddp_train.py              # DDP
    .venv/bin/torchrun --nproc_per_node=2 examples/ddp_train.py --sync-bn    # + SyncBatchNorm
    .venv/bin/torchrun --nproc_per_node=2 examples/ddp_train.py --fsdp       # FSDP2 (fully_shard)

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous; each rank takes
``sim:<LOCAL_RANK % device_count>`` and ``init_process_group()`` picks ``simccl``.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import torchport.sim  # noqa: F401  (registers the sim device and the simccl backend)
from torchport.distributed import init_device_from_env


def main(steps: int = 20, fsdp: bool = False, sync_bn: bool = False) -> None:
    """Train a small MLP on random regression data and print the loss on rank 0."""
    device = init_device_from_env()
    dist.init_process_group()  # sim tensors -> simccl; CPU tensors -> Gloo
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # same initial weights everywhere (DDP broadcasts them anyway)
    layers = [torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)]
    if sync_bn:  # batch statistics over all ranks' batches
        layers.insert(1, torch.nn.SyncBatchNorm(32))
    model = torch.nn.Sequential(*layers).to(device)
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)  # each rank keeps its shard of this layer's parameters
        wrapped = fully_shard(model)
    else:
        wrapped = DDP(model)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own shard of data
    for step in range(steps):
        x = torch.randn(32, 16, generator=gen)
        y = x.sum(dim=1, keepdim=True)
        loss = torch.nn.functional.mse_loss(wrapped(x.to(device)), y.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and step % 5 == 0:
            print(f"step {step:3d} loss {loss.item():.4f} (world {world}, {backend()})")
    if fsdp:  # sharded DTensor parameters: gather the full values to compare
        params = [p.full_tensor() for p in model.parameters()]
    else:
        params = list(model.parameters())
    # Every rank holds the same parameters after training.
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    copies = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(copies, flat)
    assert all(torch.equal(copies[0].cpu(), c.cpu()) for c in copies), "ranks diverged"
    if rank == 0:
        print("done: parameters identical on all ranks")
    dist.destroy_process_group()


def backend() -> str:
    """The backend serving sim tensors (``dist.get_backend()`` says "undefined" when
    init_process_group chose by device)."""
    return dist.group.WORLD.name()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--fsdp", action="store_true", help="shard with FSDP2 instead of DDP")
    ap.add_argument("--sync-bn", action="store_true", help="add a SyncBatchNorm layer")
    a = ap.parse_args()
    main(a.steps, fsdp=a.fsdp, sync_bn=a.sync_bn)
