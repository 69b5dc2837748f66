"""A diffusers ``UNet2DModel`` trained as a DDPM for a few steps, then sampled, as CUDA code.

The shape of diffusers' ``train_unconditional.py``: a small UNet, a ``DDPMScheduler`` adding
noise at random timesteps, an MSE loss on the predicted noise, AdamW with a warm-up
schedule, gradient clipping, an EMA-free loop; then the ``DDPMPipeline``-style reverse
process (``scheduler.step`` for every timestep) drawing samples with a seeded generator.
The images are a seeded synthetic set (blobs on an 8x8 grid).

Prints ``result losses``, ``result samples`` (a checksum of the sampled images) and a
``timing`` line (milliseconds per training step).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F  # noqa: N812
from diffusers import DDPMScheduler, UNet2DModel
from diffusers.optimization import get_cosine_schedule_with_warmup


def images(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.full((n, 1, 8, 8), -1.0)
    for i in range(n):
        r, c = torch.randint(0, 5, (2,), generator=g).tolist()
        x[i, 0, r:r + 3, c:c + 3] = 1.0
    return x


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--sample-steps", type=int, default=10)
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"

    torch.manual_seed(0)
    model = UNet2DModel(sample_size=8, in_channels=1, out_channels=1, layers_per_block=1,
                        block_out_channels=(8, 16), norm_num_groups=4,
                        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                        up_block_types=("AttnUpBlock2D", "UpBlock2D")).to(device)
    scheduler = DDPMScheduler(num_train_timesteps=100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2)
    lr_schedule = get_cosine_schedule_with_warmup(optimizer, 2, args.steps)
    data = images(64)
    # The noise is drawn on the device: its generator is not the CPU's (as on CUDA), so the
    # seed is set again after the CPU drew the initial weights, for a run that the CPU repeats.
    torch.manual_seed(1)
    losses, times = [], []
    model.train()
    for step in range(args.steps):
        t0 = time.perf_counter()
        i = (step * args.batch_size) % len(data)
        clean = data[i:i + args.batch_size].to(device)
        noise = torch.randn(clean.shape, device=device)
        t = torch.randint(0, scheduler.config.num_train_timesteps, (clean.shape[0],),
                          device=device).long()
        noisy = scheduler.add_noise(clean, noise, t)
        loss = F.mse_loss(model(noisy, t, return_dict=False)[0], noise)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        lr_schedule.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)

    model.eval()
    scheduler.set_timesteps(args.sample_steps)
    generator = torch.Generator(device=device).manual_seed(0)
    sample = torch.randn((2, 1, 8, 8), generator=generator, device=device)
    with torch.no_grad():
        for t in scheduler.timesteps:
            out = model(sample, t).sample
            sample = scheduler.step(out, t, sample, generator=generator).prev_sample
    sample = (sample / 2 + 0.5).clamp(0, 1)
    print(f"device {device}")
    print(f"result losses {losses!r}")
    print(f"result samples {sample.double().sum().item()!r} {sample.double().square().sum().item()!r}")
    steady = sorted(times[1:]) or times
    print(f"timing step_ms {1000 * steady[len(steady) // 2]:.3f}")


if __name__ == "__main__":
    main()
