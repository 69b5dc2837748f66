"""Tiny random Hugging Face models for ``test_models_hf.py``, built from configs in code.

Nothing is downloaded: every model is ``XxxForYyy(XxxConfig(...))`` with a few small
layers, and every input is random token ids, pixels, mel features or audio samples drawn
from a seeded generator. Dropout, layer drop and SpecAugment masking are off so that a
training step is deterministic and the device can be compared with the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers as T

VOCAB = 99
BATCH, SEQ, TARGET = 2, 8, 6
PAD, BOS, EOS = 0, 1, 2

# Decoder-only LM configs share their sizes; every dropout is zero.
_LM = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
           num_attention_heads=4, max_position_embeddings=64, pad_token_id=PAD,
           bos_token_id=BOS, eos_token_id=EOS)
_ENC = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=64, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0)
_S2S = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
            decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0,
            attention_dropout=0.0, activation_dropout=0.0, encoder_layerdrop=0.0,
            decoder_layerdrop=0.0, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS,
            decoder_start_token_id=BOS, forced_eos_token_id=None)
_VIT = dict(image_size=32, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2,
            num_attention_heads=4, intermediate_size=64, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, num_labels=3)


@dataclass(frozen=True)
class Arch:
    """One architecture: how to build it and what a batch of its inputs looks like.

    ``kind`` picks the inputs: ``causal`` (token ids, labels = ids), ``masked`` (token ids,
    labels = ids), ``seq2seq`` (source ids, target labels), ``image`` (pixels, class
    labels), ``ctc`` (raw audio, CTC labels), ``speech2seq`` (mel features, target labels).
    ``tied``: the config ties the output projection to the input embedding; ``sdpa``: its
    attention runs through ``scaled_dot_product_attention`` and can be switched to eager;
    ``moe``: a mixture of experts.
    """

    name: str
    build: Callable[[], T.PreTrainedModel]
    kind: str
    default: bool = False
    tied: bool = False
    sdpa: bool = True
    moe: bool = False

    @property
    def generative(self) -> bool:
        return self.kind in ("causal", "seq2seq", "speech2seq")

    def batch(self, seed: int = 0) -> dict[str, torch.Tensor]:
        """Inputs with labels, on the CPU, the same for every call with the same seed."""
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
        mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        mask[1, :2] = 0  # left padding on the second row: masks reach every attention
        target = torch.randint(3, VOCAB, (BATCH, TARGET), generator=g)
        if self.kind in ("causal", "masked"):
            return {"input_ids": ids, "attention_mask": mask, "labels": ids}
        if self.kind == "seq2seq":
            return {"input_ids": ids, "attention_mask": mask, "labels": target}
        if self.kind == "image":
            return {"pixel_values": torch.randn(BATCH, 3, 32, 32, generator=g),
                    "labels": torch.randint(0, 3, (BATCH,), generator=g)}
        if self.kind == "ctc":
            return {"input_values": torch.randn(BATCH, 1600, generator=g),
                    "labels": torch.randint(3, 16, (BATCH, 4), generator=g)}
        if self.kind == "speech2seq":
            return {"input_features": torch.randn(BATCH, 16, 32, generator=g),
                    "labels": target}
        raise ValueError(f"unknown model kind {self.kind!r}")


def _decoders() -> list[Arch]:
    return [
        Arch("gpt2", lambda: T.GPT2LMHeadModel(T.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=PAD,
            bos_token_id=BOS, eos_token_id=EOS)), "causal", default=True, tied=True),
        Arch("llama", lambda: T.LlamaForCausalLM(T.LlamaConfig(
            **_LM, num_key_value_heads=2)), "causal"),
        Arch("mistral", lambda: T.MistralForCausalLM(T.MistralConfig(
            **_LM, num_key_value_heads=2, sliding_window=4)), "causal"),
        Arch("qwen2", lambda: T.Qwen2ForCausalLM(T.Qwen2Config(
            **_LM, num_key_value_heads=2)), "causal"),
        Arch("gemma", lambda: T.GemmaForCausalLM(T.GemmaConfig(
            **_LM, num_key_value_heads=1, head_dim=8)), "causal", tied=True),
        Arch("opt", lambda: T.OPTForCausalLM(T.OPTConfig(
            vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
            num_attention_heads=4, word_embed_proj_dim=32, max_position_embeddings=64,
            dropout=0.0, attention_dropout=0.0, layerdrop=0.0, pad_token_id=PAD,
            bos_token_id=BOS, eos_token_id=EOS)), "causal", tied=True),
        Arch("gpt_neox", lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(
            **_LM, rotary_pct=0.5, hidden_dropout=0.0, attention_dropout=0.0)), "causal"),
        Arch("phi", lambda: T.PhiForCausalLM(T.PhiConfig(
            **_LM, partial_rotary_factor=0.5, resid_pdrop=0.0, embd_pdrop=0.0,
            attention_dropout=0.0)), "causal"),
        Arch("falcon", lambda: T.FalconForCausalLM(T.FalconConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            hidden_dropout=0.0, attention_dropout=0.0, pad_token_id=PAD, bos_token_id=BOS,
            eos_token_id=EOS)), "causal", tied=True, sdpa=False),
        Arch("bloom", lambda: T.BloomForCausalLM(T.BloomConfig(
            vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, hidden_dropout=0.0,
            attention_dropout=0.0, pad_token_id=PAD, bos_token_id=BOS,
            eos_token_id=EOS)), "causal", tied=True, sdpa=False),
        Arch("mixtral", lambda: T.MixtralForCausalLM(T.MixtralConfig(
            **_LM, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
            output_router_logits=True, router_aux_loss_coef=0.02)), "causal", default=True,
             moe=True),
        Arch("qwen2_moe", lambda: T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(
            **_LM, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=32,
            output_router_logits=True, router_aux_loss_coef=0.02)), "causal", moe=True),
    ]


def _encoders() -> list[Arch]:
    return [
        Arch("bert", lambda: T.BertForMaskedLM(T.BertConfig(**_ENC)), "masked", default=True,
             tied=True),
        Arch("roberta", lambda: T.RobertaForMaskedLM(T.RobertaConfig(
            **{**_ENC, "max_position_embeddings": 66}, pad_token_id=1)), "masked", tied=True),
        Arch("distilbert", lambda: T.DistilBertForMaskedLM(T.DistilBertConfig(
            vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
            max_position_embeddings=64, dropout=0.0, attention_dropout=0.0)), "masked",
             tied=True),
        Arch("albert", lambda: T.AlbertForMaskedLM(T.AlbertConfig(
            **_ENC, embedding_size=16, classifier_dropout_prob=0.0)), "masked", tied=True),
        Arch("electra", lambda: T.ElectraForMaskedLM(T.ElectraConfig(
            **_ENC, embedding_size=16)), "masked", tied=True),
        Arch("deberta_v2", lambda: T.DebertaV2ForMaskedLM(T.DebertaV2Config(
            **_ENC, relative_attention=True, position_buckets=8, max_relative_positions=16,
            pos_att_type=["p2c", "c2p"])), "masked", tied=True, sdpa=False),
    ]


def _seq2seq() -> list[Arch]:
    return [
        Arch("t5", lambda: T.T5ForConditionalGeneration(T.T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, dropout_rate=0.0, pad_token_id=PAD,
            eos_token_id=EOS, decoder_start_token_id=PAD)), "seq2seq", default=True,
             tied=True),
        Arch("bart", lambda: T.BartForConditionalGeneration(T.BartConfig(**_S2S)), "seq2seq",
             tied=True),
        Arch("marian", lambda: T.MarianMTModel(T.MarianConfig(**_S2S)), "seq2seq", tied=True),
        Arch("pegasus", lambda: T.PegasusForConditionalGeneration(T.PegasusConfig(**_S2S)),
             "seq2seq", tied=True),
    ]


def _vision() -> list[Arch]:
    return [
        Arch("vit", lambda: T.ViTForImageClassification(T.ViTConfig(**_VIT)), "image"),
        Arch("deit", lambda: T.DeiTForImageClassification(T.DeiTConfig(**_VIT)), "image"),
        Arch("convnext", lambda: T.ConvNextForImageClassification(T.ConvNextConfig(
            num_channels=3, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1],
            drop_path_rate=0.0, num_labels=3)), "image", default=True, sdpa=False),
        Arch("resnet", lambda: T.ResNetForImageClassification(T.ResNetConfig(
            num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
            layer_type="basic", num_labels=3)), "image", sdpa=False),
        Arch("swin", lambda: T.SwinForImageClassification(T.SwinConfig(
            image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
            window_size=4, drop_path_rate=0.0, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, num_labels=3)), "image"),
    ]


def _speech() -> list[Arch]:
    return [
        Arch("whisper", lambda: T.WhisperForConditionalGeneration(T.WhisperConfig(
            vocab_size=VOCAB, num_mel_bins=16, d_model=32, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
            decoder_ffn_dim=64, max_source_positions=16, max_target_positions=32,
            dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
            encoder_layerdrop=0.0, decoder_layerdrop=0.0, pad_token_id=PAD,
            bos_token_id=BOS, eos_token_id=EOS, decoder_start_token_id=BOS,
            suppress_tokens=None, begin_suppress_tokens=None)), "speech2seq", default=True,
             tied=True),
        Arch("wav2vec2", lambda: T.Wav2Vec2ForCTC(T.Wav2Vec2Config(
            vocab_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 4), conv_kernel=(10, 8),
            num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, hidden_dropout=0.0,
            activation_dropout=0.0, attention_dropout=0.0, feat_proj_dropout=0.0,
            final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0, mask_feature_prob=0.0,
            pad_token_id=0, ctc_loss_reduction="mean")), "ctc", default=True),
    ]


ARCHS: list[Arch] = [*_decoders(), *_encoders(), *_seq2seq(), *_vision(), *_speech()]


def build(arch: Arch) -> T.PreTrainedModel:
    """``arch``'s model on the CPU, in float32, with the same weights on every call."""
    torch.manual_seed(0)
    return arch.build().float()
