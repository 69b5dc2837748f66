"""DDP training on the sim device, one device per rank.

    .venv/bin/torchrun --nproc_per_node=2 examples/ddp_train.py

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous; each rank takes
``sim:<LOCAL_RANK % device_count>`` and ``init_process_group()`` picks ``simccl``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import torchport.sim  # noqa: F401  (registers the sim device and the simccl backend)
from torchport.distributed import init_device_from_env


def main(steps: int = 20) -> None:
    """Train a small MLP on random regression data and print the loss on rank 0."""
    device = init_device_from_env()
    dist.init_process_group()  # sim tensors -> simccl; CPU tensors -> Gloo
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # same initial weights everywhere (DDP broadcasts them anyway)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 1)).to(device)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own shard of data
    for step in range(steps):
        x = torch.randn(32, 16, generator=gen)
        y = x.sum(dim=1, keepdim=True)
        loss = torch.nn.functional.mse_loss(ddp(x.to(device)), y.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and step % 5 == 0:
            print(f"step {step:3d} loss {loss.item():.4f} (world {world}, {backend()})")
    # Every rank holds the same parameters after training.
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
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
    main()
