"""Train a small MLP on synthetic regression data -- a typical CUDA training script.

    python train_argparse.py --epochs 5          # on a GPU (or CPU if none)
    torchport run train_argparse.py --epochs 5   # unchanged, on a torchport device
"""

import argparse

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


def parse_args():
    p = argparse.ArgumentParser(description="synthetic regression")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu", action="store_true", help="force CPU")
    return p.parse_args()


class MLP(nn.Module):
    def __init__(self, d_in=16, hidden=64):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                                 nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, x):
        return self.net(x)


def main():
    args = parse_args()
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    torch.backends.cudnn.benchmark = True
    print(f"using device: {device}")
    if device.type != "cpu":
        print(f"gpu: {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}")

    x = torch.randn(256, 16)
    y = (x[:, :4].sum(dim=1, keepdim=True) * 0.5).sin()
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=True,
                        pin_memory=torch.cuda.is_available() and not args.cpu)

    model = MLP().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = nn.MSELoss()
    for epoch in range(args.epochs):
        model.train()
        total = 0.0
        for xb, yb in loader:
            xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(xb), yb)
            loss.backward()
            opt.step()
            total += loss.item() * xb.size(0)
        print(f"epoch {epoch} loss {total / len(x):.6f}")

    if torch.cuda.is_available() and not args.cpu:
        torch.cuda.synchronize()
        print(f"peak memory: {torch.cuda.max_memory_allocated() / 2**10:.1f} KiB")
    model.eval()
    with torch.no_grad():
        final = loss_fn(model(x.to(device)), y.to(device)).item()
    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    print(f"final loss {final:.6f}")
    print(f"params checksum {checksum:.6f}")


if __name__ == "__main__":
    main()
