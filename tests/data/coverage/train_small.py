"""A tiny training loop on the sim device, for the coverage tests (runs in well under a second)."""

import argparse

import torch

import torchport.sim  # noqa: F401


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--exit", type=int, default=0, help="exit with this code at the end")
    args = p.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 4)).to("sim")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 8), torch.randn(32, 4)
    for _ in range(args.steps):
        xb, yb = x.to("sim"), y.to("sim")
        loss = torch.nn.functional.mse_loss(model(xb).log_softmax(-1), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"final loss {loss.item():.6f}")
    if args.exit:
        raise SystemExit(args.exit)


if __name__ == "__main__":
    main()
