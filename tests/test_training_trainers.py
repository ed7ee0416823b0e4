"""The training loops people use, on the trainable hybrid model after apply_lora (one process, CPU, a tiny model):
transformers' Trainer (checkpoints in PEFT's layout, expert LoRA included, and resuming from them), TRL's
SFTTrainer, one SGD step (to 1e-5 of the step) and one AdamW step equal to the same step on PEFT's model of
transformers, and gradient checkpointing with the same gradients."""

from __future__ import annotations

import pytest
import torch
from conftest import load_reference, make_mask, rel_err, save_char_tokenizer
from training_reference import (
    adapter_grads,
    copy_adapters,
    lora_config,
    one_torch_thread,  # noqa: F401 (an autouse fixture)
    peft_reference,
)

from tiermoe.arch import detect, load_config
from tiermoe.model.loader import load_hybrid_model
from tiermoe.training.adapter_io import attach_adapter_io, expert_loras
from tiermoe.training.lora import apply_lora

pytest.importorskip("peft")

TOL = 1e-5


def _batch(n: int = 2, length: int = 10) -> torch.Tensor:
    return torch.randint(3, 100, (n, length), generator=torch.Generator().manual_seed(3))


def _hybrid(path):
    mask = make_mask("random_half", detect(load_config(path)))
    return load_hybrid_model(path, mask, gpu_device="cpu", dtype=torch.float32, progress=False, trainable=True)


def _adapter_values(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _args(out, **kw):
    from transformers import TrainingArguments

    kw = {"save_strategy": "no", **kw}
    return TrainingArguments(output_dir=str(out), use_cpu=True, report_to=[], per_device_train_batch_size=2,
                             learning_rate=1e-2, logging_steps=1, **kw)


def test_trainer_trains_checkpoints_in_peft_layout_and_resumes(tiny_dir, tmp_path):
    from datasets import Dataset
    from peft import PeftModel
    from transformers import Trainer

    path = tiny_dir("qwen3_moe")
    ids = _batch(4)
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    with _hybrid(path) as hybrid:
        model = attach_adapter_io(apply_lora(hybrid, lora_config()))
        before = _adapter_values(model)
        trainer = Trainer(model=model, args=_args(tmp_path, max_steps=3, save_strategy="steps", save_steps=3),
                          train_dataset=data)
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        assert len(losses) == 3 and losses[-1] < losses[0]
        after = _adapter_values(model)
        assert all(not torch.equal(before[n], after[n]) for n in after if ".lora_experts." in n or "lora_B" in n)
        model.eval()
        with torch.no_grad():
            trained = model(input_ids=ids).logits
    checkpoint = tmp_path / "checkpoint-3"
    plain = PeftModel.from_pretrained(load_reference(path), checkpoint)  # expert LoRA included
    assert rel_err(plain(input_ids=ids).logits, trained) <= TOL

    with _hybrid(path) as hybrid:  # resume: the checkpoint's adapter comes back into a fresh model
        model = attach_adapter_io(apply_lora(hybrid, lora_config()))
        Trainer(model=model, args=_args(tmp_path, max_steps=3), train_dataset=data).train(
            resume_from_checkpoint=str(checkpoint))
        assert all(torch.equal(v, after[n]) for n, v in _adapter_values(model).items())


def test_sft_trainer_lowers_the_loss(tiny_dir, tmp_path):
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    save_char_tokenizer(tmp_path / "tok")
    texts = ["the cat sat on the mat.", "a dog ran in the park."] * 2
    with _hybrid(tiny_dir("qwen3_moe")) as hybrid:
        model = attach_adapter_io(apply_lora(hybrid, lora_config()))
        args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=3, learning_rate=1e-2,
                         per_device_train_batch_size=2, logging_steps=1, save_strategy="no", max_length=32)
        trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"text": texts}),
                             processing_class=AutoTokenizer.from_pretrained(tmp_path / "tok"))
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        assert len(losses) == 3 and losses[-1] < losses[0]


def test_one_adamw_step_gives_the_adapter_weights_of_peft(tiny_dir):
    """Adam divides each gradient element by its own magnitude, so where |g| is near eps the 1e-8 differences fp32
    leaves between two exact computations show in that element's step: the weights agree to 1e-4 per tensor, each
    tensor's step to 2% (a step missing or gone wrong is off by 100%)."""
    path, ids = tiny_dir("qwen3_moe"), _batch()
    ref = peft_reference(path, lora_config())
    with _hybrid(path) as hybrid:
        model = apply_lora(hybrid, lora_config())
        copy_adapters(ref, model)
        start = _adapter_values(model)
        for m in (ref, model):
            opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)
            m(input_ids=ids, labels=ids).loss.backward()
            opt.step()
        ours = _adapter_values(model)
        copy_adapters(ref, model)  # the reference's stepped values, in the hybrid model's layout
        theirs = _adapter_values(model)
    assert any(".lora_experts." in n for n in ours)
    for n in ours:
        assert (ours[n] - theirs[n]).norm() <= 1e-4 * theirs[n].norm(), n
        step, ref_step = ours[n] - start[n], theirs[n] - start[n]
        assert (step - ref_step).norm() <= 2e-2 * ref_step.norm(), n


def _sgd_step(model, ids) -> None:
    """One SGD step, each adapter tensor at its own learning rate ||w|| / ||g||: every step is as large as its
    tensor, so fp32's rounding of the weights (1 ulp of w) stays about 1e-7 of the step."""
    model(input_ids=ids, labels=ids).loss.backward()
    params = [p for p in model.parameters() if p.requires_grad]
    torch.optim.SGD([{"params": [p], "lr": (p.norm() / p.grad.norm()).item()} for p in params]).step()


def test_one_sgd_step_moves_every_adapter_weight_as_peft_moves_it(tiny_dir):
    """The step itself, per tensor, to 1e-5 (a step missing or gone wrong is off by 100%): SGD moves each weight
    by its gradient, so this is the gradients' exactness carried through an optimizer."""
    path, ids = tiny_dir("qwen3_moe"), _batch()
    ref = peft_reference(path, lora_config())
    with _hybrid(path) as hybrid:
        model = apply_lora(hybrid, lora_config())
        copy_adapters(ref, model)
        start = _adapter_values(model)
        _sgd_step(ref, ids)
        _sgd_step(model, ids)
        ours = _adapter_values(model)
        copy_adapters(ref, model)  # the reference's stepped values, in the hybrid model's layout
        theirs = _adapter_values(model)
    assert any(".lora_experts." in n for n in ours)
    for n in ours:
        step, ref_step = ours[n] - start[n], theirs[n] - start[n]
        assert (step - ref_step).norm() <= 1e-5 * ref_step.norm(), n


def test_gradient_checkpointing_gives_the_same_gradients(tiny_dir):
    path, ids = tiny_dir("qwen3_moe"), _batch()
    ref = peft_reference(path, lora_config())
    grads = []
    for checkpointing in (False, True):
        with _hybrid(path) as hybrid:
            model = apply_lora(hybrid, lora_config())
            copy_adapters(ref, model)
            if checkpointing:
                model.gradient_checkpointing_enable()
            calls = []
            next(iter(hybrid.blocks.values())).register_forward_pre_hook(lambda *a, calls=calls: calls.append(1))
            model.train()
            model(input_ids=ids, labels=ids).loss.backward()
            assert len(calls) == (2 if checkpointing else 1)  # the MoE block really is recomputed
            grads.append(adapter_grads(model))
    plain, checkpointed = grads
    assert any(k.startswith("layer.") for k in plain)
    assert max(((checkpointed[k] - plain[k]).norm() / plain[k].norm()).item() for k in plain) <= TOL


def test_expert_loras_are_found_by_layer(tiny_dir):
    with _hybrid(tiny_dir("qwen3_moe")) as hybrid:
        model = apply_lora(hybrid, lora_config())
        assert sorted(expert_loras(model)) == sorted(hybrid.blocks)
