"""Inference from a checkpoint saved on a GPU (storages tagged ``cuda:0``).

    python infer_checkpoint.py model.pt               # on a GPU
    torchport run infer_checkpoint.py model.pt        # unchanged, on a torchport device
    python infer_checkpoint.py model.pt --cpu         # map_location="cpu"

The checkpoint is ``{"model": state_dict, "epoch": int}`` for :class:`Classifier`.
"""

import argparse

import torch
import torch.nn as nn


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(10, 20), nn.GELU(), nn.LayerNorm(20))
        self.head = nn.Linear(20, 3)

    def forward(self, x):
        return self.head(self.body(x))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("checkpoint")
    p.add_argument("--cpu", action="store_true")
    args = p.parse_args()

    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    ckpt = torch.load(args.checkpoint, map_location=device)
    model = Classifier().to(device)
    model.load_state_dict(ckpt["model"])
    model.eval()

    torch.manual_seed(1)
    batch = torch.randn(16, 10).to(device)
    with torch.inference_mode():
        probs = model(batch).softmax(dim=-1)
    print(f"loaded epoch {ckpt['epoch']} on {next(model.parameters()).device}")
    print(f"predictions {probs.argmax(-1).tolist()}")
    print(f"probs checksum {probs.double().sum(0).mul(torch.arange(1, 4, device=device)).sum().item():.6f}")


if __name__ == "__main__":
    main()
