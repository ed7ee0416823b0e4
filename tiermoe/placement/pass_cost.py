"""THE cost model: what a forward pass costs under a placement, and what one expert and one copy cost, from one
set of parameters (measured CPU tier, profiled GPU tier, host overhead).

`tiermoe bench placement` estimates every cell with it and validates it against measured runs (`--gpu-profile
this-cpu`, within 15%); `tiermoe bench dynamic` replays traces with it; the adaptive policy decides swaps with its
per-expert reading (`expert_seconds`, `copy_seconds`), so what the benchmark checks is what serving decides with.
Where nothing was measured, `expert_cost_model` fills the parameters with assumed figures.

Per pass p (sequences s, MoE layers m):
    T_p = t_step + t_seq x sequences_p                                      host: the step's dispatch, bookkeeping,
                                                                            sampling, per sequence and per step
          (+) [kernels_forward x launch + roofline(weights + sum_s KV read, sum_s flops)]   ONE non-expert forward
                                                                            over all the pass's sequences
        + sum_m [ dispatch(ops_layer) + cpu_called x t_op x ops_cpu_call    router, split, combine
                  + combine( CPU tier: a d_c + b p_c + c (+ hidden rows over PCIe),
                             GPU tier: dispatch(ops_gpu_call (+ d_g ops_expert)) (+) roofline(d_g expert bytes,
                                                                                           p_g pair flops) ) ]
        + copies that block (layerwise prefill streaming; on one CPU also swap copies)
- The CPU tier (a, b, c) is measured on this machine's CPU backend (tiermoe.analysis.tier_time_fit).
- The GPU tier, the non-expert device work and copies come from a GPUProfile (bandwidth, flops, PCIe, launch).
  With this-cpu the profile is this CPU's microbenchmarks (tiermoe.analysis.device_profile) and the GPU tier's
  experts are timed directly like the CPU tier's (`gpu_tier`: a d_g + b p_g): the tier's own expert loop does not
  run at the rate of one large matrix, and the rest of the forward does not run at the rate of the expert loop.
- Host costs are measured on this machine and carried to the estimate (the GPU machine's host runs the same
  Python): t_op per op dispatched in the MoE blocks, from the experts' loop timed on tiny experts; t_step per
  step (the forward's dispatch) and t_seq per sequence in it (its pages, its sampling), fitted on timed runs
  (tiermoe.analysis.host_cost_fit).
- The GPU tier's ops: its grouped GEMM (tiermoe.experts.slotted_tier) dispatches the same ops whatever experts
  it computes, so a call costs ops_gpu_call and no op per expert; on a device where torch loops over the groups
  (GPUProfile.fused_grouped_gemm False) each expert adds two kernel launches. Where the tier computes expert by
  expert, each distinct expert adds its ops (ModelCosts.per_expert).
- With a GPU beside the CPU (`device_is_host` False) the device runs behind the host, so host (+) device is
  max(host seconds, kernels x launch + roofline). With the GPU tier on the host CPU (this-cpu) the caller thread
  computes it itself, so host and device time add up, the layerwise streamer copies nothing (the weights are
  already there), and swap copies take the cores' time.
- `tiers_overlap`: beside a GPU the CPU tier computes while the GPU tier does (combine = max). On one CPU they
  take turns (combine = sum: they share cores, caches and memory bandwidth), and a layer in which both compute
  pays `both_tiers_seconds` more (the caller and the CPU tier's worker contend for the GIL and the caches);
  host_cost_fit measures it on a timed run at a split no validation uses. (A term scaled by the smaller tier's time,
  lambda x min(cpu, gpu), was tried and fitted worse: +13 to +24% at the validation ratios, native backend.)
- One expert (what a dynamic policy weighs): the same tier terms read for one expert: on the CPU tier a when a
  pass touches it plus b per routed pair; on the GPU tier its dispatch and its own roofline (or the timed a, b).
  Per-call terms (c, the rows' PCIe round trip, t_both) do not change with one expert and are left out.
Legend: P passes, M MoE layers, S (pass, sequence) rows.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

from tiermoe.placement.model_costs import NO_OPS, ModelCosts, OpCount
from tiermoe.placement.pass_traffic import PassShapes, Traffic
from tiermoe.placement.profiles import PRESETS, GPUProfile
from tiermoe.placement.tier_time import TierFit, assumed_cpu_tier

DEFAULT_GPU = "rtx4090"  # the GPU profile assumed where none is given
# torch's grouped GEMM where it loops over the groups (GPUProfile.fused_grouped_gemm False): one matrix product per
# expert and projection, launched from C++ (no Python op). Not counted: the offsets' copy to the host it waits for.
GROUPED_GEMM_LOOP = OpCount(ops=0.0, kernels=2.0)


def _maximum(a, b):
    """torch.maximum, or numpy's where a side is a numpy array: the GPU tier's seconds also take the placement
    math's arrays (tiermoe.placement.tier_balance runs in numpy: tiny arrays, where torch's intra-op threads cost
    milliseconds an op on a busy 2-core box)."""
    if isinstance(a, (np.ndarray, np.generic)) or isinstance(b, (np.ndarray, np.generic)):
        return np.maximum(a, b)
    return torch.maximum(a, b)


@dataclass(frozen=True)
class HostCosts:
    """Host-side seconds, fitted on timed runs of this machine (see tiermoe.analysis.host_cost_fit)."""

    op_seconds: float  # per framework op dispatched in a MoE block (Python, dispatcher, small-tensor kernels)
    step_seconds: float  # per engine step
    sequence_seconds: float  # per sequence in a step: dispatching its non-expert forward, thread hand-offs
    fit: dict | None = None  # how they were fitted: runs, passes, residual

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class PassCostModel:
    profile: GPUProfile
    model: ModelCosts
    cpu: TierFit
    host: HostCosts
    device_is_host: bool = False  # the GPU tier runs on the host CPU (this-cpu), in the caller thread
    tiers_overlap: bool = True  # the CPU tier computes while the GPU tier does (a device of its own)
    both_tiers_seconds: float = 0.0  # extra per layer call in which both tiers compute (one CPU), measured
    gpu_tier: TierFit | None = None  # this-cpu: the GPU tier as timed (a, b) instead of the profile's roofline
    # this-cpu: seconds per pass added to the non-expert forward's estimate (<= 0 where the profile's one-core
    # roofline overstates a forward that runs on every core; fitted on the calibration runs, host_cost_fit)
    forward_correction_seconds: float = 0.0

    # ---- building blocks (tensor-friendly) -------------------------------------------------------------
    def combine(self, cpu: torch.Tensor, gpu: torch.Tensor) -> torch.Tensor:
        """A MoE layer's seconds from its two tiers' (tensors): the slower where they overlap, else both."""
        return _maximum(cpu, gpu) if self.tiers_overlap else cpu + gpu

    def _dispatch(self, count: OpCount, times: torch.Tensor, device_seconds: torch.Tensor) -> torch.Tensor:
        """`times` x count ops issued by the host and run by the device, plus `device_seconds` of device work."""
        host = self.host.op_seconds * count.ops * times
        if self.device_is_host:
            return host + device_seconds
        return _maximum(host, self.profile.launch_overhead * count.kernels * times + device_seconds)

    def _roofline(self, nbytes: torch.Tensor, flops: torch.Tensor) -> torch.Tensor:
        return _maximum(nbytes / self.profile.memory_bandwidth, flops / self.profile.compute_flops)

    # ---- per pass ----------------------------------------------------------------------------------------
    def fixed_seconds_P(self, shapes: PassShapes) -> torch.Tensor:
        """Placement-independent seconds per pass: the host's step and per-sequence costs, and the pass's one
        non-expert forward (the weights read once; every sequence's K/V and its tokens' flops)."""
        mc = self.model
        tokens = shapes.row_tokens_S.double()
        context = shapes.row_context_S.double()
        per_pass = lambda values_S: torch.zeros(shapes.num_passes, dtype=torch.float64).index_add_(
            0, shapes.row_pass_S, values_S)
        kv_bytes = per_pass(context * mc.kv_bytes_per_token)
        flops = per_pass(mc.sequence_flops + tokens * mc.token_flops
                         + tokens * context * mc.attention_flops_per_context)
        device = self._roofline(mc.forward_bytes + kv_bytes, flops)
        seqs = shapes.seqs_P.double()
        host = self.host.step_seconds + self.host.sequence_seconds * seqs
        if self.device_is_host:
            forward = host + device
        else:
            forward = torch.maximum(host, self.profile.launch_overhead * mc.per_forward.kernels + device)
        layers = self._dispatch(mc.per_layer, torch.full_like(seqs, mc.num_moe_layers), torch.zeros_like(seqs))
        return forward + layers + self.forward_correction_seconds

    def moe_seconds_P(self, traffic: Traffic, tokens_P: torch.Tensor) -> torch.Tensor:
        """Placement-dependent seconds per pass: both tiers of every MoE layer, and blocking copies."""
        cpu, gpu, host_cpu_call = self._tiers_PM(traffic, tokens_P)
        both = ((traffic.cpu_distinct_PM > 0) & (traffic.gpu_distinct_PM > 0)).double() * self.both_tiers_seconds
        layers = (host_cpu_call + self.combine(cpu, gpu) + both).sum(-1)
        copies = traffic.swap_copies_P if self.device_is_host else traffic.streamed_P
        return layers + copies.double() * self.copy_seconds()

    def _tiers_PM(self, traffic: Traffic, tokens_P: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(CPU tier, GPU tier, host cost of calling the CPU tier) seconds per pass and MoE layer."""
        mc = self.model
        called = traffic.cpu_called_PM.double()
        cpu = self.cpu.seconds(traffic.cpu_distinct_PM.double(), traffic.cpu_pairs_PM.double(), called)
        if not self.device_is_host:  # the rows go to host memory and come back
            cpu = cpu + called * tokens_P.double()[:, None] * 2 * mc.hidden_bytes / self.profile.pcie_bandwidth
        gpu = self.gpu_tier_seconds(traffic.gpu_distinct_PM.double(), traffic.gpu_pairs_PM.double())
        return cpu, gpu, called * self.host.op_seconds * mc.per_cpu_call.ops

    def pass_seconds_P(self, shapes: PassShapes, traffic: Traffic) -> torch.Tensor:
        return self.fixed_seconds_P(shapes) + self.moe_seconds_P(traffic, shapes.tokens_P)

    def gpu_tier_seconds(self, distinct: torch.Tensor, pairs: torch.Tensor,
                         called: torch.Tensor | float | None = None) -> torch.Tensor:
        """The GPU tier's compute for `distinct` experts and `pairs` routed pairs, and its call where `called`
        (default: where it computes any expert; what one expert adds leaves it out). Timed like the CPU tier
        (this-cpu), else its ops dispatched by the host and its bytes and flops on the profile's roofline."""
        if called is None:
            called = (distinct > 0).double()
        if self.gpu_tier is not None:
            return self.gpu_tier.seconds(distinct, pairs, called)
        mc = self.model
        device = self._roofline(distinct * mc.bytes_per_expert, pairs * mc.flops_per_pair)
        ops = mc.gpu_call.scaled(called) + self._gpu_per_expert().scaled(distinct)  # per layer call (tensors)
        return self._dispatch(ops, 1.0, device)

    def _gpu_per_expert(self) -> OpCount:
        """What each distinct expert adds to the GPU tier's dispatch."""
        if not self.model.grouped_gemm:
            return self.model.per_expert  # the expert-by-expert loop
        return NO_OPS if self.profile.fused_grouped_gemm else GROUPED_GEMM_LOOP

    # ---- one expert, one copy: what the dynamic policies decide with -------------------------------------
    def expert_seconds(self, on_gpu: bool, touched: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
        """Seconds one expert costs a pass on a tier: `touched` is 1 when the pass routes to it (or the chance
        that it does), `pairs` its routed pairs. The CPU tier's a x touched + b x pairs; the GPU tier's own terms
        for one expert."""
        if on_gpu:
            return self.gpu_tier_seconds(touched, pairs, called=0.0)
        return self.cpu.per_expert * touched + self.cpu.per_pair * pairs

    def copy_seconds(self, experts: int = 1) -> float:
        """Moving `experts` experts between the tiers (one direction each)."""
        return experts * self.model.bytes_per_expert / self.profile.pcie_bandwidth


def expert_cost_model(bytes_per_expert: int, flops_per_pair: float, gpu: GPUProfile | None = None,
                      cpu: TierFit | None = None) -> PassCostModel:
    """The cost model with only what placement changes: the routed experts on each tier and copies between them.
    gpu: the GPU tier and copies (default: the rtx4090 preset); cpu: the CPU tier as measured (default:
    assumed_cpu_tier). No host or non-expert costs: they are the same for every placement. What the live adaptive
    policy decides with unless it is given a measured model, and what `tiermoe bench dynamic` replays with."""
    cpu = cpu or assumed_cpu_tier(bytes_per_expert, flops_per_pair)
    return PassCostModel(gpu or PRESETS[DEFAULT_GPU], ModelCosts.experts_only(bytes_per_expert, flops_per_pair), cpu,
                         HostCosts(0.0, 0.0, 0.0))
