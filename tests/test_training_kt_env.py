"""KTransformers' ACCELERATE_KT_* fine-tuning settings (tiermoe.training.kt_env): KT's defaults and meanings,
flags over the environment, one-line errors for unknown, malformed, out-of-range and unimplemented values, and
NUM_GPU_EXPERTS planned by the inference planner."""

from __future__ import annotations

import pytest
import torch

from tiermoe.bundled import BUNDLED_MODEL_DIR
from tiermoe.config import machine_cpus
from tiermoe.errors import TiermoeError
from tiermoe.model.plan_source import plan_from_config
from tiermoe.training.kt_env import read_kt_settings, training_placement


def test_kt_defaults_with_nothing_set():
    s = read_kt_settings({"PATH": "/bin", "ACCELERATE_USE_KT": "true"})
    assert (s.num_gpu_experts, s.lora_rank, s.alpha, s.lora_dropout, s.expert_dtype, s.expert_lora) == \
        (None, None, None, 0.0, None, True)
    assert (s.threads, s.torch_threads, s.max_length, s.notes) == (None, None, None, ())


def test_kt_meanings_read_from_the_environment():
    s = read_kt_settings({"ACCELERATE_KT_NUM_GPU_EXPERTS": "2", "ACCELERATE_KT_LORA_RANK": "8",
                          "ACCELERATE_KT_LORA_DROPOUT": "0.1", "ACCELERATE_KT_BACKEND": "AMXINT8",
                          "ACCELERATE_KT_NUM_THREADS": "1", "ACCELERATE_KT_MODEL_MAX_LENGTH": "512",
                          "ACCELERATE_KT_TRAIN_MODE": "lora", "ACCELERATE_KT_USE_LORA_EXPERTS": "false",
                          "ACCELERATE_KT_LORA_EXPERT_NUM": "4", "ACCELERATE_KT_OMP_NUM_THREADS": "1",
                          "ACCELERATE_KT_LORA_ALPHA": ""})  # empty = unset, as in KT
    assert (s.num_gpu_experts, s.lora_rank, s.alpha, s.lora_dropout) == (2, 8, 16.0, 0.1)  # alpha 2 x rank
    assert (s.expert_dtype, s.threads, s.torch_threads, s.max_length) == ("int8", 1, 1, 512)


@pytest.mark.parametrize("env, dtype, expert_lora", [
    ({"ACCELERATE_KT_EXPERT_WEIGHT_FORMAT": "bf16"}, "bf16", True),
    ({"ACCELERATE_KT_EXPERT_WEIGHT_FORMAT": "INT8", "ACCELERATE_KT_BACKEND": "auto"}, "int8", True),
    ({"ACCELERATE_KT_BACKEND": "AMXBF16"}, "bf16", True),
    ({"ACCELERATE_KT_BACKEND": "AMXINT4_SFT"}, "int4", True),
    ({"ACCELERATE_KT_BACKEND": "AMXINT4_KGroup_SkipLoRA"}, "int4", False),
])
def test_expert_formats_map_to_the_cpu_tier(env, dtype, expert_lora):
    s = read_kt_settings(env)
    assert (s.expert_dtype, s.expert_lora) == (dtype, expert_lora)


def test_flags_win_over_the_environment():
    env = {"ACCELERATE_KT_LORA_RANK": "8", "ACCELERATE_KT_LORA_ALPHA": "3", "ACCELERATE_KT_NUM_GPU_EXPERTS": "4",
           "ACCELERATE_KT_EXPERT_WEIGHT_FORMAT": "int8", "ACCELERATE_KT_MODEL_MAX_LENGTH": "512",
           "ACCELERATE_KT_LORA_DROPOUT": "0.5", "ACCELERATE_KT_NUM_THREADS": "1"}
    s = read_kt_settings(env, lora_rank=4, lora_alpha=1.5, num_gpu_experts=0, expert_dtype="bf16", max_length=64,
                         lora_dropout=0.0, threads=2)
    assert (s.lora_rank, s.alpha, s.num_gpu_experts, s.expert_dtype, s.max_length, s.lora_dropout, s.threads) == \
        (4, 1.5, 0, "bf16", 64, 0.0, 2)
    assert read_kt_settings(env, lora_rank=4).alpha == 3.0  # the variable's alpha with the flag's rank


@pytest.mark.parametrize("name, value, message", [
    ("ACCELERATE_KT_LORA_RANKK", "8", "unknown KTransformers setting ACCELERATE_KT_LORA_RANKK; known:"),
    ("ACCELERATE_KT_LORA_RANK", "eight", "expected an integer"),
    ("ACCELERATE_KT_LORA_RANK", "0", "expected a LoRA rank between 1 and"),
    ("ACCELERATE_KT_LORA_ALPHA", "nan", "expected a LoRA alpha"),
    ("ACCELERATE_KT_LORA_DROPOUT", "1", r"expected a dropout probability \[0.0, 1.0\)"),
    ("ACCELERATE_KT_NUM_GPU_EXPERTS", "-1", "expected GPU experts per MoE layer between 0"),
    ("ACCELERATE_KT_NUM_THREADS", str(100 * machine_cpus()), "this machine has"),
    ("ACCELERATE_KT_OMP_NUM_THREADS", str(machine_cpus() + 1), "at most this machine's CPUs"),
    ("ACCELERATE_KT_MODEL_MAX_LENGTH", "1", "expected a sequence length between 2"),
    ("ACCELERATE_KT_TRAIN_MODE", "qlora", "expected one of lora, full, hybrid"),
    ("ACCELERATE_KT_USE_LORA_EXPERTS", "maybe", "expected a boolean"),
    ("ACCELERATE_KT_EXPERT_WEIGHT_FORMAT", "int3", "expected one of bf16, int8, fp8, rawint4, mxfp4"),
    ("ACCELERATE_KT_BACKEND", "AMXINT2", "expected auto or one of AMXBF16"),
    ("ACCELERATE_KT_WEIGHT_LIFECYCLE", "sometimes", "expected persistent or ephemeral"),
    ("ACCELERATE_KT_MAX_CACHE_DEPTH", "0", "expected a positive count"),
    ("ACCELERATE_KT_LORA_EXPERT_NUM", "x", "expected an integer"),
])
def test_unknown_malformed_and_out_of_range_values_are_one_line_errors(name, value, message):
    with pytest.raises(TiermoeError, match=message) as err:
        read_kt_settings({name: value})
    assert "\n" not in str(err.value) and name in str(err.value)


@pytest.mark.parametrize("env, message", [
    ({"ACCELERATE_KT_TRAIN_MODE": "full"}, "full-weight training is not implemented"),
    ({"ACCELERATE_KT_TRAIN_MODE": "hybrid"}, "full-weight training is not implemented"),
    ({"ACCELERATE_KT_USE_LORA_EXPERTS": "1"}, "extra GPU-side LoRA experts are not implemented"),
    ({"ACCELERATE_KT_EXPERT_WEIGHT_FORMAT": "fp8"}, "fp8 CPU experts are not implemented"),
    ({"ACCELERATE_KT_EXPERT_WEIGHT_FORMAT": "rawint4"}, "rawint4 CPU experts are not implemented"),
    ({"ACCELERATE_KT_EXPERT_WEIGHT_FORMAT": "mxfp4"}, "mxfp4 CPU experts are not implemented"),
    ({"ACCELERATE_KT_BACKEND": "AMXFP8_SFT"}, "its expert format is not implemented"),
    ({"ACCELERATE_KT_TP_ENABLED": "true"}, "tensor-parallel fine-tuning is not implemented"),
    ({"ACCELERATE_KT_BACKEND": "AMXINT8", "ACCELERATE_KT_EXPERT_WEIGHT_FORMAT": "bf16"}, "disagree"),
])
def test_what_tiermoe_does_not_implement_says_so(env, message):
    with pytest.raises(TiermoeError, match=message) as err:
        read_kt_settings(env)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("policy, flag, checkpointing, noted", [
    ('{"cpu": "recompute", "gpu": "recompute"}', None, True, False),  # KT's default policy
    ('{"gpu": "recompute", "cpu": "retain"}', None, True, True),  # cpu=retain: nothing to act on in tiermoe
    ('{"cpu": "recompute", "gpu": "retain"}', None, False, False),
    ('{"cpu": "recompute", "gpu": "recompute"}', False, False, False),  # the flag wins
    (None, None, None, False),
])
def test_the_activation_policy_is_gradient_checkpointing(policy, flag, checkpointing, noted):
    env = {} if policy is None else {"ACCELERATE_KT_ACTIVATION_POLICY": policy}
    s = read_kt_settings(env, gradient_checkpointing=flag)
    assert s.gradient_checkpointing is checkpointing and bool(s.notes) == noted


@pytest.mark.parametrize("value", ["recompute", '{"cpu": "recompute"}', '["recompute", "recompute"]',
                                   '{"cpu": "recompute", "gpu": "recompute", "depth": 2}', '{"cpu": 1, "gpu": 2}'])
def test_a_malformed_activation_policy_is_a_one_line_error(value):
    with pytest.raises(TiermoeError, match="expected a JSON object with exactly the keys cpu and gpu") as err:
        read_kt_settings({"ACCELERATE_KT_ACTIVATION_POLICY": value}, gradient_checkpointing=True)  # checked anyway
    assert "\n" not in str(err.value)


def test_kt_only_knobs_are_checked_and_noted():
    s = read_kt_settings({"ACCELERATE_KT_MAX_CACHE_DEPTH": "2", "ACCELERATE_KT_SHARE_BACKWARD_BB": "1",
                          "ACCELERATE_KT_TP_ENABLED": "0", "ACCELERATE_KT_WEIGHT_PATH": "/w"})
    assert len(s.notes) == 4 and all("has no effect in tiermoe" in n for n in s.notes)
    assert any(n.startswith("ACCELERATE_KT_MAX_CACHE_DEPTH") for n in s.notes)


def test_num_gpu_experts_is_planned_like_inference(tmp_path):
    assert training_placement(None) is None  # nothing asked: the loader's default
    assert not plan_from_config(training_placement(0), BUNDLED_MODEL_DIR).mask.any()  # KT's 0: all on the CPU tier
    kt_rule = plan_from_config(training_placement(3), BUNDLED_MODEL_DIR)  # KT: the first n experts of every layer
    expected = torch.zeros(4, 8, dtype=torch.bool)
    expected[:, :3] = True
    assert torch.equal(kt_rule.mask, expected)

    counts = torch.arange(32, dtype=torch.float64).reshape(1, 4, 8).flip(-1)  # expert 0 busiest, 7 idlest
    counts[0, 2] = 100 * torch.arange(8.0)  # layer 2: expert 7 busiest of all (KT's top-k is global)
    stats = tmp_path / "stats.pt"
    torch.save({"logical_count": counts}, stats)
    by_frequency = plan_from_config(training_placement(2, str(stats)), BUNDLED_MODEL_DIR)
    assert by_frequency.strategy == "frequency" and int(by_frequency.mask.sum()) == 8
    assert by_frequency.mask[2, 1:].all() and not by_frequency.mask[2, 0] and by_frequency.mask[3, 0]
