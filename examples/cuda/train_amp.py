"""Mixed-precision training with ``.cuda()`` and ``torch.cuda.amp`` (autocast + GradScaler).

    python train_amp.py                # on a GPU
    torchport run train_amp.py         # unchanged, on a torchport device
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F


class ConvNet(nn.Module):
    def __init__(self, classes=4):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 4 * 4, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv(x)), 2)
        return self.fc(x.flatten(1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--cpu", action="store_true")
    args = p.parse_args()

    torch.manual_seed(0)
    use_cuda = torch.cuda.is_available() and not args.cpu
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = True

    model = ConvNet()
    if use_cuda:
        model = model.cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.cuda.amp.GradScaler(enabled=use_cuda)

    images = torch.randn(64, 1, 8, 8)
    labels = torch.randint(0, 4, (64,))
    if use_cuda:
        images, labels = images.cuda(non_blocking=True), labels.cuda(non_blocking=True)

    for step in range(args.steps):
        opt.zero_grad()
        with torch.cuda.amp.autocast(enabled=use_cuda):
            logits = model(images)
            loss = F.cross_entropy(logits, labels)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if step % 5 == 0:
            print(f"step {step} loss {loss.item():.4f} logits {logits.dtype}")

    with torch.no_grad():
        acc = (model(images).argmax(1) == labels).float().mean().item()
    print(f"autocast dtype {logits.dtype}")
    print(f"final loss {loss.item():.6f}")
    print(f"accuracy {acc:.4f}")
    print(f"loss scale {scaler.get_scale() if use_cuda else 1.0}")


if __name__ == "__main__":
    main()
