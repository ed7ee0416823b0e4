"""What a checkpoint holds, from config.json and safetensors (or GGUF) headers alone (works on checkpoints larger than RAM)."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path

from tiermoe.arch import detect, load_config
from tiermoe.model.gguf_checkpoint import GGUFCheckpoint, open_checkpoint

_ROUTED_EXPERT_KEY = re.compile(r"\.experts\.")


@dataclass(frozen=True)
class ModelSummary:
    model_dir: str
    model_type: str
    num_layers: int
    moe_layers: list[int]
    num_experts: int
    top_k: int
    router: str
    shared_experts: str
    hidden_size: int
    expert_intermediate_size: int
    checkpoint_dtype: str
    bytes_per_expert: int
    expert_bytes: int
    non_expert_bytes: int
    num_files: int

    def as_dict(self) -> dict:
        return asdict(self)


def summarize(model_dir: str | Path) -> ModelSummary:
    model_dir = Path(model_dir)
    config = load_config(model_dir)
    spec = detect(config)
    ckpt = open_checkpoint(model_dir, config)
    expert_bytes = sum(e.nbytes for k, e in ckpt.entries.items() if _ROUTED_EXPERT_KEY.search(k))
    non_expert = sum(e.nbytes for k, e in ckpt.entries.items() if not _ROUTED_EXPERT_KEY.search(k))
    expert_dtypes = {e.dtype for k, e in ckpt.entries.items() if _ROUTED_EXPERT_KEY.search(k)}
    dtype = expert_dtypes.pop() if len(expert_dtypes) == 1 else spec.dtype
    if isinstance(ckpt, GGUFCheckpoint):  # GGUF tensors read as fp32 but load in the compute dtype
        dtype = spec.dtype
    shared = "none"
    if spec.shared_kind != "none":
        shared = f"{spec.shared_kind} (intermediate {spec.shared_intermediate_size})"
    return ModelSummary(
        model_dir=str(model_dir), model_type=spec.model_type, num_layers=spec.num_layers,
        moe_layers=list(spec.moe_layers), num_experts=spec.num_experts, top_k=spec.top_k, router=spec.router_kind,
        shared_experts=shared, hidden_size=spec.hidden_size, expert_intermediate_size=spec.expert_intermediate_size,
        checkpoint_dtype=str(dtype).removeprefix("torch."), bytes_per_expert=spec.bytes_per_expert(dtype),
        expert_bytes=expert_bytes, non_expert_bytes=non_expert,
        num_files=len({e.file for e in ckpt.entries.values()}),
    )


def _ranges(layers: list[int]) -> str:
    out, start = [], None
    for i, layer in enumerate(layers):
        if start is None:
            start = layer
        if i + 1 == len(layers) or layers[i + 1] != layer + 1:
            out.append(f"{start}" if start == layer else f"{start}-{layer}")
            start = None
    return ", ".join(out)


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def format_summary(s: ModelSummary) -> str:
    total_experts = len(s.moe_layers) * s.num_experts
    rows = [
        ("model", s.model_dir),
        ("architecture", s.model_type),
        ("layers", f"{s.num_layers} ({len(s.moe_layers)} MoE: {_ranges(s.moe_layers)})"),
        ("experts", f"{s.num_experts} per MoE layer, top-{s.top_k} ({total_experts} routed experts in all)"),
        ("router", s.router),
        ("shared experts", s.shared_experts),
        ("expert shape", f"hidden {s.hidden_size}, intermediate {s.expert_intermediate_size}"),
        ("bytes per expert", f"{_size(s.bytes_per_expert)} ({s.checkpoint_dtype})"),
        ("routed experts", _size(s.expert_bytes)),
        ("non-expert weights", _size(s.non_expert_bytes)),
        ("files", str(s.num_files)),
    ]
    width = max(len(k) for k, _ in rows) + 2
    return "\n".join(f"{k:<{width}}{v}" for k, v in rows)
