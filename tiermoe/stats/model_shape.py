"""What a recorder needs to know about a model: its layer and expert counts, top-k and MoE layers.

Recorders take this small dataclass instead of an ArchSpec so `tiermoe.stats` stays model-free; build it from a
spec with `ModelShape.of(spec)`. Layer indices are decoder-layer indices (dense layers included), the row
numbering of SGLang's `logical_count [buf, num_hidden_layers, E]`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    num_layers: int  # num_hidden_layers, dense layers included
    num_experts: int  # routed experts per MoE layer
    top_k: int  # experts each token is routed to
    moe_layers: tuple[int, ...]
    model_type: str = "unknown"

    def __post_init__(self):
        object.__setattr__(self, "moe_layers", tuple(int(x) for x in self.moe_layers))
        if self.num_layers < 1 or self.num_experts < 1 or self.top_k < 1:
            raise ValueError(f"ModelShape needs num_layers, num_experts and top_k >= 1, got "
                             f"{self.num_layers}, {self.num_experts}, {self.top_k}")
        bad = [x for x in self.moe_layers if not 0 <= x < self.num_layers]
        if bad:
            raise ValueError(f"moe_layers {bad} are outside 0..{self.num_layers - 1}")

    @classmethod
    def of(cls, spec) -> ModelShape:
        """From an ArchSpec (or anything with the same five attributes)."""
        return cls(spec.num_layers, spec.num_experts, spec.top_k, tuple(spec.moe_layers), spec.model_type)

    @property
    def layer_to_moe_index(self) -> dict[int, int]:
        """Decoder layer -> position among the MoE layers (the M axis of per-token traces)."""
        return {layer: m for m, layer in enumerate(self.moe_layers)}

    def metadata(self) -> dict:
        """The model fields every dump carries (plain Python values: loadable with weights_only=True)."""
        return {"model_type": self.model_type, "num_layers": self.num_layers, "num_experts": self.num_experts,
                "top_k": self.top_k, "moe_layers": list(self.moe_layers)}
