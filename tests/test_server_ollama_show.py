"""Ollama's POST /api/show: the served model described in Ollama's shape, under any name (the server's one rule:
whatever model a request names, the loaded model answers); its parameter count is the checkpoint's, however the
tiers hold the weights."""

from __future__ import annotations

import httpx
from server_thread import server_thread

from tiermoe.checkpoint.safetensors import Checkpoint
from tiermoe.engine.llm import LLM
from tiermoe.server.model_card import parameter_count, parameter_size


def test_api_show_describes_the_model_as_ollama_does(tmp_path):
    with server_thread(tmp_path) as (url, state):
        r = httpx.post(url + "/api/show", json={"model": "tiny"}, timeout=60)
        assert r.status_code == 200, r.text
        show = r.json()
        config = state.llm.hybrid.config
        assert show["capabilities"] == ["completion"]
        assert show["template"] == state.llm.tokenizer.chat_template
        assert show["modelfile"].startswith(f"FROM {state.llm.model_dir}\n")
        details = show["details"]
        assert details["format"] == "safetensors" and details["family"] == "qwen3_moe"
        assert details["quantization_level"] == "F32"
        with Checkpoint(state.llm.model_dir) as ckpt:
            assert show["model_info"]["general.parameter_count"] == sum(e.numel for e in ckpt.entries.values())
        assert details["parameter_size"].endswith(("K", "M", "B"))
        info = show["model_info"]
        assert info["general.architecture"] == "qwen3_moe"
        assert info["qwen3_moe.block_count"] == config.num_hidden_layers
        assert info["qwen3_moe.expert_count"] == config.num_experts
        assert info["qwen3_moe.expert_used_count"] == config.num_experts_per_tok
        assert info["qwen3_moe.embedding_length"] == config.hidden_size
        # the pre-0.3 field name and the ":latest" tag name the same model
        assert httpx.post(url + "/api/show", json={"name": "tiny:latest"}, timeout=60).status_code == 200
        tags = httpx.get(url + "/api/tags", timeout=60).json()["models"][0]
        assert tags["details"] == details

        # another name, or none, describes the served model too: /api/generate answers under any name
        for body in ({"model": "llama3"}, {}):
            other = httpx.post(url + "/api/show", json=body, timeout=60)
            assert other.status_code == 200 and other.json() == show
        schema = httpx.get(url + "/openapi.json", timeout=60).json()["paths"]["/api/show"]["post"]
        assert "model" in schema["requestBody"]["content"]["application/json"]["schema"]["properties"]


def test_the_parameter_count_is_the_checkpoints_when_the_tiers_hold_weights_packed():
    # the demo model run CPU-only: its non-expert linears are packed for tiermoe's kernels (buffers, not parameters)
    with LLM(progress=False) as llm:
        held = sum(p.numel() for p in llm.hybrid.model.parameters())
        count = parameter_count(llm)
    assert count == 11_807_488 and parameter_size(count) == "11.81M"  # its model card's count
    assert held < count - 9_437_184  # what the module tree holds as parameters, experts aside, falls short
