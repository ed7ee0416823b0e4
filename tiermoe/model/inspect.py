"""What a checkpoint holds, from config.json and safetensors (or GGUF) headers alone (works on checkpoints larger than
RAM), or from a config.json alone (sizes then counted from the model's modules on the meta device, in the config's
dtype). Beside the sizes: who computes each part (tiermoe.model.catalogue) and what each layer attends with."""

from __future__ import annotations

import copy
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from tiermoe.arch import detect, load_config, text_config
from tiermoe.arch.discover import discover
from tiermoe.checkpoint.expert_cache import find_cache
from tiermoe.model.catalogue import parts_of
from tiermoe.model.gguf_checkpoint import GGUFCheckpoint, open_checkpoint
from tiermoe.model.skeleton import build_skeleton

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
    num_files: int  # 0: config.json alone (sizes from the modules)
    block_forward: str = ""  # who computes each MoE block around its experts
    routed_experts: str = ""  # the tiers' kernels: "GPU tier grouped GEMM; CPU tier native kernels" ...
    layer_kinds: str = ""  # what the layers attend with, and whether the engine's KV pool holds it

    def as_dict(self) -> dict:
        return asdict(self)


def summarize(model_dir: str | Path) -> ModelSummary:
    """The summary of a checkpoint directory, a GGUF model, or a config.json (a file, or a directory holding only
    one)."""
    model_dir = Path(model_dir)
    if model_dir.name == "config.json" and model_dir.is_file():
        model_dir = model_dir.parent
    config = load_config(model_dir)
    spec = detect(config)
    parts = parts_of(spec, discover(text_config(config)))
    common = {"block_forward": parts.block_forward, "routed_experts": parts.routed_experts,
              "layer_kinds": parts.layer_kinds}
    if (model_dir.is_dir() and (model_dir / "config.json").is_file() and find_cache(model_dir) is None
            and not any(model_dir.glob("*.safetensors")) and not any(model_dir.glob("*.gguf"))):
        return _from_config(model_dir, config, spec, common)
    ckpt = open_checkpoint(model_dir, config)
    expert_bytes = sum(e.nbytes for k, e in ckpt.entries.items() if _ROUTED_EXPERT_KEY.search(k))
    non_expert = sum(e.nbytes for k, e in ckpt.entries.items() if not _ROUTED_EXPERT_KEY.search(k))
    expert_dtypes = {e.dtype for k, e in ckpt.entries.items() if _ROUTED_EXPERT_KEY.search(k)}
    dtype = expert_dtypes.pop() if len(expert_dtypes) == 1 else spec.dtype
    if isinstance(ckpt, GGUFCheckpoint):  # GGUF tensors read as fp32 but load in the compute dtype
        dtype = spec.dtype
    return ModelSummary(**_shape(model_dir, spec, dtype), expert_bytes=expert_bytes, non_expert_bytes=non_expert,
                        num_files=len({e.file for e in ckpt.entries.values()}), **common)


def _from_config(model_dir: Path, config, spec, common: dict) -> ModelSummary:
    """Sizes from the module tree: routed experts from the spec, the rest from the meta skeleton's tensors."""
    tied = getattr(text_config(config), "tie_word_embeddings", False)
    skeleton = build_skeleton(copy.deepcopy(config), spec.dtype)  # a copy: building sets the config's dtype
    non_expert = sum(t.numel() * t.element_size() for name, t in skeleton.state_dict().items()
                     if not _ROUTED_EXPERT_KEY.search(name) and not (tied and name == "lm_head.weight"))
    return ModelSummary(**_shape(model_dir, spec, spec.dtype),
                        expert_bytes=spec.total_routed_experts * spec.bytes_per_expert(),
                        non_expert_bytes=non_expert, num_files=0, **common)


def _shape(model_dir: Path, spec, dtype) -> dict:
    shared = "none"
    if spec.shared_kind != "none":
        shared = f"{spec.shared_kind} (intermediate {spec.shared_intermediate_size})"
    return {"model_dir": str(model_dir), "model_type": spec.model_type, "num_layers": spec.num_layers,
            "moe_layers": list(spec.moe_layers), "num_experts": spec.num_experts, "top_k": spec.top_k,
            "router": spec.router_kind, "shared_experts": shared, "hidden_size": spec.hidden_size,
            "expert_intermediate_size": spec.expert_intermediate_size,
            "checkpoint_dtype": str(dtype).removeprefix("torch."), "bytes_per_expert": spec.bytes_per_expert(dtype)}


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
        ("files", str(s.num_files) if s.num_files else "none (config.json alone: sizes from the modules)"),
        ("MoE block", s.block_forward),
        ("routed experts on", s.routed_experts),
        ("layers attend with", s.layer_kinds),
    ]
    width = max(len(k) for k, _ in rows) + 2
    return "\n".join(f"{k:<{width}}{v}" for k, v in rows)
