"""A LoRA adapter merged into the weights as they load: what `tiermoe generate/serve --lora` serve.

PEFT's merge (`merge_and_unload`): every adapted weight W becomes W + scaling * B @ A, the product taken in fp32
(PEFT does so on the host for half-precision factors) and cast to W's dtype before the addition. Non-expert weights
(attention, dense projections, the router) are merged once they are loaded; each routed expert is merged right
after it is read and before its tier takes it, so a quantising CPU tier quantises the merged weights, and experts
that later move between tiers carry the adapter with them. The adapter is data here: tiermoe.training reads an
adapter directory into a MergedLoRA (it knows PEFT's layout), the loader only applies it.
Legend: E experts, D hidden, I intermediate, r rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from tiermoe.errors import TiermoeError
from tiermoe.experts.weights import ExpertWeights

MERGEABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # not FP8 codes: they would need re-quantising


@dataclass(frozen=True)
class LoraDelta:
    """scaling * B @ A for one weight: A [r, in], B [out, r] (or per expert: A [E, r, in], B [E, out, r])."""

    A: torch.Tensor
    B: torch.Tensor
    scaling: float

    def product(self, expert: int | None = None) -> torch.Tensor:
        """The update in fp32: [out, in] (expert `expert`'s when the factors are per expert)."""
        A, B = (self.A, self.B) if expert is None else (self.A[expert], self.B[expert])
        return (B.float() @ A.float()) * self.scaling


def merge_delta(weight: torch.Tensor, delta: LoraDelta, expert: int | None = None) -> None:
    """weight += delta, in place, as PEFT merges (the update cast to the weight's dtype, then added)."""
    update = delta.product(expert).to(weight.device)
    if update.shape != weight.shape:
        raise TiermoeError(f"a LoRA update of shape {list(update.shape)} cannot merge into a weight of shape "
                           f"{list(weight.shape)}")
    weight.add_(update.to(weight.dtype))


@dataclass
class MergedLoRA:
    """An adapter to merge at load time. `weights`: {parameter name in the transformers model (e.g.
    "model.layers.0.self_attn.q_proj.weight"): LoraDelta}; `experts`: {MoE layer: {"gate_up" | "down": LoraDelta
    with per-expert factors [E, ...]}}, canonical layout (gate_up [2I, D], down [D, I])."""

    weights: dict[str, LoraDelta] = field(default_factory=dict)
    experts: dict[int, dict[str, LoraDelta]] = field(default_factory=dict)
    source: str = "the adapter"  # where it came from, for messages

    def merge_non_experts(self, model: nn.Module) -> None:
        """Merge every non-expert update into `model`'s loaded weights."""
        params = dict(model.named_parameters())
        for name, delta in self.weights.items():
            weight = params.get(name)
            if weight is None or weight.is_meta:  # a tied weight (lm_head) is filled from another after this
                raise TiermoeError(f"{self.source} adapts '{name}', which this model does not have as a weight "
                                   "of its own (missing, or tied to another)")
            if weight.dtype not in MERGEABLE_DTYPES:
                raise TiermoeError(f"{self.source} adapts '{name}', which this checkpoint stores as {weight.dtype}; "
                                   "LoRA merges into bf16/fp16/fp32 weights only")
            with torch.no_grad():
                merge_delta(weight.data, delta)

    def merge_expert(self, layer: int, expert: int, weights: ExpertWeights) -> ExpertWeights:
        """Expert `expert` of `layer` with its update merged (in place; host tensors as read)."""
        deltas = self.experts.get(layer)
        if deltas:
            with torch.no_grad():
                if "gate_up" in deltas:
                    merge_delta(weights.gate_up, deltas["gate_up"], expert)
                if "down" in deltas:
                    merge_delta(weights.down, deltas["down"], expert)
        return weights

    def adapts_experts(self, layer: int | None = None) -> bool:
        return bool(self.experts) if layer is None else bool(self.experts.get(layer))
