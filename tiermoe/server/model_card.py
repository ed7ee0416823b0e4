"""What the server says about its model in Ollama's words (/api/show, /api/tags): details {format, family,
parameter_size, quantization_level} and model_info's GGUF-style keys ("general.architecture",
"<arch>.block_count", ...), from the loaded model's config and its checkpoint.

The parameter count is the checkpoint's, read from its headers (safetensors or GGUF; a `tiermoe convert` cache: its
source's): what the tiers hold is no measure, since they may hold weights packed (int4 experts, bf16 or int8
non-expert weights computed by tiermoe's own kernels), and packed weights are buffers of another shape, not
parameters. FP8 block scales are not counted (Ollama's count is the weights')."""

from __future__ import annotations

import json

import torch

from tiermoe.engine.llm import LLM
from tiermoe.errors import TiermoeError
from tiermoe.model.gguf_checkpoint import open_checkpoint, weight_files

# dtype -> Ollama's quantization_level name (GGML's type names)
_LEVELS = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int8: "Q8_0"}
# model_info "<arch>.<key>" -> the config field it reads (the first one the config has)
_INFO_FIELDS = {
    "block_count": ("num_hidden_layers",), "context_length": ("max_position_embeddings",),
    "embedding_length": ("hidden_size",), "feed_forward_length": ("intermediate_size",),
    "attention.head_count": ("num_attention_heads",), "attention.head_count_kv": ("num_key_value_heads",),
    "expert_count": ("num_experts", "num_local_experts", "n_routed_experts"),
    "expert_used_count": ("num_experts_per_tok",), "expert_feed_forward_length": ("moe_intermediate_size",),
    "rope.freq_base": ("rope_theta",), "vocab_size": ("vocab_size",),
}


_SCALE_SUFFIX = "_scale_inv"  # an FP8 weight's block scales beside it (tiermoe.checkpoint.fp8's name)


def parameter_count(llm: LLM) -> int:
    """The parameters of the checkpoint the model was loaded from. Should its files be unreadable now (moved since
    loading), the module tree's parameters plus the routed experts' (their bytes in the tiers over their dtype)."""
    try:
        with open_checkpoint(llm.model_dir) as ckpt:
            entries = ckpt.entries
            return sum(entry.numel for name, entry in entries.items()
                       if not (name.endswith(_SCALE_SUFFIX) and name.removesuffix(_SCALE_SUFFIX) in entries))
    except (OSError, TiermoeError):
        hybrid = llm.hybrid
        size = hybrid.tier_bytes()
        experts = (size.gpu_experts + size.cpu_experts) // hybrid.expert_dtype.itemsize
        return sum(p.numel() for p in hybrid.model.parameters()) + experts


def parameter_size(count: int) -> str:
    """Ollama's short form: "30.5B", "494.03M", "12.00K"."""
    if count >= 10**9:
        return f"{count / 1e9:.1f}B"
    if count >= 10**6:
        return f"{count / 1e6:.2f}M"
    return f"{count / 1e3:.2f}K"


def details(llm: LLM, parameters: int) -> dict:
    """Ollama's `details`; `parameters`: parameter_count(llm) (the server reads the checkpoint once)."""
    family = llm.hybrid.spec.model_type
    is_gguf = any(path.suffix == ".gguf" for path in weight_files(llm.model_dir))
    return {"parent_model": "", "format": "gguf" if is_gguf else "safetensors", "family": family,
            "families": [family], "parameter_size": parameter_size(parameters),
            "quantization_level": _LEVELS.get(llm.hybrid.expert_dtype, str(llm.hybrid.expert_dtype))}


def model_info(llm: LLM, parameters: int) -> dict:
    config = llm.hybrid.config
    config = getattr(config, "text_config", None) or config
    arch = llm.hybrid.spec.model_type
    info = {"general.architecture": arch, "general.parameter_count": parameters}
    for key, names in _INFO_FIELDS.items():
        value = next((getattr(config, n) for n in names if getattr(config, n, None) is not None), None)
        if value is not None:
            info[f"{arch}.{key}"] = value
    return info


def generation_parameters(llm: LLM) -> str:
    """Ollama's `parameters` text ("name value" lines) from generation_config.json's sampling defaults."""
    path = llm.model_dir / "generation_config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return ""
    names = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
             "repetition_penalty": "repeat_penalty"}
    return "\n".join(f"{ours} {config[theirs]}" for theirs, ours in names.items()
                     if isinstance(config.get(theirs), (int, float)) and not isinstance(config.get(theirs), bool))


def modelfile(llm: LLM, template: str, parameters: str) -> str:
    """An Ollama Modelfile that describes the served model (FROM its directory)."""
    lines = [f"FROM {llm.model_dir}"]
    if template:
        lines.append(f'TEMPLATE """{template}"""')
    lines += [f"PARAMETER {line}" for line in parameters.splitlines()]
    return "\n".join(lines) + "\n"
