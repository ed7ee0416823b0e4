"""`--enable-expert-distribution-metrics`: per-layer expert routing on /metrics while serving.

SGLang's flag exports how evenly the experts are loaded (`eplb_balancedness`: mean load / max load) and a
histogram of the experts each pass selects. tiermoe has one server and two tiers, so it exports per MoE layer:
the (token, expert) pairs routed and how many the GPU tier served, the experts used at least once, and the
balancedness of the experts' load since the start. Counting stays on the device (two small additions per layer
per pass, no host sync); only a /metrics read copies the counts.
"""

from __future__ import annotations

import torch

from tiermoe.stats.recording import PassInfo


class ExpertLoadCounter:
    """A recorder (tiermoe.stats.recording) counting routed pairs per (layer, expert) and GPU-tier pairs per layer."""

    enabled = True

    def __init__(self, num_layers: int, num_experts: int, device: torch.device | str = "cpu"):
        self.count_LE = torch.zeros(num_layers, num_experts, dtype=torch.int64, device=device)
        self.gpu_pairs_L = torch.zeros(num_layers, dtype=torch.int64, device=device)

    def begin_pass(self, info: PassInfo) -> None:
        pass

    def record(self, layer: int, ids_TK: torch.Tensor, gpu_mask_E: torch.Tensor) -> None:
        ids = ids_TK.reshape(-1).to(torch.int64)
        self.count_LE[layer].index_add_(0, ids, torch.ones_like(ids))
        self.gpu_pairs_L[layer] += gpu_mask_E[ids].sum()

    def end_pass(self) -> None:
        pass

    def layer_rows(self) -> list[dict]:
        """Per layer that routed anything: layer, pairs, gpu_pairs, active experts, balancedness (mean / max)."""
        counts, gpu = self.count_LE.cpu(), self.gpu_pairs_L.cpu().tolist()
        rows = []
        for layer, row in enumerate(counts):
            pairs = int(row.sum())
            if pairs:
                rows.append({"layer": layer, "pairs": pairs, "gpu_pairs": gpu[layer],
                             "active_experts": int((row > 0).sum()),
                             "balancedness": round(float(row.double().mean() / row.max()), 6)})
        return rows


# metric name -> (Prometheus type, help, the row's field)
LAYER_METRICS = {
    "expert_routed_pairs_total": ("counter", "(token, expert) pairs routed by the layer.", "pairs"),
    "expert_gpu_tier_pairs_total": ("counter", "Routed pairs the GPU tier served.", "gpu_pairs"),
    "expert_active_experts": ("gauge", "Experts of the layer routed to at least once.", "active_experts"),
    "expert_balancedness": ("gauge", "Mean over max of the layer's expert loads (1: even; SGLang's "
                                     "eplb_balancedness).", "balancedness"),
}


def render_expert_metrics(counter: ExpertLoadCounter) -> str:
    """The per-layer metrics in the Prometheus text format, labelled by layer."""
    rows = counter.layer_rows()
    lines = []
    for name, (kind, help_text, field) in LAYER_METRICS.items():
        lines += [f"# HELP tiermoe_{name} {help_text}", f"# TYPE tiermoe_{name} {kind}"]
        lines += [f'tiermoe_{name}{{layer="{row["layer"]}"}} {row[field]}' for row in rows]
    return "\n".join(lines) + "\n"
