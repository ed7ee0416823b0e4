"""Per-layer GPU-tier hit counting while serving: the share of routed (token, expert) pairs the GPU tier served.

A recorder (see recording.py) whose counters stay on the GPU device: recording adds two small device-side
additions per MoE layer and never synchronises with the host; reading the rates does.
"""

from __future__ import annotations

import torch

from tiermoe.stats.recording import PassInfo


class TierHitCounter:
    enabled = True

    def __init__(self, num_layers: int, device: torch.device | str = "cpu"):
        self.pairs_L = torch.zeros(num_layers, dtype=torch.int64, device=device)
        self.gpu_pairs_L = torch.zeros(num_layers, dtype=torch.int64, device=device)

    def begin_pass(self, info: PassInfo) -> None:
        pass

    def record(self, layer: int, ids_TK: torch.Tensor, gpu_mask_E: torch.Tensor) -> None:
        self.pairs_L[layer] += ids_TK.numel()
        self.gpu_pairs_L[layer] += gpu_mask_E[ids_TK].sum()

    def end_pass(self) -> None:
        pass

    def layer_hit_rates(self) -> list[float | None]:
        """Per layer: GPU pairs / all pairs, None for layers that routed nothing (dense, or no traffic yet)."""
        pairs, gpu = self.pairs_L.cpu().tolist(), self.gpu_pairs_L.cpu().tolist()
        return [g / p if p else None for p, g in zip(pairs, gpu)]

    def hit_rate(self) -> float | None:
        pairs = int(self.pairs_L.sum())
        return int(self.gpu_pairs_L.sum()) / pairs if pairs else None
