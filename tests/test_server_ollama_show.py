"""Ollama's POST /api/show: the served model described in Ollama's shape; another name is Ollama's 404."""

from __future__ import annotations

import httpx
from server_thread import server_thread


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
        size = state.llm.hybrid.tier_bytes()
        params = show["model_info"]["general.parameter_count"]
        module_params = sum(p.numel() for p in state.llm.hybrid.model.parameters())
        assert params == module_params + (size.gpu_experts + size.cpu_experts) // 4  # fp32 experts: 4 bytes each
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

        missing = httpx.post(url + "/api/show", json={"model": "llama3"}, timeout=60)
        assert missing.status_code == 404 and missing.json() == {"error": "model 'llama3' not found"}
        assert httpx.post(url + "/api/show", json={}, timeout=60).json() == {"error": "model is required"}
        schema = httpx.get(url + "/openapi.json", timeout=60).json()["paths"]["/api/show"]["post"]
        assert "model" in schema["requestBody"]["content"]["application/json"]["schema"]["properties"]
