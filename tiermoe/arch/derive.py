"""An ArchSpec from what discovery read (tiermoe.arch.discover), with a tuned family's overrides
(tiermoe.arch.tuned) where it has them."""

from __future__ import annotations

from tiermoe.arch.code_form import import_class
from tiermoe.arch.common import config_dtype
from tiermoe.arch.discover import Discovery
from tiermoe.arch.disk_names import on_disk, released_names
from tiermoe.arch.spec import ArchSpec, ExpertDiskLayout
from tiermoe.arch.tuned import TUNED, TUNED_BLOCKS


def spec_of(cfg, found: Discovery) -> ArchSpec:
    """The spec of `cfg`'s model. A tuned family keeps its disk layout and HybridMoE's block forward; any other
    has its checkpoint read under the names transformers' conversion mapping gives its releases (per-expert
    projections, renamed blocks and tensors), or as transformers' own modules name them, and runs HybridMoE's block
    forward where its block has a tuned family's block code (TUNED_BLOCKS), else its own."""
    tuned = TUNED.get(cfg.model_type)
    experts = found.experts
    if tuned is not None and tuned.check is not None:
        tuned.check(cfg)
    if tuned is not None:
        disk, router_kind, scores, forward = tuned.disk, tuned.router_kind(cfg), tuned.returns_router_scores, "tiermoe"
    else:
        released = released_names(cfg.model_type)
        names = released.projections or (("gate_proj" if experts.gated else ""), "up_proj", "down_proj")
        block = on_disk(f".{found.moe_path}.", released.renames)[-1].strip(".") if found.moe_path else ""
        disk = ExpertDiskLayout(block=block, proj_names=names, fused_kind="transformers",
                                transposed=experts.transposed, interleaved=experts.interleaved,
                                renames=released.renames)
        like = _tuned_block(found)
        router_kind, forward = f"the model's own {found.router_class}", "model" if like is None else "tiermoe"
        scores = like is not None and TUNED[like].returns_router_scores
    return ArchSpec(
        model_type=cfg.model_type,
        num_layers=found.num_layers,
        moe_layers=found.moe_layers,
        num_experts=experts.num_experts,
        top_k=found.top_k,
        hidden_size=experts.hidden_size,
        expert_intermediate_size=experts.intermediate_size,
        router_kind=router_kind,
        router_attr=found.router_attr,
        shared_kind=found.shared_kind,
        shared_intermediate_size=found.shared_intermediate_size,
        activation=experts.activation,
        expert_bias=experts.bias,
        returns_router_scores=scores,
        disk=disk,
        dtype=config_dtype(cfg),
        moe_path=found.moe_path,
        block_forward=forward,
        gated=experts.gated,
        experts_call=experts.call,
    )


def _tuned_block(found: Discovery) -> str | None:
    """The tuned family whose MoE block's code the model's block has (experts called through the interface, as
    HybridMoE calls them), or None."""
    block = import_class(*found.block_key) if found.block_key[0] else None
    if block is None or found.experts.call != "interface":
        return None
    return TUNED_BLOCKS.of(block)
