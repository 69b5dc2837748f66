"""Hugging Face ``Trainer`` and ``accelerate`` with their default settings pick the device.

A migrated script imports ``torchport.sim`` and leaves the rest to the libraries: the
Trainer's ``TrainingArguments`` and ``accelerate.Accelerator()`` must choose the device as
they choose a GPU, accept ``bf16=True`` and ``fp16=True`` (a GradScaler of the device), and
their default optimizer, fused AdamW, must run as a device kernel. Each run is compared
with the same run on the CPU (``use_cpu=True`` / ``Accelerator(cpu=True)``), same seed,
same weights: the fp32 math (forward, backward, gradient clipping, fused AdamW) is the
CPU's, so the loss curves and the final weights agree bit for bit. Mixed precision cannot:
CUDA's autocast policy (the device's) casts other ops than the CPU's, so those runs check
that autocast ran on the device in the right dtype and that the losses are finite and near
the fp32 ones.

The model is a two-layer BERT of hidden size 32 built from a config (nothing downloaded),
dropout off: on the device, as on CUDA, dropout draws from the device's generator while
the CPU run's masks come from the CPU generator, which the data loader's shuffling also
draws from, so the masks would differ (the math would not).
``TORCHPORT_FULL_MODELS=1`` adds a GPT-2 Trainer run (marked ``slow``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import torchport.ops as ops
from tests.helpers import python_host_kernels

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

from accelerate.state import AcceleratorState, GradientState, PartialState  # noqa: E402

pytestmark = pytest.mark.modes

transformers.logging.set_verbosity_error()

FULL = os.environ.get("TORCHPORT_FULL_MODELS", "") not in ("", "0")
DEVICE = "sim"
VOCAB, SEQ, EXAMPLES = 99, 8, 12


def _bert() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0))


class _Data(torch.utils.data.Dataset):
    """Token ids with labels, in memory; the second half of the rows is left-padded."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(3, VOCAB, (EXAMPLES, SEQ), generator=g)
        self.mask = torch.ones(EXAMPLES, SEQ, dtype=torch.long)
        self.mask[EXAMPLES // 2:, :2] = 0

    def __len__(self) -> int:
        return EXAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.ids[i]}


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> Iterator[None]:
    """accelerate keeps one process-wide state; each run starts from none, as a script does."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


class _LossTrainer(transformers.Trainer):
    """Keeps every training step's loss as a tensor (the logs round it)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.losses: list[torch.Tensor] = []

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        loss = super().training_step(*args, **kwargs)
        self.losses.append(loss.detach().float().cpu())
        return loss


def _args(tmp: Path, **kw: Any) -> transformers.TrainingArguments:
    kw = {"save_strategy": "no", **kw}
    return transformers.TrainingArguments(output_dir=str(tmp), max_steps=3, report_to=[],
                                          per_device_train_batch_size=4, disable_tqdm=True,
                                          **kw)


def _train(tmp: Path, make_model: Any = _bert, **kw: Any) -> tuple[_LossTrainer, torch.Tensor]:
    """A Trainer run of three steps; the trainer and its losses."""
    trainer = _LossTrainer(model=make_model(), args=_args(tmp, **kw), train_dataset=_Data())
    trainer.train()
    return trainer, torch.stack(trainer.losses)


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    pb = dict(b.named_parameters())
    for name, p in a.named_parameters():
        torch.testing.assert_close(p.detach().cpu(), pb[name].detach().cpu(), rtol=0, atol=0,
                                   msg=lambda m, name=name: f"{name}: {m}")


def _ran(rec: ops.Recorder, name: str, dtype: str) -> bool:
    """Did ``name`` (an op name, any overload) run on the device with ``dtype``?"""
    return any(k.split(".")[0] == name and dtype in s.dtypes for k, s in rec.ops.items())


# ---- the libraries' choice of device -------------------------------------------------------
def test_accelerate_picks_the_device() -> None:
    """``Accelerator()`` and ``PartialState()`` choose the device as they choose a GPU;
    ``cpu=True`` still chooses the CPU."""
    assert torch.accelerator.current_accelerator().type == DEVICE
    assert PartialState().device == torch.device(DEVICE)
    AcceleratorState._reset_state(reset_partial_state=True)
    acc = accelerate.Accelerator()
    assert acc.device == torch.device(DEVICE)
    assert acc.distributed_type == accelerate.DistributedType.NO
    assert acc.prepare(torch.nn.Linear(2, 2)).weight.device.type == DEVICE
    AcceleratorState._reset_state(reset_partial_state=True)
    assert accelerate.Accelerator(cpu=True).device == torch.device("cpu")


def test_training_arguments_pick_the_device(tmp_path: Path) -> None:
    """``TrainingArguments().device`` is the device's first, as ``cuda:0`` on a GPU;
    ``use_cpu=True`` keeps the CPU."""
    args = _args(tmp_path)
    assert args.device == torch.device(DEVICE, 0)
    assert args.n_gpu == 1
    assert _args(tmp_path, use_cpu=True).device == torch.device("cpu")


def test_mixed_precision_arguments_accepted(tmp_path: Path) -> None:
    """``bf16=True`` passes the support check (the device module's ``is_bf16_supported``)
    and ``fp16=True`` gets accelerate's native AMP with a GradScaler of the device."""
    assert transformers.utils.is_torch_bf16_gpu_available()
    assert _args(tmp_path, bf16=True).bf16
    AcceleratorState._reset_state(reset_partial_state=True)
    acc = accelerate.Accelerator(mixed_precision="fp16")
    assert acc.native_amp
    assert isinstance(acc.scaler, torch.amp.GradScaler)
    assert acc.scaler._device == DEVICE and acc.scaler.is_enabled()


def test_patches_are_recorded_and_reversible() -> None:
    """Every patched object is listed, and :func:`uninstall` gives the libraries back their
    own choice (the CPU) until the next :func:`install`."""
    from torchport.integrations import huggingface as hf

    assert hf.installed() == DEVICE
    assert len(hf.patched()) == 5, hf.patched()
    hf.uninstall()
    try:
        assert hf.installed() is None and hf.patched() == []
        assert PartialState().device == torch.device("cpu")
        assert not transformers.utils.is_torch_bf16_gpu_available()
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        hf.install(DEVICE)
    assert PartialState().device == torch.device(DEVICE)
    assert len(hf.patched()) == 5


# ---- Trainer ---------------------------------------------------------------------------------
def test_trainer_matches_cpu(tmp_path: Path) -> None:
    """The Trainer with default settings trains on the device: its fused AdamW runs as a
    device kernel, and loss curve and weights are the CPU run's bit for bit."""
    with ops.record() as rec:
        dev, dev_losses = _train(tmp_path / "dev")
    assert next(dev.model.parameters()).device.type == DEVICE
    opt = dev.optimizer.optimizer if hasattr(dev.optimizer, "optimizer") else dev.optimizer
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["fused"]
    steps = 3 * len(opt.param_groups)  # one call per group (with and without weight decay)
    assert rec.ops["_fused_adamw_"].paths == {"native": steps}
    assert rec.totals()["fallback"] == 0, {k: s.paths for k, s in rec.ops.items()
                                           if "fallback" in s.paths}
    cpu, cpu_losses = _train(tmp_path / "cpu", use_cpu=True)
    assert next(cpu.model.parameters()).device.type == "cpu"
    assert len(dev_losses) == 3 and not torch.equal(dev_losses[0], dev_losses[-1])
    torch.testing.assert_close(dev_losses, cpu_losses, rtol=0, atol=0)
    _assert_same_weights(dev.model, cpu.model)


def test_trainer_checkpoint_resume(tmp_path: Path) -> None:
    """A checkpoint written on the device (weights, the fused AdamW's state with its device
    step counters, scheduler) resumes to the weights of the uninterrupted run."""
    kw: dict[str, Any] = dict(save_strategy="steps", save_steps=2)
    args = _args(tmp_path, **kw)
    full = _LossTrainer(model=_bert(), args=args, train_dataset=_Data())
    full.train()
    assert (tmp_path / "checkpoint-2").is_dir()
    resumed = _LossTrainer(model=_bert(), args=_args(tmp_path, **kw), train_dataset=_Data())
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert next(resumed.model.parameters()).device.type == DEVICE
    torch.testing.assert_close(resumed.losses[-1], full.losses[-1], rtol=0, atol=0)
    _assert_same_weights(resumed.model, full.model)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_trainer_mixed_precision(tmp_path: Path, dtype: str) -> None:
    """``bf16=True`` / ``fp16=True`` autocast on the device in that dtype (CUDA's policy:
    matmuls in low precision, softmax and layer norm in fp32), fp16 with the device's
    GradScaler; the losses are finite and near the fp32 run's. Not bitwise against the
    CPU: the CPU's autocast policy is another one."""
    low = "bfloat16" if dtype == "bf16" else "float16"
    with ops.record() as rec:
        trainer, losses = _train(tmp_path / "amp", **{dtype: True})
    acc = trainer.accelerator
    assert acc.native_amp and acc.device.type == DEVICE
    # CUDA's policy: linear layers (forward addmm, backward mm) and attention in ``low``,
    # layer norm in fp32
    assert _ran(rec, "addmm", low) and _ran(rec, "mm", low)
    assert _ran(rec, "_scaled_dot_product_flash_attention_for_cpu", low)
    assert rec.ops["native_layer_norm"].dtypes == {"float32"}
    assert set(rec.ops["_fused_adamw_"].paths) == {"native"}
    assert rec.totals()["fallback"] == 0
    if dtype == "fp16":
        assert acc.scaler is not None and acc.scaler._device == DEVICE
        assert acc.scaler.is_enabled() and acc.scaler.get_scale() > 0
        assert rec.ops["_amp_foreach_non_finite_check_and_unscale_"].paths.get("native")
    else:
        assert acc.scaler is None
    assert torch.isfinite(losses).all()
    AcceleratorState._reset_state(reset_partial_state=True)
    _, fp32 = _train(tmp_path / "fp32")
    # low-precision matmuls over 32-wide rows: the loss (about log(99)) within a percent
    torch.testing.assert_close(losses, fp32, rtol=1e-2, atol=0)


@pytest.mark.slow
@pytest.mark.skipif(not FULL, reason="set TORCHPORT_FULL_MODELS=1")
def test_trainer_gpt2_matches_cpu(tmp_path: Path) -> None:
    """A decoder (tied embeddings, GPT-2's Conv1D) through the Trainer, as the BERT."""
    dev, dev_losses = _train(tmp_path / "dev", _gpt2)
    assert dev.args.device.type == DEVICE
    cpu, cpu_losses = _train(tmp_path / "cpu", _gpt2, use_cpu=True)
    torch.testing.assert_close(dev_losses, cpu_losses, rtol=0, atol=0)
    _assert_same_weights(dev.model, cpu.model)


# ---- accelerate ------------------------------------------------------------------------------
def _accelerate_loop(cpu: bool, steps: int = 3) -> tuple[accelerate.Accelerator, list[float],
                                                           torch.nn.Module]:
    """A user's accelerate loop: prepare, backward, clip, fused AdamW step."""
    acc = accelerate.Accelerator(cpu=cpu)
    model = _bert()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(_Data(), batch_size=4, shuffle=True)
    model, opt, loader = acc.prepare(model, opt, loader)
    losses = []
    model.train()
    for _, batch in zip(range(steps), loader, strict=False):
        loss = model(**batch).loss
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return acc, losses, acc.unwrap_model(model)


def test_accelerate_loop_matches_cpu() -> None:
    """``Accelerator()`` runs the loop on the device, with the CPU's losses and weights."""
    with ops.record() as rec:
        acc, dev_losses, dev_model = _accelerate_loop(cpu=False)
    assert acc.device.type == DEVICE
    assert next(dev_model.parameters()).device.type == DEVICE
    assert rec.ops["_fused_adamw_"].paths == {"native": 3}
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    acc_cpu, cpu_losses, cpu_model = _accelerate_loop(cpu=True)
    assert acc_cpu.device.type == "cpu"
    assert dev_losses == cpu_losses and dev_losses[0] != dev_losses[-1]
    _assert_same_weights(dev_model, cpu_model)


# ---- the fused optimizer kernels ---------------------------------------------------------------
def _adam_state(device: str, dtype: torch.dtype, n: int = 5,
                amsgrad: bool = False) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    shapes = [(7, 3), (64,), (5, 4, 3), (1,), (130, 33)][:n]
    params = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    grads = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    avgs = [torch.randn(s, generator=g).mul(0.1).to(dtype) for s in shapes]
    sqs = [torch.rand(s, generator=g).mul(0.01).to(dtype) for s in shapes]
    maxs = [x.clone() * 1.5 for x in sqs] if amsgrad else []
    steps = [torch.tensor(float(i + 1)) for i in range(len(shapes))]
    return [[t.to(device) for t in ts] for ts in (params, grads, avgs, sqs, maxs, steps)]


@pytest.mark.parametrize("fn", ["_fused_adamw_", "_fused_adam_"])
@pytest.mark.parametrize("case", [
    dict(dtype=torch.float32),
    dict(dtype=torch.float32, amsgrad=True, maximize=True),
    dict(dtype=torch.float32, grad_scale=True),
    dict(dtype=torch.float32, tensor_lr=True),
    dict(dtype=torch.float32, tensor_lr="cpu", grad_scale=True),
    dict(dtype=torch.bfloat16),
    dict(dtype=torch.float16, grad_scale=True),
    dict(dtype=torch.float64, amsgrad=True),
], ids=["fp32", "amsgrad-maximize", "grad_scale", "tensor_lr", "cpu_tensor_lr", "bf16",
        "fp16-grad_scale", "fp64-amsgrad"])
def test_fused_adam_kernels(fn: str, case: dict[str, Any]) -> None:
    """``_fused_adam(w)_`` on the device is a device kernel computing the CPU kernel's bits
    in every list it writes (parameters, moments, max moments), with every option."""
    dtype, amsgrad = case["dtype"], case.get("amsgrad", False)
    results = []
    for device in ("cpu", DEVICE):
        lists = _adam_state(device, dtype, amsgrad=amsgrad)
        kw: dict[str, Any] = dict(lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.1, eps=1e-8,
                                  amsgrad=amsgrad, maximize=case.get("maximize", False))
        if case.get("tensor_lr"):  # on the device, or on the CPU (CUDA's kernel takes both)
            kw["lr"] = torch.tensor(1e-2, device="cpu" if case["tensor_lr"] == "cpu" else device)
        if case.get("grad_scale"):
            kw["grad_scale"] = torch.tensor(4.0, device=device)
            kw["found_inf"] = torch.tensor(0.0, device=device)
            for gr in lists[1]:
                gr.mul_(4)
        with ops.record() as rec:
            for _ in range(2):
                getattr(torch, fn)(*lists, **kw)
        results.append(lists)
    name = fn + (".tensor_lr" if case.get("tensor_lr") else "")
    assert rec.ops[name].paths == {"native": 2}, rec.ops[name].paths
    for want, got in zip(results[0][:5], results[1][:5], strict=True):
        for w, g in zip(want, got, strict=True):
            assert g.device.type == DEVICE
            torch.testing.assert_close(g.cpu(), w, rtol=0, atol=0)


def test_fused_adamw_skips_step_on_inf() -> None:
    """A GradScaler's ``found_inf`` set: the kernel leaves every tensor as it was, as the
    CPU's does."""
    lists = _adam_state(DEVICE, torch.float32)
    before = [[t.clone() for t in ts] for ts in lists[:4]]
    with ops.record() as rec:
        torch._fused_adamw_(*lists, lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.1,
                            eps=1e-8, amsgrad=False, maximize=False,
                            grad_scale=torch.tensor(2.0, device=DEVICE),
                            found_inf=torch.tensor(1.0, device=DEVICE))
    assert rec.ops["_fused_adamw_"].paths == {"native": 1}
    for ts, bs in zip(lists[:4], before, strict=True):
        for t, b in zip(ts, bs, strict=True):
            assert torch.equal(t.cpu(), b.cpu())


def test_fused_adamw_runs_on_the_chips_views(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel hands the CPU kernel the chip's cached views of the lists (and of the
    keyword tensors), without the general path's per-tensor schema walk, which an
    optimizer step over hundreds of parameters would pay for each tensor; a CPU ``lr``
    tensor, which the views do not cover, takes the general path."""
    from torchport.ops import hostexec

    walks: list[str] = []
    run = hostexec.HostCall.run

    def counted(self: hostexec.HostCall, args: tuple, kwargs: dict) -> Any:
        walks.append(self.plan.overload_name)
        return run(self, args, kwargs)

    monkeypatch.setattr(hostexec.HostCall, "run", counted)
    lists = _adam_state(DEVICE, torch.float32)
    kw: dict[str, Any] = dict(beta1=0.9, beta2=0.99, weight_decay=0.1, eps=1e-8,
                              amsgrad=False, maximize=False)
    with python_host_kernels():  # (C++ host-op kernels serve all three where they can)
        torch._fused_adamw_(*lists, lr=1e-2, **kw)
        torch._fused_adamw_(*lists, lr=torch.tensor(1e-2, device=DEVICE),
                            grad_scale=torch.tensor(2.0, device=DEVICE),
                            found_inf=torch.tensor(0.0, device=DEVICE), **kw)
        assert walks == []
        torch._fused_adamw_(*lists, lr=torch.tensor(1e-2), **kw)
        assert walks == ["_fused_adamw_.tensor_lr"]


@pytest.mark.parametrize("name", ["AdamW", "Adam", "SGD", "Adagrad"])
def test_fused_optimizer_step_is_native(name: str) -> None:
    """``torch.optim.<name>(fused=True)`` steps on device parameters reach the device
    kernel (``_fused_<name>_``), with the CPU optimizer's results bit for bit."""
    cls = getattr(torch.optim, name)
    kw = {"momentum": 0.9} if name == "SGD" else {}
    out = []
    for device in ("cpu", DEVICE):
        torch.manual_seed(0)
        lin = torch.nn.Linear(16, 8).to(device)
        opt = cls(lin.parameters(), lr=1e-2, fused=True, **kw)
        with ops.record() as rec:
            for _ in range(3):
                lin(torch.ones(4, 16, device=device)).square().sum().backward()
                opt.step()
                opt.zero_grad()
        out.append(lin)
    assert rec.ops[f"_fused_{name.lower()}_"].paths == {"native": 3}
    _assert_same_weights(out[1], out[0])
