"""Preference tuning (DPO) of a hybrid model through TRL's DPOTrainer, experts on both tiers: the reference is the
same model with its adapters switched off or to a frozen copy (PEFT's way: `ref_model=None` with a PEFT model), so
it costs no second copy of the experts; its log-probabilities are the base model's, before training and after, and
the DPO loss falls over a few steps on a small preference set (fp32, a tiny model)."""

from __future__ import annotations

import pytest
import torch
from conftest import load_reference, make_mask, rel_err, save_char_tokenizer
from training_reference import one_torch_thread  # noqa: F401 (an autouse fixture)

from tiermoe.arch import detect, load_config
from tiermoe.model.loader import load_hybrid_model
from tiermoe.training.adapter_io import expert_loras
from tiermoe.training.lora import apply_lora

pytest.importorskip("trl")

TOL = 1e-5
PAIRS = [  # (prompt, chosen, rejected)
    ("the cat", " sat on the mat.", " qz xv kk jw."),
    ("a dog", " ran in the park.", " zq vv xk wj."),
    ("the sun", " is warm today.", " kx qq zv jj."),
    ("a bird", " sings in a tree.", " vj zz qk xw."),
]


def _base_logps(model, batch) -> torch.Tensor:
    """Summed log-probabilities of each sequence's completion tokens under `model` (plain logits)."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    targets = batch["input_ids"][:, 1:]
    per_token = torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None])[..., 0]
    return (per_token * batch["completion_mask"][:, 1:]).sum(1)


def test_dpo_loss_falls_with_the_adapters_off_model_as_its_reference(tiny_dir, tmp_path):
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    path = tiny_dir("qwen3_moe")
    save_char_tokenizer(tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    data = Dataset.from_dict({k: [p[i] for p in PAIRS] for i, k in enumerate(("prompt", "chosen", "rejected"))})
    mask = make_mask("random_half", detect(load_config(path)))
    with load_hybrid_model(path, mask, gpu_device="cpu", dtype=torch.float32, progress=False,
                           trainable=True) as hybrid:
        experts_before = hybrid.tier_bytes()
        model = apply_lora(hybrid, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        assert expert_loras(model)
        args = DPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], max_steps=6,
                         learning_rate=2e-2, per_device_train_batch_size=4, logging_steps=1, save_strategy="no",
                         beta=0.5, max_length=48, bf16=False)  # TRL's default is bf16 autocast
        trainer = DPOTrainer(model=model, ref_model=None, args=args, train_dataset=data, processing_class=tok)
        assert trainer.ref_model is None  # no second model, so no second copy of the experts
        batch = next(iter(trainer.get_train_dataloader()))
        base = _base_logps(load_reference(path), batch)

        def reference_logps():
            chosen, rejected = trainer.compute_ref_log_probs(trainer.model, batch)
            return torch.cat([chosen, rejected])

        assert rel_err(reference_logps(), base) <= TOL
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        assert len(losses) == 6 and losses[-1] < losses[0] - 0.05, losses
        assert rel_err(reference_logps(), base) <= TOL  # the reference did not train along
        model.eval()
        trained = _base_logps(model, batch)
        assert rel_err(trained, base) > 1e-3  # while the policy did
        after = hybrid.tier_bytes()  # the experts' bytes: adapters (and their frozen copy) are non-expert bytes
        assert (after.gpu_experts, after.cpu_experts) == (experts_before.gpu_experts, experts_before.cpu_experts)


def test_adapters_off_or_a_frozen_copy_switch_the_expert_lora_too(tiny_dir):
    """PEFT's switches (disable_adapter, add_adapter + set_adapter) on a model whose every adapter weight is random:
    off gives the base model's logits, the copy the adapted ones, and switching back restores the adapter."""
    from peft import LoraConfig

    path = tiny_dir("qwen3_moe")
    ids = torch.randint(3, 100, (2, 10), generator=torch.Generator().manual_seed(5))
    mask = make_mask("random_half", detect(load_config(path)))
    with load_hybrid_model(path, mask, gpu_device="cpu", dtype=torch.float32, progress=False,
                           trainable=True) as hybrid, torch.no_grad():
        base = hybrid.model(input_ids=ids).logits
        config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
        model = apply_lora(hybrid, config)
        adapted = model(input_ids=ids).logits
        assert rel_err(adapted, base) > 1e-2
        with model.disable_adapter():
            assert rel_err(model(input_ids=ids).logits, base) <= TOL
        assert rel_err(model(input_ids=ids).logits, adapted) <= TOL
        model.add_adapter("ref", model.peft_config["default"])
        for name, p in model.named_parameters():  # what TRL does: the copy starts as the adapter
            if ".default." in name:
                model.get_parameter(name.replace(".default.", ".ref.")).copy_(p)
        for lora in expert_loras(model).values():  # then the adapter trains on, the copy stays
            lora.down_B.add_(0.5)
        model.set_adapter("ref")
        assert rel_err(model(input_ids=ids).logits, adapted) <= TOL
        model.set_adapter("default")
        assert rel_err(model(input_ids=ids).logits, adapted) > 1e-3
