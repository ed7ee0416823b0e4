"""Serving with an adapter (`--lora DIR`): the adapter merged into the weights as the model loads, routed experts
merged before their tier takes them. fp32 logits equal PEFT's model on transformers and the trainable hybrid model
with the adapter loaded, with experts on both tiers, after experts move between tiers, and over int8 CPU experts
(which quantise the merged weights: the same as quantising a checkpoint PEFT merged)."""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import make_mask, rel_err, run_cli, save_char_tokenizer
from test_training_adapter_io import trained_peft_adapter
from training_reference import (
    lora_config,
    one_torch_thread,  # noqa: F401 (an autouse fixture)
    peft_reference,
)

from tiermoe.arch import detect, load_config
from tiermoe.config import CPUConfig
from tiermoe.errors import TiermoeError
from tiermoe.model.loader import load_hybrid_model
from tiermoe.training.adapter_io import load_adapter
from tiermoe.training.adapter_merge import merged_lora

pytest.importorskip("peft")

TOL = 1e-5


def _ids() -> torch.Tensor:
    return torch.randint(3, 100, (2, 10), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_merged_adapter_serves_the_logits_of_peft_and_of_the_trainable_model(tiny_dir, tmp_path, arch):
    path, ids = tiny_dir(arch), _ids()
    ref = trained_peft_adapter(path, tmp_path / "a", ids)
    with torch.no_grad():
        expected = ref(input_ids=ids).logits
    mask = make_mask("random_half", detect(load_config(path)))
    assert mask.any() and not mask.all()
    with load_hybrid_model(path, mask, gpu_device="cpu", dtype=torch.float32, progress=False, trainable=True) as t:
        with torch.no_grad():
            trained = load_adapter(t, tmp_path / "a")(input_ids=ids).logits
    with load_hybrid_model(path, mask, gpu_device="cpu", dtype=torch.float32, progress=False,
                           lora=merged_lora(tmp_path / "a", path)) as served:
        logits = served(input_ids=ids).logits
        assert rel_err(logits, expected) <= TOL and rel_err(logits, trained) <= TOL
        served.apply_mask(~mask)  # every expert changes tier: the merged copy moves with it
        assert rel_err(served(input_ids=ids).logits, expected) <= TOL


def test_int8_cpu_tier_quantises_the_merged_experts(tiny_dir, tmp_path):
    path, ids = tiny_dir("qwen3_moe"), _ids()
    ref = trained_peft_adapter(path, tmp_path / "a", ids)
    ref.merge_and_unload().save_pretrained(tmp_path / "merged")  # PEFT's own merge, as a checkpoint
    mask = make_mask("random_half", detect(load_config(path)))
    int8 = CPUConfig(expert_dtype="int8")
    with load_hybrid_model(tmp_path / "merged", mask, gpu_device="cpu", dtype=torch.float32, cpu=int8,
                           progress=False) as merged_by_peft:
        expected = merged_by_peft(input_ids=ids).logits
    with load_hybrid_model(path, mask, gpu_device="cpu", dtype=torch.float32, cpu=int8, progress=False,
                           lora=merged_lora(tmp_path / "a", path)) as served:
        assert rel_err(served(input_ids=ids).logits, expected) <= 1e-6


def test_generate_with_lora_and_a_bad_lora_dir(tiny_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_dir("qwen3_moe"), model)
    save_char_tokenizer(model)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    ids = torch.tensor([tokenizer.encode("Hello", add_special_tokens=False)])
    ref = trained_peft_adapter(model, tmp_path / "a", ids)
    with torch.no_grad():
        greedy = ref.generate(input_ids=ids, max_new_tokens=4, do_sample=False)[0, ids.shape[1]:].tolist()

    done = run_cli("generate", "--model", str(model), "--prompt", "Hello", "--raw", "--max-tokens", "4",
                   "--temperature", "0", "--lora", str(tmp_path / "a"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip("\n") == tokenizer.decode(greedy, skip_special_tokens=True)
    base = run_cli("generate", "--model", str(model), "--prompt", "Hello", "--raw", "--max-tokens", "4",
                   "--temperature", "0")
    assert base.returncode == 0 and base.stdout != done.stdout  # the adapter is what made the difference

    for command in (("generate", "--prompt", "Hi"), ("serve",)):
        bad = run_cli(*command, "--model", str(model), "--lora", str(tmp_path / "missing"))
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
        assert "adapter directory" in bad.stderr and "does not exist" in bad.stderr
    several = run_cli("serve", "--model", str(model), "--lora", str(tmp_path / "a"), "--num-gpus", "2")
    assert several.returncode == 2 and "one process" in several.stderr and several.stderr.count("\n") == 1


def test_fp8_weights_that_stay_fp8_refuse_a_merge_in_one_line(tiny_dir, tmp_path):
    """FP8 codes are never re-quantised: an adapter on FP8 GPU-tier experts or FP8 attention weights is refused
    before anything loads; with the experts on the CPU tier (dequantised as they stream in) it merges."""
    from peft import LoraConfig

    from tiermoe.testing.fp8_write import write_fp8_checkpoint

    path = tiny_dir("qwen3_moe")
    fp8 = write_fp8_checkpoint(path, tmp_path / "fp8")
    experts = LoraConfig(r=2, target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                         init_lora_weights=False)
    peft_reference(path, experts).save_pretrained(tmp_path / "experts")
    peft_reference(path, lora_config(target_modules=["q_proj"])).save_pretrained(tmp_path / "attention")
    on_gpu = make_mask("random_half", detect(load_config(path)))
    all_cpu = torch.zeros_like(on_gpu)
    for adapter, mask, says in (("experts", on_gpu, "stay FP8"), ("attention", all_cpu, "float8")):
        with pytest.raises(TiermoeError) as err:
            load_hybrid_model(fp8, mask, gpu_device="cpu", progress=False, lora=merged_lora(tmp_path / adapter, fp8))
        assert says in str(err.value) and "\n" not in str(err.value)
    with load_hybrid_model(fp8, all_cpu, gpu_device="cpu", progress=False) as base, \
            load_hybrid_model(fp8, all_cpu, gpu_device="cpu", progress=False,
                              lora=merged_lora(tmp_path / "experts", fp8)) as served:
        ids = _ids()
        assert rel_err(served(input_ids=ids).logits.float(), base(input_ids=ids).logits.float()) > 1e-3
