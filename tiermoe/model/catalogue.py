"""Who computes each part of a MoE model, and the page of every architecture (docs/architectures.md), from the code.

For one model: who computes the MoE block around its routed experts (tiermoe's HybridMoE, or the model's own
forward), where the routed experts compute (the GPU tier's grouped GEMMs; the CPU tier's native kernels, or torch
for an activation they do not have) and what each layer attends with (and whether the engine's KV pool holds it).
The router, shared experts, attention and norms always run on the main device (the GPU, or the CPU when CPU-only).
The page lists every MoE causal LM of the installed transformers (tiermoe.arch.zoo), each discovered from its
default config; `tiermoe inspect --architectures` prints it, and a test keeps the file equal to it.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

import transformers
from transformers import AutoConfig

from tiermoe.arch import detect, text_config
from tiermoe.arch.code_form import CodeForms, import_class
from tiermoe.arch.discover import Discovery, discover
from tiermoe.arch.spec import ArchSpec
from tiermoe.arch.unset_fields import MOE_SWITCH, with_moe_path
from tiermoe.arch.zoo import moe_causal_lm_types
from tiermoe.errors import TiermoeError
from tiermoe.layers.fused_attention import ATTENTION_FORMS
from tiermoe.layers.fused_decode_layer import LAYER_FORMS
from tiermoe.layers.fused_grouped_router import GROUPED_ROUTER_FORMS
from tiermoe.layers.fused_norm import NORM_FORMS
from tiermoe.layers.fused_router import ROUTER_FORMS
from tiermoe.layers.mla_attention import replaced_by_mla_attention
from tiermoe.layers.pool_kinds import pool_lacks

CPU_KERNEL_ACTIVATIONS = ("silu_glu", "gpt_oss_glu")  # what tiermoe.experts.native computes with its kernels
# Default configs that leave the routed top-k unset (None), where every release sets it: the page shows the family
# with the releases' value (DeepSeek-V2 and V2-Lite route each token to 6 experts).
RELEASE_TOP_K = {"deepseek_v2": 6}


@dataclass(frozen=True)
class Parts:
    block_forward: str
    routed_experts: str
    layer_kinds: str
    engine: str  # "yes", or what the KV pool lacks
    decode: str  # the fused native decode paths this family's layers take on a CPU main device


def parts_of(spec: ArchSpec, found: Discovery) -> Parts:
    if spec.block_forward == "tiermoe":
        block = "HybridMoE (the model's router; shared experts beside the CPU tier)"
    elif spec.experts_call == "around":
        block = f"the model's own {found.block_class} ({found.experts.cls}'s own forward around the two tiers)"
    elif spec.experts_call == "every_expert":
        block = (f"the model's own {found.block_class} (of the every-expert rows it hands {found.experts.cls}, the "
                 "router's picks on the two tiers)")
    else:
        block = f"the model's own {found.block_class} (its experts module on the two tiers)"
    if spec.activation in CPU_KERNEL_ACTIVATIONS:
        cpu = "native kernels (bf16 / int8 / int4 / int6)"
    else:
        cpu = f"torch, exactly ({found.experts.act_name}: no native kernel yet)"
    experts = f"GPU tier: grouped GEMMs; CPU tier: {cpu}"
    counts = Counter(found.layer_kinds)
    kinds = ", ".join(f"{kind} x{n}" for kind, n in counts.items())
    lacking = sorted({k.split("+")[0] for k in counts if pool_lacks(k)})
    engine = "yes" if not lacking else "no: the KV pool lacks " + ", ".join(lacking)
    return Parts(block, experts, f"{kinds} (engine: {engine})", engine, _decode_paths(spec, found))


def _decode_paths(spec: ArchSpec, found: Discovery) -> str:
    """The fused native decode paths (bf16, CPU main device, kernels built) the family's modules take: those
    whose classes have the code of the paths' reference classes (tiermoe.arch.code_form)."""
    classes = [c for c in (import_class(*key) for key in found.module_classes) if c is not None]

    def taken(forms: CodeForms) -> bool:
        return any(forms.of(c) is not None for c in classes)

    attention, router = taken(ATTENTION_FORMS), taken(ROUTER_FORMS)
    paths = []
    if (attention and router and taken(LAYER_FORMS) and spec.block_forward == "tiermoe"
            and found.shared_kind == "none"):
        paths.append("whole layer in one native call")
    if attention:
        paths.append("fused attention")
    if any(replaced_by_mla_attention(c) for c in classes):
        paths.append("MLA attention in one native call")
    if router or taken(GROUPED_ROUTER_FORMS):
        paths.append("fused router")
    if taken(NORM_FORMS):
        paths.append("fused norms")
    return ", ".join(paths) or "per op"


def catalogue_rows() -> list[tuple[str, ...]]:
    """(model type, MoE block, experts, routed experts on, layers, engine, decode) per architecture."""
    rows = []
    for model_type in moe_causal_lm_types():
        try:
            cfg, left = _readable_config(model_type)
            spec = detect(cfg)
            found = discover(cfg)
        except (TiermoeError, ValueError, TypeError) as err:
            rows.append((model_type, f"not run: {_one_line(err)}", "", "", "", "no", ""))
            continue
        parts = parts_of(spec, found)
        unset = [name for name in left if not MOE_SWITCH.match(name)]
        switched = [name for name in left if MOE_SWITCH.match(name)]
        counts_unset = any(re.search(r"experts|top_k|topk|per_tok", name) for name in unset)
        experts = ((f"{spec.num_experts} x top-{spec.top_k}" if not counts_unset else "set by each release")
                   + f", {found.experts.act_name}" + (", biases" if spec.expert_bias else "")
                   + ("" if spec.gated else ", no gate")
                   + (" (top-k of the releases)" if model_type in RELEASE_TOP_K else "")
                   + (f"; the default config leaves {', '.join(unset)} unset" if unset else "")
                   + (f"; MoE where a release sets {', '.join(switched)} (the default config is dense)"
                      if switched else ""))
        rows.append((model_type, parts.block_forward, experts, parts.routed_experts,
                     ", ".join(dict.fromkeys(k.split("+")[0] for k in found.layer_kinds)), parts.engine, parts.decode))
    return rows


def _readable_config(model_type: str):
    """(config, names stood in): the family's default config (with the releases' top-k where RELEASE_TOP_K gives
    it), or where that builds no MoE model, the same with the fields it leaves to its releases stood in and its MoE
    switches on (tiermoe.arch.unset_fields), which the page names."""
    release_values = {"num_experts_per_tok": RELEASE_TOP_K[model_type]} if model_type in RELEASE_TOP_K else {}
    cfg = text_config(AutoConfig.for_model(model_type, **release_values))
    try:
        detect(cfg)
        return cfg, []
    except (TiermoeError, ValueError, TypeError):
        fields, changed = with_moe_path(cfg.to_dict(), lambda name: _stand_in(name, cfg))
        if not changed:
            raise
        for name in ("model_type", "transformers_version"):
            fields.pop(name, None)
        return AutoConfig.for_model(cfg.model_type, **fields), changed


def _stand_in(name: str, cfg) -> int:
    """A value that builds the family's modules (the page shows the field as its releases', not this)."""
    if name == "head_dim":
        return cfg.hidden_size // cfg.num_attention_heads
    if re.search(r"per_tok|top_k|topk|group|shared", name):
        return 1
    return cfg.hidden_size if "intermediate_size" in name else 8


def catalogue_markdown() -> str:
    header = ("model type", "MoE block", "experts (default config)", "routed experts on", "layers attend with",
              "engine", "CPU decode")
    intro = (
        "Generated by `tiermoe inspect --architectures` from the code (tiermoe.model.catalogue), for transformers "
        f"{transformers.__version__}: every causal LM whose modeling file has a fused experts module, each discovered "
        "from its default config on the meta device (tiermoe.arch.discover); where that config leaves a field the MoE "
        "path needs to the releases, or is dense, the row names it, and the structure is read with a stand-in "
        "(tiermoe.arch.unset_fields). The router, the shared experts, "
        "attention and norms run on the main device (the GPU; the CPU when CPU-only); the routed experts on the two "
        "tiers. \"engine\": whether the engine's KV pool holds every layer kind (a model it does not still runs "
        "through `hybrid(input_ids=...)` with transformers' caches). \"CPU decode\": the fused native decode paths "
        "the family's modules take on a CPU main device in bf16: those whose code is one the path was written for, "
        "under any class name (tiermoe.arch.code_form); MLA's call, transformers' DeepSeek-V2 / V3 attention "
        "classes themselves (tiermoe.layers.mla_attention). Do not edit by hand: "
        "`tiermoe inspect --architectures > docs/architectures.md`."
    )
    lines = [
        "# Architectures",
        "",
        intro,
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in catalogue_rows()]
    return "\n".join(lines) + "\n"


def _one_line(err: Exception) -> str:
    return str(err).splitlines()[0][:160]
