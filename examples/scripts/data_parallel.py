"""Single-process multi-GPU training with ``nn.DataParallel``, the way the ImageNet example
and many older scripts do it: wrap when more than one GPU is visible, then ``.cuda()``.

    python data_parallel.py --steps 5
"""

import argparse

import torch
import torch.nn as nn


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                                      nn.MaxPool2d(2), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.classifier = nn.Linear(8 * 4 * 4, 5)

    def forward(self, x):
        return self.classifier(torch.flatten(self.features(x), 1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = ConvNet().double()
    if torch.cuda.is_available():
        if torch.cuda.device_count() > 1:
            print(f"DataParallel over {torch.cuda.device_count()} GPUs")
            model = torch.nn.DataParallel(model).cuda()
        else:
            model = model.cuda()
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    for step in range(args.steps):
        images = torch.randn(args.batch_size, 3, 8, 8, generator=g, dtype=torch.float64)
        target = torch.randint(0, 5, (args.batch_size,), generator=g)
        if torch.cuda.is_available():
            images, target = images.cuda(non_blocking=True), target.cuda(non_blocking=True)
        output = model(images)
        loss = criterion(output, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"step {step} loss {loss.item():.6f}")
    print(f"result loss {loss.item()!r}")
    print(f"result checksum {sum(p.double().sum().item() for p in model.parameters())!r}")


if __name__ == "__main__":
    main()
