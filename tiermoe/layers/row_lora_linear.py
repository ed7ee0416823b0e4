"""RowLoRALinear: a linear layer with LoRA per row of the step, for adapters served per request.

It takes a linear's place (nn.Linear, or a QuantizedLinear of packed non-expert weights) while an adapter served
per request adapts it, and computes base(x) + the delta of each row's own adapter (tiermoe.layers.lora_stack);
a step without an adapter row costs one Python call more than the linear alone. The linear is its child
`base_layer` (PEFT's name for the layer a LoRA wraps). DecodeFusedAttention, which computes q, k and v with one
product of their concatenated weights, adds its projections' deltas to that product itself (`lora.delta`).
"""

from __future__ import annotations

import torch
from torch import nn

from tiermoe.layers.lora_stack import LoRAStack


class RowLoRALinear(nn.Module):
    def __init__(self, base: nn.Module, lora: LoRAStack):
        super().__init__()
        self.base_layer = base
        self.lora = lora
        self.in_features, self.out_features = base.in_features, base.out_features

    @property
    def weight(self):
        return getattr(self.base_layer, "weight", None)

    @property
    def bias(self):
        return getattr(self.base_layer, "bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        if not self.lora.rows.active:
            return y
        delta = self.lora.delta(x)
        return y if delta is None else y + delta

    def extra_repr(self) -> str:
        return f"per-request LoRA of slots {sorted(self.lora.slots)}"
