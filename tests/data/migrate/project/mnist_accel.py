"""An MNIST-style classifier written for any accelerator, as pytorch/examples now does:
``torch.accelerator`` picks the device, and only DataLoader's options mention pinning.

    python mnist_accel.py --epochs 2
    python mnist_accel.py --epochs 2 --no-accel
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, 1)
        self.fc = nn.Linear(4 * 6 * 6, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv(x)), 2)
        return F.log_softmax(self.fc(torch.flatten(x, 1)), dim=1)


def main():
    parser = argparse.ArgumentParser(description="PyTorch MNIST-style example")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--no-accel", action="store_true", help="disables the accelerator")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    use_accel = not args.no_accel and torch.accelerator.is_available()
    torch.manual_seed(args.seed)
    if use_accel:
        device = torch.accelerator.current_accelerator()
    else:
        device = torch.device("cpu")
    print(f"device type {device.type}")

    train_kwargs = {"batch_size": args.batch_size, "shuffle": True}
    if use_accel:
        accel_kwargs = {"num_workers": 1, "pin_memory": True}
        train_kwargs.update(accel_kwargs)
    images = torch.rand(64, 1, 14, 14)
    labels = torch.randint(0, 10, (64,))
    train_loader = DataLoader(TensorDataset(images, labels), **train_kwargs)

    model = Net().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    for epoch in range(1, args.epochs + 1):
        model.train()
        for data, target in train_loader:
            data, target = data.to(device), target.to(device)
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
        print(f"epoch {epoch} loss {loss.item():.6f}")
    model.eval()
    with torch.no_grad():
        output = model(images.to(device))
        final = F.nll_loss(output, labels.to(device)).item()
    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    print(f"final loss {final:.6f}")
    print(f"params checksum {checksum:.6f}")


if __name__ == "__main__":
    main()
