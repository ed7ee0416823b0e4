"""One routed expert's weights in tiermoe's canonical layout, whatever the checkpoint's layout was.

gate_up [2I, H] (gate rows first, then up rows, as transformers fuses them), down [H, I], and for GPT-OSS the
biases gate_up_bias [2I] and down_bias [H]. GPT-OSS's interleaved, transposed tensors are rearranged into this
layout once at load, so every backend computes one layout.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class ExpertWeights:
    gate_up: torch.Tensor  # [2I, H]
    down: torch.Tensor  # [H, I]
    gate_up_bias: torch.Tensor | None = None  # [2I]
    down_bias: torch.Tensor | None = None  # [H]

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (getattr(self, f.name) for f in fields(self)) if t is not None]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @property
    def device(self) -> torch.device:
        return self.gate_up.device

    def to(self, device: torch.device | str, pin: bool = False) -> ExpertWeights:
        """A copy on `device` (host copies pinned when `pin`); the copy has landed when this returns."""
        device = torch.device(device)

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            if device.type == "cpu":
                out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
                return out.copy_(t)
            return t.to(device, copy=True)

        return ExpertWeights(*(move(getattr(self, f.name)) for f in fields(self)))
