"""Adapters on disk in PEFT's own layout: what tiermoe saves, PEFT loads onto the unmodified transformers model
with the same logits; what PEFT saved (trained on transformers) tiermoe loads onto a trainable hybrid model with
the same logits; a malformed adapter directory is one line saying what is wrong (fp32, both tiers in use)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import load_reference, make_mask, rel_err
from safetensors.torch import load_file, save_file
from training_reference import (
    copy_adapters,
    lora_config,
    one_torch_thread,  # noqa: F401 (an autouse fixture)
    peft_reference,
)

from tiermoe.arch import detect, load_config
from tiermoe.errors import TiermoeError
from tiermoe.model.loader import load_hybrid_model
from tiermoe.training.adapter_io import load_adapter, save_adapter
from tiermoe.training.adapter_merge import merged_lora
from tiermoe.training.lora import apply_lora

pytest.importorskip("peft")

TOL = 1e-5
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def _ids() -> torch.Tensor:
    return torch.randint(3, 100, (2, 10), generator=torch.Generator().manual_seed(1))


def _trainable(path):
    mask = make_mask("random_half", detect(load_config(path)))
    return load_hybrid_model(path, mask, gpu_device="cpu", dtype=torch.float32, progress=False, trainable=True)


def trained_peft_adapter(path, out, ids):
    """An adapter trained on the transformers model with PEFT (one AdamW step), saved by PEFT; returns the model."""
    ref = peft_reference(path, lora_config())
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    ref(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    ref.eval()
    ref.save_pretrained(out)
    return ref


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_saved_adapter_is_peft_own_layout_and_peft_loads_it_with_the_same_logits(tiny_dir, tmp_path, arch):
    path, ids = tiny_dir(arch), _ids()
    ref = peft_reference(path, lora_config())
    ref.save_pretrained(tmp_path / "peft")
    with _trainable(path) as hybrid:
        model = apply_lora(hybrid, lora_config())
        copy_adapters(ref, model)
        ours = model(input_ids=ids).logits.detach()
        save_adapter(model, tmp_path / "ours")
    saved, peft_saved = load_file(tmp_path / "ours" / WEIGHTS), load_file(tmp_path / "peft" / WEIGHTS)
    assert set(saved) == set(peft_saved) and any(".mlp.experts." in k for k in saved)
    assert all(torch.equal(saved[k], peft_saved[k]) for k in saved)
    config = json.loads((tmp_path / "ours" / CONFIG).read_text())
    assert {"gate_up_proj", "down_proj"} <= set(config["target_parameters"]) and config["peft_type"] == "LORA"

    from peft import PeftModel

    plain = PeftModel.from_pretrained(load_reference(path), tmp_path / "ours")
    assert rel_err(plain(input_ids=ids).logits, ours) <= TOL


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_adapter_trained_with_peft_on_transformers_loads_onto_the_hybrid_model(tiny_dir, tmp_path, arch):
    path, ids = tiny_dir(arch), _ids()
    ref = trained_peft_adapter(path, tmp_path / "a", ids)
    with torch.no_grad():
        expected = ref(input_ids=ids).logits
    with _trainable(path) as hybrid:
        model = load_adapter(hybrid, tmp_path / "a", trainable=True)
        assert rel_err(model(input_ids=ids).logits, expected) <= TOL
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        assert len(trainable) == sum(1 for n, _ in model.named_parameters() if "lora_" in n)
        assert any(".lora_experts." in n for n in trainable)
        model(input_ids=ids, labels=ids).loss.backward()  # resumable: gradients reach the loaded adapter
        assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad)


def test_expert_only_adapter_with_its_own_ranks_round_trips_through_peft(tiny_dir, tmp_path):
    """LoRA on the routed experts alone (no PeftModel on the hybrid side), gate_up at another rank and alpha."""
    from peft import LoraConfig, PeftModel

    path, ids = tiny_dir("qwen3_moe"), _ids()
    config = LoraConfig(r=4, lora_alpha=8, target_modules=None, target_parameters=["mlp.experts.gate_up_proj",
                        "mlp.experts.down_proj"], rank_pattern={"gate_up_proj": 6}, alpha_pattern={"gate_up_proj": 3})
    with _trainable(path) as hybrid:
        model = apply_lora(hybrid, config)
        torch.manual_seed(0)
        with torch.no_grad():
            for block in hybrid.blocks.values():
                for factor in block.lora_experts.factors():
                    factor.normal_(0, 0.1)
        ours = model(input_ids=ids).logits.detach()
        save_adapter(model, tmp_path / "experts")
    plain = PeftModel.from_pretrained(load_reference(path), tmp_path / "experts")
    assert rel_err(plain(input_ids=ids).logits, ours) <= TOL
    with _trainable(path) as hybrid:
        again = load_adapter(hybrid, tmp_path / "experts")
        assert rel_err(again(input_ids=ids).logits, ours) <= TOL
        assert not any(p.requires_grad for p in again.parameters())


def _transformers_4_adapter(path, out):
    """LoRA on every expert's gate_proj / up_proj / down_proj with per-expert keys: what PEFT saved for MoE models
    before transformers 5 fused the experts."""
    config = load_config(path)
    spec = detect(config)
    d, i, r = config.hidden_size, spec.expert_intermediate_size, 4
    gen = torch.Generator().manual_seed(5)
    tensors = {}
    for layer in spec.moe_layers:
        for e in range(spec.num_experts):
            for proj, (n_in, n_out) in {"gate_proj": (d, i), "up_proj": (d, i), "down_proj": (i, d)}.items():
                key = f"base_model.model.model.layers.{layer}.mlp.experts.{e}.{proj}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(r, n_in, generator=gen) * 0.1
                tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, r, generator=gen) * 0.1
    out.mkdir()
    save_file(tensors, out / WEIGHTS)
    (out / CONFIG).write_text(json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": 8, "task_type": "CAUSAL_LM",
                                          "target_modules": ["gate_proj", "up_proj", "down_proj"]}))


def test_adapter_in_transformers_4_layout_loads_and_merges_as_peft_loads_it(tiny_dir, tmp_path):
    from peft import PeftModel

    path, ids = tiny_dir("qwen3_moe"), _ids()
    _transformers_4_adapter(path, tmp_path / "v4")
    with torch.no_grad():
        expected = PeftModel.from_pretrained(load_reference(path), tmp_path / "v4")(input_ids=ids).logits
    with _trainable(path) as hybrid:
        assert rel_err(load_adapter(hybrid, tmp_path / "v4")(input_ids=ids).logits, expected) <= TOL
    mask = make_mask("random_half", detect(load_config(path)))
    with load_hybrid_model(path, mask, gpu_device="cpu", dtype=torch.float32, progress=False,
                           lora=merged_lora(tmp_path / "v4", path)) as served:
        assert rel_err(served(input_ids=ids).logits, expected) <= TOL


def _break(adapter, how: str):
    """Damage a copy of a good adapter directory the way `how` says."""
    config_path, weights_path = adapter / CONFIG, adapter / WEIGHTS
    config = json.loads(config_path.read_text())
    tensors = load_file(weights_path)
    if how == "missing":
        return adapter / "nope"
    if how == "no_config":
        config_path.unlink()
    elif how == "bad_json":
        config_path.write_text("{ not json")
    elif how == "not_lora":
        config_path.write_text(json.dumps(dict(config, peft_type="IA3")))
    elif how == "dora":
        config_path.write_text(json.dumps(dict(config, use_dora=True)))
    elif how == "no_weights":
        weights_path.unlink()
    elif how == "corrupt_weights":
        weights_path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{\"a\":1}")
    elif how == "wrong_rank":
        config_path.write_text(json.dumps(dict(config, r=8)))
    elif how in ("missing_tensor", "extra_tensor"):
        key = next(k for k in tensors if ".experts." in k)
        if how == "missing_tensor":
            del tensors[key]
        else:
            tensors[key.replace("lora_A", "lora_C")] = tensors[key].clone()
        save_file(tensors, weights_path)
    return adapter


@pytest.mark.parametrize("how, says", [
    ("missing", "does not exist"), ("no_config", "no adapter_config.json"), ("bad_json", "not readable JSON"),
    ("not_lora", "peft_type"), ("dora", "DoRA"), ("no_weights", "no adapter_model.safetensors"),
    ("corrupt_weights", "not a readable safetensors"), ("wrong_rank", "has shape"),
    ("missing_tensor", "has no tensor"), ("extra_tensor", "unexpected"),
])
def test_malformed_adapter_is_one_line_saying_what_is_wrong(tiny_dir, tmp_path, how, says):
    path = tiny_dir("qwen3_moe")
    peft_reference(path, lora_config()).save_pretrained(tmp_path / "a")
    with pytest.raises(TiermoeError) as err:
        merged_lora(_break(tmp_path / "a", how), path)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_load_adapter_refuses_a_model_not_loaded_for_training(tiny_dir, tmp_path):
    path = tiny_dir("qwen3_moe")
    peft_reference(path, lora_config()).save_pretrained(tmp_path / "a")
    with load_hybrid_model(path, None, gpu_device="cpu", dtype=torch.float32, progress=False) as hybrid:
        with pytest.raises(TiermoeError, match="trainable=True"):
            load_adapter(hybrid, tmp_path / "a")
