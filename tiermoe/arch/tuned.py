"""What discovery cannot know about the families tiermoe has tuned: small overrides, one per model type.

Discovery (tiermoe.arch.discover) reads every structural fact from the modules. Three things it cannot read:
- the on-disk layout of released checkpoints: per-expert keys and their names (Mixtral's `block_sparse_moe.experts
  .{e}.w1/w3/w2`), or GPT-OSS's fused, transposed, interleaved tensors;
- that the block's forward is one tiermoe computes itself (HybridMoE: router, both tiers, shared experts while the
  CPU tier works, and the fused native decode layers around it), and whether it returns the router's scores;
- the routing rule in words (the router module computes it; the words are for `tiermoe inspect`).
A family whose MoE block has a tuned family's block code under another name (tiermoe.arch.code_form: Mellum's is
Qwen3-MoE's, Qwen3.5-MoE's Qwen2-MoE's, Dots1's, Solar-Open's and a dozen more DeepSeek-V3's) is computed by
HybridMoE too (TUNED_BLOCKS), its checkpoint read under its own names. Every other MoE model type runs the model's
own block forward with its experts on the two tiers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tiermoe.arch.code_form import CodeForms
from tiermoe.arch.spec import ExpertDiskLayout
from tiermoe.errors import TiermoeError

PER_EXPERT = ExpertDiskLayout(block="mlp", proj_names=("gate_proj", "up_proj", "down_proj"), fused_kind="transformers")
MIXTRAL_DISK = ExpertDiskLayout(block="block_sparse_moe", proj_names=("w1", "w3", "w2"), fused_kind="transformers")
GPT_OSS_DISK = ExpertDiskLayout(block="mlp", proj_names=("gate_proj", "up_proj", "down_proj"), fused_kind="gpt_oss",
                                transposed=True, interleaved=True)


@dataclass(frozen=True)
class Tuned:
    """A family whose block forward tiermoe computes (block_forward "tiermoe")."""

    disk: ExpertDiskLayout
    router_kind: Callable[[object], str]
    returns_router_scores: bool = False  # the block returns (hidden, router_scores), as GPT-OSS's does
    check: Callable[[object], None] | None = None  # refuses configs transformers builds differently from the release


def _renorm(cfg) -> str:
    return " -> renormalise" if getattr(cfg, "norm_topk_prob", False) else ""


def _softmax_topk(cfg) -> str:
    return f"softmax -> top-k{_renorm(cfg)}"


def _deepseek(cfg) -> str:
    if cfg.model_type == "deepseek_v2":
        method = getattr(cfg, "topk_method", "greedy")
        return f"softmax -> {method} top-k (n_group={cfg.n_group}, topk_group={cfg.topk_group}) x scaling"
    return (f"sigmoid + bias -> group top-k (n_group={cfg.n_group}, topk_group={cfg.topk_group}) -> "
            f"top-k{_renorm(cfg)} x scaling")


def _deepseek_layer_freq(cfg) -> None:
    """The original DeepSeek code skips MoE layers where `layer % moe_layer_freq != 0`; transformers does not, and
    every released checkpoint uses 1, so any other value is refused rather than misread."""
    freq = getattr(cfg, "moe_layer_freq", 1) or 1
    if freq != 1:
        raise TiermoeError(f"moe_layer_freq={freq} is not supported (transformers builds every layer from "
                           "first_k_dense_replace on as MoE); expected 1")


_QWEN = Tuned(PER_EXPERT, _softmax_topk)
_DEEPSEEK = Tuned(PER_EXPERT, _deepseek, check=_deepseek_layer_freq)

TUNED: dict[str, Tuned] = {
    "qwen2_moe": _QWEN,
    "qwen3_moe": _QWEN,
    "qwen3_next": _QWEN,
    "mixtral": Tuned(MIXTRAL_DISK, lambda cfg: "softmax -> top-k -> renormalise"),
    "deepseek_v2": _DEEPSEEK,
    "deepseek_v3": _DEEPSEEK,
    "glm4_moe": _DEEPSEEK,
    "olmoe": _QWEN,
    "gpt_oss": Tuned(GPT_OSS_DISK, lambda cfg: "linear + bias -> top-k -> softmax over k", returns_router_scores=True),
}

_MODELS = "transformers.models"
# the tuned families' MoE block classes -> their model type; HybridMoE computes any block with one of their code
TUNED_BLOCKS = CodeForms({(f"{_MODELS}.{arch}.modeling_{arch}", name): arch for arch, name in (
    ("qwen2_moe", "Qwen2MoeSparseMoeBlock"), ("qwen3_moe", "Qwen3MoeSparseMoeBlock"),
    ("qwen3_next", "Qwen3NextSparseMoeBlock"), ("mixtral", "MixtralSparseMoeBlock"), ("deepseek_v2", "DeepseekV2Moe"),
    ("deepseek_v3", "DeepseekV3MoE"), ("glm4_moe", "Glm4MoeMoE"), ("olmoe", "OlmoeSparseMoeBlock"),
    ("gpt_oss", "GptOssMLP"))})
