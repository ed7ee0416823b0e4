"""One (strategy, ratio) configuration served end to end on the loaded model, with its tier traffic counted live.

The model is loaded once; each configuration moves experts to its starting mask, gets a fresh engine (and, for
`dynamic` / `adaptive`, the layerwise GPU prefill streamer and the placement manager), serves the workload, and
leaves the model clean for the next one. A recorder counts, on the device and without synchronising, the
routed pairs, the GPU tier's share, the CPU-tier experts each pass reads, and the experts layerwise prefill
streams; swap copies come from the model's swap statistics.
Legend: T tokens, K top-k, E experts.
"""

from __future__ import annotations

import torch

from tiermoe.analysis.placement_traffic import DYNAMIC_STRATEGIES, strategy_mask
from tiermoe.analysis.placement_workload import Workload
from tiermoe.analysis.workload_runs import RunTiming, make_engine, run_workload
from tiermoe.config import AdaptiveSettings, DynamicPlacementConfig
from tiermoe.engine.dynamic import enable_dynamic_placement
from tiermoe.placement.pass_cost import PassCostModel, expert_cost_model
from tiermoe.stats.recording import PassInfo


class TierTrafficRecorder:
    """Live counterpart of placement_traffic.Traffic, summed over the run (device scalars until read)."""

    enabled = True

    def __init__(self, num_experts: int, device, layerwise_threshold: int | None = None):
        self.num_experts = num_experts
        self.threshold = layerwise_threshold
        zero = lambda: torch.zeros((), dtype=torch.int64, device=device)
        self.pairs, self.gpu_pairs, self.cpu_reads, self.streamed = zero(), zero(), zero(), zero()
        self._layerwise = False

    def begin_pass(self, info: PassInfo) -> None:
        # the streamer takes every MoE call of at least `threshold` rows: a pass's rows are its tokens
        self._layerwise = self.threshold is not None and info.total_tokens >= self.threshold

    def record(self, layer: int, ids_TK: torch.Tensor, gpu_mask_E: torch.Tensor) -> None:
        flat = ids_TK.reshape(-1)
        counts_E = torch.zeros(self.num_experts, dtype=torch.int64, device=flat.device)
        counts_E.index_add_(0, flat, torch.ones_like(flat))
        cold_E = (counts_E > 0) & ~gpu_mask_E
        self.pairs += counts_E.sum()
        if self._layerwise:
            self.gpu_pairs += counts_E.sum()
            self.streamed += cold_E.sum()
        else:
            self.gpu_pairs += (counts_E * gpu_mask_E).sum()
            self.cpu_reads += cold_E.sum()

    def end_pass(self) -> None:
        pass

    def totals(self) -> dict:
        return {"pairs": int(self.pairs), "gpu_pairs": int(self.gpu_pairs), "cpu_expert_reads": int(self.cpu_reads),
                "streamed_experts": int(self.streamed)}


def measure_configuration(llm, workload: Workload, strategy: str, ratio: float, calibration_LE,
                          concurrency: int, prefill_chunk: int, prefill_threshold: int | None,
                          cost: PassCostModel | None = None, seed: int = 42, on_step=None,
                          adaptive: AdaptiveSettings | None = None) -> tuple[RunTiming, dict]:
    """Serve `workload` with `strategy` at `ratio`; returns its timing and traffic (the tier split it had).
    `prefill_threshold` turns on layerwise GPU prefill for the dynamic strategies (KTransformers' update follows
    such batches; adaptive serves its prompts the same way); `cost` is what `adaptive` decides with (default:
    tiermoe.engine.dynamic's, assumed figures), `adaptive` its settings (default: AdaptiveSettings())."""
    hybrid = llm.hybrid
    spec = hybrid.spec
    cost = cost or expert_cost_model(spec.bytes_per_expert(hybrid.expert_dtype), 2.0 * spec.params_per_expert)
    hybrid.apply_mask(strategy_mask(strategy, spec.moe_row_mask(), spec.num_experts, ratio, calibration_LE, seed,
                                    cost, concurrency, spec.top_k))
    dynamic = strategy in DYNAMIC_STRATEGIES
    threshold = prefill_threshold if dynamic else None  # layerwise prefill
    recorder = TierTrafficRecorder(spec.num_experts, hybrid.gpu_device, threshold)
    engine = make_engine(llm, concurrency, prefill_chunk, recorder)
    manager = None
    if dynamic:
        policy = "kt-dynamic" if strategy == "dynamic" else "adaptive"
        dynamic_config = DynamicPlacementConfig(policy=policy, prefill_threshold=threshold,
                                                adaptive=adaptive or AdaptiveSettings())
        manager = enable_dynamic_placement(engine, dynamic_config, cost, calibration_LE=calibration_LE)
    swapped_before = hybrid.swap_stats.bytes
    try:
        timing = run_workload(engine, workload, on_step)
        if manager is not None:
            manager.drain()
    finally:
        if manager is not None:
            manager.close()
        for block in hybrid.blocks.values():
            block.prefill_streamer = None
        engine.close()
    traffic = recorder.totals()
    traffic["swap_bytes"] = hybrid.swap_stats.bytes - swapped_before
    traffic["swaps"] = manager.swaps_started if manager is not None else 0
    return timing, traffic
