"""DistributedDataParallel over NCCL, launched with torchrun -- a typical multi-GPU script.

    torchrun --nproc-per-node 2 ddp_nccl.py                           # GPUs, NCCL
    torchrun --nproc-per-node 2 --no-python torchport run ddp_nccl.py # unchanged, torchport
    python ddp_nccl.py --cpu                                          # 1 process, gloo, CPU

Each rank trains on its shard of every global batch; with equal shards and a mean
loss the averaged gradients equal the full-batch gradient, so any world size gives
the same parameters (up to rounding).
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--cpu", action="store_true")
    args = p.parse_args()

    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")

    if args.cpu:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        device = torch.device("cpu")
    else:
        dist.init_process_group(backend="nccl", rank=rank, world_size=world_size)
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)

    torch.manual_seed(0)  # same init and data on every rank
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)).to(device)
    ddp = DDP(model, device_ids=[local_rank] if device.type != "cpu" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x = torch.randn(64, 8)
    y = x.sum(dim=1, keepdim=True).tanh()

    for step in range(args.steps):
        xb = x[rank::world_size].to(device)
        yb = y[rank::world_size].to(device)
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(xb), yb)
        loss.backward()
        opt.step()
        loss_avg = loss.detach().clone()
        dist.all_reduce(loss_avg)
        if rank == 0 and step % 5 == 0:
            print(f"step {step} loss {loss_avg.item() / world_size:.6f}")

    checksum = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum()
    dist.all_reduce(checksum)
    if rank == 0:
        print(f"world size {world_size} backend {dist.get_backend()}")
        print(f"params checksum {checksum.item() / world_size:.6f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
