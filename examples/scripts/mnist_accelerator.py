"""An MNIST-style classifier in the style of today's pytorch/examples (``torch.accelerator``),
on synthetic 14x14 "digits" so it runs without downloads.

    python mnist_accelerator.py --epochs 2             # on the machine's accelerator, or CPU
    torchport run mnist_accelerator.py --epochs 2      # unchanged, on a torchport device
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self, dropout=0.25):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(2 * dropout)
        self.fc1 = nn.Linear(16 * 5 * 5, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


def synthetic_digits(n, seed):
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, 10, (n,), generator=g)
    data = torch.randn(n, 1, 14, 14, generator=g) * 0.3
    data[torch.arange(n), 0, target, target] += 2.0  # a learnable mark per class
    return TensorDataset(data, target)


def train(args, model, device, train_loader, optimizer, epoch):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        if batch_idx % args.log_interval == 0:
            print(f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_loader.dataset)}]"
                  f"\tLoss: {loss.item():.6f}")
    return loss.item()


def test(model, device, test_loader):
    model.eval()
    test_loss, correct = 0.0, 0
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            pred = output.argmax(dim=1, keepdim=True)
            correct += pred.eq(target.view_as(pred)).sum().item()
    test_loss /= len(test_loader.dataset)
    print(f"Test set: Average loss: {test_loss:.4f}, Accuracy: {correct}/{len(test_loader.dataset)}")
    return test_loss, correct


def main():
    parser = argparse.ArgumentParser(description="PyTorch MNIST-style Example")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--test-batch-size", type=int, default=100)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--gamma", type=float, default=0.7)
    parser.add_argument("--no-accel", action="store_true", help="disables accelerator")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=4)
    parser.add_argument("--save-model", default="")
    parser.add_argument("--dropout", type=float, default=0.25,
                        help="0 makes a run comparable across devices (dropout masks come from "
                             "the device's generator, data shuffling from the CPU's)")
    args = parser.parse_args()

    use_accel = not args.no_accel and torch.accelerator.is_available()
    torch.manual_seed(args.seed)
    if use_accel:
        device = torch.accelerator.current_accelerator()
    else:
        device = torch.device("cpu")
    print(f"device {device.type}")

    train_kwargs = {"batch_size": args.batch_size, "shuffle": True}
    test_kwargs = {"batch_size": args.test_batch_size}
    if use_accel:
        accel_kwargs = {"num_workers": 1, "persistent_workers": True, "pin_memory": True}
        train_kwargs.update(accel_kwargs)
        test_kwargs.update(accel_kwargs)

    train_loader = DataLoader(synthetic_digits(256, 0), **train_kwargs)
    test_loader = DataLoader(synthetic_digits(200, 1), **test_kwargs)

    model = Net(args.dropout).to(device)
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    for epoch in range(1, args.epochs + 1):
        loss = train(args, model, device, train_loader, optimizer, epoch)
        test_loss, correct = test(model, device, test_loader)
        scheduler.step()
    if args.save_model:
        torch.save(model.state_dict(), args.save_model)
    print(f"result train_loss {loss!r}")
    print(f"result test_loss {test_loss!r}")
    print(f"result correct {correct}")
    print(f"result checksum {sum(p.double().sum().item() for p in model.parameters())!r}")


if __name__ == "__main__":
    main()
