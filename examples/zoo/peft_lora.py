"""LoRA fine-tuning of a tiny causal language model with peft, as CUDA code.

The shape of peft's causal-LM examples: a Llama-architecture model (here built from a tiny
config, no download), ``get_peft_model`` with a ``LoraConfig`` on the attention
projections, only the adapters trainable, AdamW over them, ``labels=input_ids`` for the
shifted causal loss, a few steps; then the adapters merged into the base weights and a
greedy ``generate``. The text is a seeded synthetic token stream.

Prints ``result losses``, ``result merged`` (a checksum of the merged weights),
``result generated`` (the greedy continuation) and a ``timing`` line.
"""

from __future__ import annotations

import argparse
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=16)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64)
    base = LlamaForCausalLM(config)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                      task_type="CAUSAL_LM", init_lora_weights="gaussian")
    model = get_peft_model(base, lora).to(device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=5e-3)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, config.vocab_size, (64, args.seq_len), generator=g)

    losses, times = [], []
    model.train()
    for step in range(args.steps):
        t0 = time.perf_counter()
        i = (step * args.batch_size) % len(data)
        batch = data[i:i + args.batch_size].to(device)
        out = model(input_ids=batch, attention_mask=torch.ones_like(batch), labels=batch)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(out.loss.item())
        times.append(time.perf_counter() - t0)

    merged = model.merge_and_unload()
    merged.eval()
    with torch.no_grad():
        generated = merged.generate(data[:1, :4].to(device), max_new_tokens=6, do_sample=False,
                                    pad_token_id=0)
    print(f"device {device} trainable {sum(p.numel() for p in trainable)}")
    print(f"result losses {losses!r}")
    print(f"result merged {sum(p.double().sum().item() for p in merged.parameters())!r}")
    print(f"result generated {generated.tolist()!r}")
    steady = sorted(times[1:]) or times
    print(f"timing step_ms {1000 * steady[len(steady) // 2]:.3f}")


if __name__ == "__main__":
    main()
