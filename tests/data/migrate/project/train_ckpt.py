"""Train a tiny classifier on GPU, checkpoint it and resume from the checkpoint.

    python train_ckpt.py --epochs 2            # on a GPU
    python train_ckpt.py --epochs 2 --no-cuda  # on the CPU
"""

import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from data_utils import accuracy, make_blobs, seed_everything
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self, d_in: int = 8, hidden: int = 16, classes: int = 3):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def pick_device(no_cuda: bool) -> str:
    if no_cuda:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def train_epoch(model, dev, loader, optimizer):
    model.train()
    total = 0.0
    for data, target in loader:
        data, target = data.to(dev), target.to(dev)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()
        total += loss.item() * data.size(0)
    return total


def main():
    parser = argparse.ArgumentParser(description="checkpoint and resume")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--no-cuda", action="store_true", help="disables CUDA training")
    parser.add_argument("--ckpt", default="checkpoint.pt")
    args = parser.parse_args()

    use_cuda = not args.no_cuda and torch.cuda.is_available()
    seed_everything(0)
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(rank)
        args.accel = "cuda"
        map_location = f"cuda:{rank}"
    else:
        args.accel = "cpu"
        map_location = "cpu"
    dev = pick_device(args.no_cuda)
    print("running on", dev)

    loader_kwargs = {"batch_size": args.batch_size}
    if use_cuda:
        cuda_kwargs = {"num_workers": 1, "pin_memory": True, "shuffle": False}
        loader_kwargs.update(cuda_kwargs)
    x, y = make_blobs(96)
    loader = DataLoader(TensorDataset(x, y), **loader_kwargs)

    model = Net()
    if use_cuda:
        model.cuda(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    for epoch in range(args.epochs):
        total = train_epoch(model, dev, loader, optimizer)
        print(f"epoch {epoch} loss {total / len(x):.6f}")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "epoch": args.epochs}, args.ckpt)

    # resume: a new model and optimizer from the checkpoint, one more epoch
    checkpoint = torch.load(args.ckpt, map_location=map_location)
    restored = Net().to(args.accel)
    restored.load_state_dict(checkpoint["model"])
    optimizer = torch.optim.SGD(restored.parameters(), lr=args.lr, momentum=0.9)
    optimizer.load_state_dict(checkpoint["optimizer"])
    weight = next(restored.parameters())
    print("restored on", "gpu" if "cuda" in str(weight.device) else "cpu")
    total = train_epoch(restored, dev, loader, optimizer)
    print(f"epoch {checkpoint['epoch']} loss {total / len(x):.6f}")
    if dev == "cuda":
        torch.cuda.synchronize()
    target = y.cuda(rank) if use_cuda else y
    with torch.no_grad():
        logits = restored(x.to(dev))
        final = F.cross_entropy(logits, target).item()
    checksum = sum(p.detach().double().sum().item() for p in restored.parameters())
    print(f"final loss {final:.6f}")
    print(f"accuracy {accuracy(logits.cpu(), y):.4f}")
    print(f"params checksum {checksum:.6f}")


if __name__ == "__main__":
    main()
