"""Loading never holds a second copy of the model: peak RSS grows by what the tiers hold, not twice that."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tiermoe.testing.make_model import make_model

CHILD = r"""
import json, resource, sys, torch
from transformers import AutoModelForCausalLM  # noqa: F401  (libraries in before the baseline)
from tiermoe.model.loader import load_hybrid_model
from tiermoe.arch import detect, load_config
import transformers.models.qwen3_moe.modeling_qwen3_moe  # noqa: F401
spec = detect(load_config(sys.argv[1]))
mask = torch.rand(spec.num_layers, spec.num_experts, generator=torch.Generator().manual_seed(0)) < 0.5
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
model = load_hybrid_model(sys.argv[1], mask, gpu_device="cpu", progress=False)
tb = model.tier_bytes()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"base": base, "peak": peak, "held": tb.non_expert + tb.gpu_experts + tb.cpu_experts}))
"""


def measure(path) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(path)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_peak_memory_while_loading_is_the_held_bytes_plus_little(tmp_path):
    # about 380 MB of fp32 experts: a second copy at any moment would add as much again
    path = make_model("qwen3_moe", tmp_path / "m", dtype=torch.float32, progress=False, config_overrides=dict(
        hidden_size=512, moe_intermediate_size=512, num_experts=40, num_hidden_layers=3, mlp_only_layers=[],
        head_dim=64, num_attention_heads=8, num_key_value_heads=2, vocab_size=1024))
    r = measure(path)
    growth = r["peak"] - r["base"]
    assert r["held"] > 350e6
    assert growth <= r["held"] + 150e6, r


@pytest.mark.slow
def test_multi_gb_checkpoint_peak_memory(tmp_path):
    """The benchmark's case, as a test: several GB of bf16 experts (run with -m slow)."""
    path = make_model("qwen3_moe", tmp_path / "q30b", preset="qwen3-30b-a3b", layers=4, progress=False)
    r = measure(path)
    assert r["peak"] <= r["held"] + (1 << 30), r
