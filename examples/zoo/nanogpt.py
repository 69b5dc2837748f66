"""A nanoGPT-shaped GPT trained the way nanoGPT's ``train.py`` trains it, as CUDA code.

Written for the zoo, not copied: a causal transformer (token + position embeddings,
pre-LayerNorm blocks of causal self-attention through ``scaled_dot_product_attention`` and
a GELU MLP, tied output head) and nanoGPT's loop: device and dtype chosen from
``torch.cuda``, ``torch.amp.autocast`` around the forward pass, a ``GradScaler`` enabled for
float16 only, gradient accumulation with ``no_sync`` under DDP, gradient clipping, fused
AdamW on CUDA with decay only on 2-D weights, a cosine learning rate with warm-up,
``torch.compile``, TF32 switches, batches moved with ``pin_memory().to(non_blocking=True)``,
and DDP when launched by ``torchrun`` (``RANK`` in the environment, NCCL). The data is a
seeded synthetic token stream (nanoGPT reads a memmap of a tokenised corpus).

Prints ``result losses [...]`` (every iteration's loss, all ranks averaged by DDP's
gradient sums as nanoGPT logs rank 0) and ``result checksum`` of the weights, and a
``timing`` line (milliseconds per iteration after the first, which compiles).
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import time
from contextlib import nullcontext

import torch
import torch.nn as nn
from torch.nn import functional as F  # noqa: N812  (nanoGPT's spelling)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.dropout = n_head, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, block: int, n_layer: int, n_head: int, n_embd: int,
                 dropout: float) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, n_embd), nn.Embedding(block, n_embd)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(
            logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    def configure_optimizers(self, weight_decay: float, lr: float, betas: tuple[float, float],
                             device_type: str, fused: bool | None = None) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        if fused is None:  # nanoGPT: the fused kernel where CUDA is
            fused = "fused" in inspect.signature(torch.optim.AdamW).parameters \
                and device_type == "cuda"
        return torch.optim.AdamW(groups, lr=lr, betas=betas, **({"fused": True} if fused else {}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--compile", type=int, default=1)
    p.add_argument("--fused", type=int, default=None, help="fused AdamW (default: on CUDA)")
    p.add_argument("--backend", default="nccl", help="DDP's process group backend")
    args = p.parse_args()

    ddp = int(os.environ.get("RANK", -1)) != -1
    if ddp:
        torch.distributed.init_process_group(backend=args.backend)
        rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
        world = int(os.environ["WORLD_SIZE"])
        device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
        if torch.cuda.is_available():
            torch.cuda.set_device(device)
        grad_accum = args.grad_accum * world
        assert grad_accum % world == 0
        grad_accum //= world
    else:
        rank, world, grad_accum = 0, 1, args.grad_accum
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device_type = "cuda" if "cuda" in device else "cpu"
    dtype = args.dtype
    if dtype == "auto":
        dtype = "float32" if device_type == "cpu" else (
            "bfloat16" if torch.cuda.is_bf16_supported() else "float16")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
               "float16": torch.float16}[dtype]
    ctx = nullcontext() if dtype == "float32" else torch.amp.autocast(
        device_type=device_type, dtype=ptdtype)

    torch.manual_seed(1337 + rank)
    vocab = 64
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, vocab, (4096,), generator=g)

    def get_batch(it: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        bg = torch.Generator().manual_seed(10_000 * it + 100 * micro + rank)
        ix = torch.randint(len(data) - args.block_size, (args.batch_size,), generator=bg)
        x = torch.stack([data[i:i + args.block_size] for i in ix])
        y = torch.stack([data[i + 1:i + 1 + args.block_size] for i in ix])
        if device_type == "cuda":
            return (x.pin_memory().to(device, non_blocking=True),
                    y.pin_memory().to(device, non_blocking=True))
        return x.to(device), y.to(device)

    torch.manual_seed(1337)  # every rank starts from the same weights, as DDP expects
    model = GPT(vocab, args.block_size, n_layer=2, n_head=2, n_embd=32, dropout=0.0).to(device)
    scaler = torch.amp.GradScaler(device_type, enabled=(dtype == "float16"))
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), device_type,
                                           None if args.fused is None else bool(args.fused))
    raw_model = model
    if args.compile:
        model = torch.compile(model)
    if ddp:
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[local_rank] if device_type == "cuda" else None)

    def lr_at(it: int, warmup: int = 2, max_lr: float = 1e-3, min_lr: float = 1e-4) -> float:
        if it < warmup:
            return max_lr * (it + 1) / (warmup + 1)
        ratio = (it - warmup) / max(1, args.iters - warmup)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (max_lr - min_lr)

    losses, times = [], []
    for it in range(args.iters):
        t0 = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(it)
        total = 0.0
        for micro in range(grad_accum):
            if ddp:  # nanoGPT's idiom: sync gradients on the last micro-step only
                model.require_backward_grad_sync = micro == grad_accum - 1
            x, y = get_batch(it, micro)
            with ctx:
                _, loss = model(x, y)
                loss = loss / grad_accum
            scaler.scale(loss).backward()
            total += loss.item()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if ddp:
            t = torch.tensor([total], device=device)
            torch.distributed.all_reduce(t)
            total = t.item() / world
        losses.append(total)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        print(f"device {device} dtype {dtype} compile {args.compile} world {world}")
        print(f"result losses {losses!r}")
        checksum = sum(p.detach().double().sum().item() for p in raw_model.parameters())
        print(f"result checksum {checksum!r}")
        steady = sorted(times[1:]) or times
        print(f"timing step_ms {1000 * steady[len(steady) // 2]:.3f}")
    if ddp:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
