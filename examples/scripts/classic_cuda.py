"""A training script in the older CUDA style: ``.cuda()``, ``torch.cuda.*`` calls, cuDNN
flags, a checkpoint saved every epoch and resumed with ``map_location=f"cuda:{gpu}"``.

    python classic_cuda.py --epochs 3 --checkpoint ckpt.pt
    python classic_cuda.py --epochs 3 --resume ckpt.pt      # continues where it stopped
"""

import argparse
import os

import torch
import torch.backends.cudnn as cudnn
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(20, 64), nn.BatchNorm1d(64), nn.ReLU(),
                                  nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 3))

    def forward(self, x):
        return self.body(x)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--gpu", type=int, default=0)
    parser.add_argument("--checkpoint", default="checkpoint.pth.tar")
    parser.add_argument("--resume", default="")
    args = parser.parse_args()

    cudnn.benchmark = True
    cudnn.deterministic = False
    torch.manual_seed(0)
    torch.cuda.manual_seed_all(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"device {device}")

    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 20, generator=g)
    y = (x[:, :3] * torch.tensor([1.0, -2.0, 0.5])).argmax(dim=1)
    loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True,
                        generator=torch.Generator().manual_seed(1),
                        pin_memory=torch.cuda.is_available())

    model = MLP()
    if torch.cuda.is_available():
        torch.cuda.set_device(args.gpu)
        model = model.cuda(args.gpu)
    criterion = nn.CrossEntropyLoss().cuda(args.gpu) if device == "cuda" else nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    start_epoch = 0
    if args.resume:
        if os.path.isfile(args.resume):
            loc = f"cuda:{args.gpu}" if torch.cuda.is_available() else "cpu"
            checkpoint = torch.load(args.resume, map_location=loc)
            start_epoch = checkpoint["epoch"]
            model.load_state_dict(checkpoint["state_dict"])
            optimizer.load_state_dict(checkpoint["optimizer"])
            loader.generator.set_state(checkpoint["loader_rng"])
            print(f"resumed from epoch {start_epoch}")
        else:
            raise SystemExit(f"no checkpoint found at {args.resume}")

    for epoch in range(start_epoch, args.epochs):
        model.train()
        for images, target in loader:
            if torch.cuda.is_available():
                images = images.cuda(args.gpu, non_blocking=True)
                target = target.cuda(args.gpu, non_blocking=True)
            loss = criterion(model(images), target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        print(f"epoch {epoch} loss {loss.item():.5f}")
        torch.save({"epoch": epoch + 1, "state_dict": model.state_dict(),
                    "optimizer": optimizer.state_dict(), "loader_rng": loader.generator.get_state()},
                   args.checkpoint)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        print(f"peak memory {torch.cuda.max_memory_allocated() / 2**20:.2f} MiB")
    print(f"result loss {loss.item()!r}")
    print(f"result checksum {sum(p.double().sum().item() for p in model.parameters())!r}")


if __name__ == "__main__":
    main()
