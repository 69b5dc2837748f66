"""Distributed data parallel training started with ``torch.multiprocessing.spawn``, one
process per GPU, NCCL when CUDA is there (gloo otherwise), a DistributedSampler, and rank 0
saving a checkpoint that every rank loads back with ``map_location=f"cuda:{rank}"``.

    python ddp_spawn.py --world-size 2 --epochs 2
"""

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def worker(rank, world_size, args, port, ckpt):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world_size)
    device = torch.device(f"cuda:{rank}") if use_cuda else torch.device("cpu")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)).to(device)
    ddp = DDP(model, device_ids=[rank] if use_cuda else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 8, generator=g)
    y = x.sum(dim=1, keepdim=True).tanh()
    ds = TensorDataset(x, y)
    sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True, seed=3)
    loader = DataLoader(ds, batch_size=16, sampler=sampler, pin_memory=use_cuda)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            loss = nn.functional.mse_loss(ddp(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
    if rank == 0:
        torch.save(ddp.module.state_dict(), ckpt)
    dist.barrier()
    map_location = f"cuda:{rank}" if use_cuda else "cpu"
    state = torch.load(ckpt, map_location=map_location)
    same = all(torch.equal(state[k], v) for k, v in ddp.module.state_dict().items())
    total = torch.tensor([loss.item()], device=device)
    dist.all_reduce(total)
    if rank == 0:
        print(f"world {dist.get_world_size()} backend {dist.get_backend()}")
        print(f"result checkpoint_matches {same}")
        print(f"result loss_sum {total.item()!r}")
        print(f"result checksum {sum(p.double().sum().item() for p in model.parameters())!r}")
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--port", type=int, default=29512)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(args.world_size, args, args.port, os.path.join(tmp, "ddp.pt")),
                 nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
