"""Fine-tune a (tiny, randomly initialised) BERT classifier with the Hugging Face ``Trainer``
and its default settings: whatever device the Trainer picks, fused AdamW where supported,
``--precision bf16|fp16`` for mixed precision (fp16 uses a GradScaler).

    python hf_trainer.py --steps 6 --precision fp32
"""

import argparse
import tempfile

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments


class ToyTexts(torch.utils.data.Dataset):
    """Token sequences whose label is whether token 7 occurs (no downloads needed)."""

    def __init__(self, n, seq_len=12, vocab=64, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(8, vocab, (n, seq_len), generator=g)
        self.labels = torch.randint(0, 2, (n,), generator=g)
        self.ids[self.labels == 1, 3] = 7

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]),
                "labels": self.labels[i]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=8, help="per device")
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
    args = parser.parse_args()

    torch.manual_seed(0)
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=32, num_labels=2,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertForSequenceClassification(config)
    with tempfile.TemporaryDirectory() as out:
        training_args = TrainingArguments(
            output_dir=out, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
            learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no", seed=0,
            bf16=args.precision == "bf16", fp16=args.precision == "fp16",
            disable_tqdm=True)
        trainer = Trainer(model=model, args=training_args, train_dataset=ToyTexts(64))
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print(f"device {training_args.device} n_gpu {training_args.n_gpu} "
          f"optimizer {type(trainer.optimizer.optimizer).__name__} "
          f"fused {trainer.optimizer.optimizer.defaults.get('fused')}")
    print(f"result losses {losses!r}")
    print(f"result checksum {sum(p.double().sum().item() for p in model.parameters())!r}")


if __name__ == "__main__":
    main()
