"""HybridMoE: a transformers MoE block whose routed experts live on two tiers.

route -> split (token, expert) pairs by the GPU mask -> submit the CPU part -> GPU part and shared experts
meanwhile -> sync -> combine. The model's own router and shared-expert modules are kept under their original
attribute names (so checkpoint names and routing stay exactly transformers'); only the fused experts module is
dropped. Legend: T tokens, D hidden, K top-k, E experts.

On a GPU the host waits once per layer: the CPU part's inputs go to the host in one copy and its result comes back
without a wait, both through the layer's page-locked ring, allocated once (tiermoe.layers.host_ring); the GPU tier
computes without one (tiermoe.experts.slotted_tier).
With deferred experts (tiermoe.layers.deferred_experts) part of the CPU part is added by the next MoE layer.

With several ranks (tiermoe.distributed) every rank runs the block on the same tokens: its GPU tier computes
only its own experts (`assignment_E == rank`), the CPU tier exists on one rank only, and `reduce` sums the
partial routed outputs of all ranks before the (replicated) shared experts are added, so they are counted once.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import wait

import torch
import torch.nn.functional as F
from torch import nn

from tiermoe.arch.spec import ArchSpec
from tiermoe.experts.copier import CopyTicket
from tiermoe.experts.host_slab import copy_to_tier, slab_destination
from tiermoe.experts.tiers import CPUExpertBackend, ExpertSet
from tiermoe.layers.deferred_experts import DeferredExperts, split_deferred
from tiermoe.layers.expert_lora import ExpertLoRA
from tiermoe.layers.host_copies import to_device_async
from tiermoe.layers.host_ring import HostRing
from tiermoe.layers.routed_autograd import DEFAULT_CHUNK, RoutedExperts
from tiermoe.layers.row_expert_lora import RowExpertLoRA
from tiermoe.stats.recording import NO_RECORDER

# Rows of a CPU-only step whose shared experts and CPU tier both compute on this thread (`shared_on_team`): one
# sequence's decode step, where it was measured to pay (BENCHMARKS.md, "Fused paths keyed on code": 1.6x the decode
# of 24 thin Dots1 layers, DeepSeek-V2-Lite's shapes unchanged). Steps of more rows keep the hand-off: a 16-token
# first token read 7-10% slower with them here, within the spread of the rounds, not shown either way.
SHARED_HERE_MAX_ROWS = 1


class HybridMoE(nn.Module):
    def __init__(self, block: nn.Module, spec: ArchSpec, layer: int, gpu_tier: ExpertSet, cpu_tier: CPUExpertBackend):
        super().__init__()
        for name, child in block.named_children():
            if name != "experts":
                self.add_module(name, child)
        self.spec = spec
        self.layer = layer
        self.gpu_tier = gpu_tier
        self.cpu_tier = cpu_tier
        # Where each expert is computed: -1 the CPU tier, r >= 0 GPU rank r's tier. The one record of ownership,
        # kept on the GPU device so a forward splits ids without a host round trip; masks derive from it.
        self.assignment_E = torch.full((spec.num_experts,), -1, dtype=torch.int64, device=gpu_tier.device)
        self.rank = 0  # this process's GPU rank (join_ranks sets it)
        # Several ranks: sums the partial routed outputs [T, D] of all ranks (set by join_ranks).
        self.reduce = None
        # Set by the engine: sees the routed ids of every pass (a no-op unless recording).
        self.recorder = NO_RECORDER
        # Set when --kt-gpu-prefill-token-threshold is given: large prefill batches run CPU-tier experts on the GPU.
        self.prefill_streamer = None
        # Training (tiermoe.model.loader, trainable=True): with grad enabled the routed experts compute through
        # RoutedExperts, so gradients reach the input, the routing weights and any expert LoRA.
        self.trainable = False
        # Tokens the CPU tier's part computes at a time in training, forward and backward (0: all): what it holds
        # for a pass is proportional to this, not to the context (tiermoe.layers.routed_autograd).
        self.expert_chunk = DEFAULT_CHUNK
        self.lora_experts: ExpertLoRA | None = None
        # Adapters served per request with LoRA on this layer's experts (tiermoe.model.served_adapters); None: none.
        self.row_lora: RowExpertLoRA | None = None
        # Set by the loader with --kt-max-deferred-experts-per-token > 0: the model's hand-over of deferred experts
        # between consecutive MoE layers (tiermoe.layers.deferred_experts); None computes every expert in its layer.
        self.deferred: DeferredExperts | None = None
        # Whether the CPU tier's inputs and result cross between host and device. With the main device on the CPU
        # they are host memory already: no packing, no copies (about 20 ops per layer of a decode step). The
        # host-sync counter (tiermoe.testing.host_syncs) sets it to see the copies a GPU would make.
        self.crosses_to_host = gpu_tier.device.type != "cpu"
        self._host_ring: HostRing | None = None  # made on the first crossing (host_ring)
        # A layer with no GPU-tier expert skips the ownership lookup and the GPU tier (`_cpu_only`). The cost
        # model's op count (tiermoe.analysis.model_op_count) turns it off to count what a mixed layer dispatches.
        self.cpu_only_shortcut = True
        # Set by the loader where the non-expert linears are packed onto the kernel team (CPU-only runs): the
        # shared experts' products then wait for the CPU tier's job on that team, so `_cpu_only` computes both on
        # this thread, one after the other, without the hand-off to the worker and back (two thread wake-ups), in
        # steps of SHARED_HERE_MAX_ROWS rows; longer ones keep the hand-off.
        self.shared_on_team = False

    def _router(self) -> nn.Module:
        return self._modules[self.spec.router_attr]

    @property
    def host_ring(self) -> HostRing:
        """The CPU part's page-locked staging (in and out), made when the layer first crosses to the host."""
        if self._host_ring is None:
            self._host_ring = HostRing(self.gpu_tier.device)
        return self._host_ring

    def _cpu_result(self, device: torch.device) -> torch.Tensor:
        """The submitted CPU part's result on `device`, the host not waiting for the copy."""
        y_TD = self.cpu_tier.sync()
        return self.host_ring.to_device(y_TD) if self.crosses_to_host else to_device_async(y_TD, device)

    def join_ranks(self, rank: int, reduce) -> None:
        """Make this block one rank's part of a multi-rank layer (call before any expert is placed).

        `reduce(y_TD) -> y_TD` sums a partial output over all ranks; every rank calls it once per forward.
        """
        self.rank = rank
        self.reduce = reduce

    def assign(self, expert: int, rank: int) -> None:
        """Where `expert` is computed from now on: -1 = the CPU tier, r >= 0 = GPU rank r's tier."""
        self.assignment_E[expert] = rank

    def forward(self, hidden: torch.Tensor):
        return self.forward_tokens(hidden)

    def forward_tokens(self, hidden: torch.Tensor):
        """The block on all tokens of `hidden` [..., D]."""
        shape = hidden.shape
        x_TD = hidden.reshape(-1, shape[-1])
        _, weights_TK, ids_TK = self._router()(x_TD)
        if self.recorder.enabled:
            self.recorder.record(self.layer, ids_TK, self.assignment_E >= 0)
        y_TD, shared_TD = self._routed_with_adapters(x_TD, ids_TK, weights_TK)
        if self.reduce is not None:
            # every rank calls this, also with no expert of its own in this layer, so the collectives line up
            y_TD = self.reduce(y_TD)
        if shared_TD is not None:
            y_TD = y_TD + shared_TD
        y = y_TD.reshape(shape)
        return (y, weights_TK) if self.spec.returns_router_scores else y

    def _routed_with_adapters(self, x_TD, ids_TK, weights_TK):
        """(routed output [T, D], shared experts' output or None). Pairs of rows whose adapter (served per
        request) has LoRA on this layer's experts are computed by `row_lora`, the others by the usual path."""
        lora = self.row_lora
        plain_TK, adapted_TK = (ids_TK, None) if lora is None else lora.split(ids_TK)
        if plain_TK is not None:
            y_TD, shared_TD = self._routed(x_TD, plain_TK, weights_TK)
        else:
            y_TD, shared_TD = torch.zeros_like(x_TD), self._shared(x_TD)
        if adapted_TK is not None:
            y_TD = y_TD + self._routed_per_row(x_TD, adapted_TK, weights_TK)
        return y_TD, shared_TD

    def _routed(self, x_TD, ids_TK, weights_TK):
        """(routed output [T, D], shared experts' output or None) of the pairs of ids_TK (ids -1: none)."""
        if self.cpu_only_shortcut and len(self.gpu_tier) == 0 and self.reduce is None and self._plain_inference():
            return self._cpu_only(x_TD, ids_TK, weights_TK)
        rank_TK = self.assignment_E[ids_TK]
        on_gpu_TK = rank_TK >= 0  # on any GPU rank: not the CPU tier's
        mine_TK = on_gpu_TK if self.reduce is None else rank_TK == self.rank
        if self.lora_experts is not None or (self.trainable and torch.is_grad_enabled()):
            return self._routed_differentiable(x_TD, ids_TK, weights_TK, on_gpu_TK, mine_TK), self._shared(x_TD)
        return self._routed_overlapped(x_TD, ids_TK, weights_TK, on_gpu_TK, mine_TK)

    def _routed_per_row(self, x_TD, ids_TK, weights_TK) -> torch.Tensor:
        """The pairs of ids_TK with each row's expert LoRA (tiermoe.layers.row_expert_lora), on their tiers."""
        act = self.gpu_tier.act
        if len(self.gpu_tier) == 0:
            return self.row_lora.routed(x_TD, ids_TK, weights_TK, self.cpu_tier, act)
        on_gpu_TK = self.assignment_E[ids_TK] >= 0  # ids -1 index the last expert: they stay -1 either way
        y_TD = self.row_lora.routed(x_TD, ids_TK.masked_fill(~on_gpu_TK, -1), weights_TK, self.gpu_tier, act)
        if len(self.cpu_tier) > 0:
            y_TD = y_TD + self.row_lora.routed(x_TD, ids_TK.masked_fill(on_gpu_TK, -1), weights_TK, self.cpu_tier,
                                               act)
        return y_TD

    def _plain_inference(self) -> bool:
        """No adapter, no gradients, no layerwise prefill and no deferral: the block is its two tiers' sum."""
        return (self.lora_experts is None and not (self.trainable and torch.is_grad_enabled())
                and self.prefill_streamer is None and self.deferred is None)

    def _cpu_only(self, x_TD, ids_TK, weights_TK):
        """A layer whose routed experts are all on the CPU tier: every routed id goes to it as it is (no
        ownership lookup, no masks, no GPU-tier call); the shared experts run while it computes. With nothing to
        run meanwhile (no shared experts, or shared experts on the kernel team it computes on: `shared_on_team`)
        and the tokens already on the host, it computes on this thread."""
        shared_here = self.shared_on_team and x_TD.shape[0] <= SHARED_HERE_MAX_ROWS
        if len(self.cpu_tier) > 0 and not self.crosses_to_host and (self.spec.shared_kind == "none" or shared_here):
            return self.cpu_tier.compute_here(x_TD, ids_TK, weights_TK), self._shared(x_TD)
        if len(self.cpu_tier) > 0:
            self._submit_cpu(x_TD, ids_TK, weights_TK)
        try:
            shared_TD = self._shared(x_TD)
        except BaseException:
            if len(self.cpu_tier) > 0:
                self.cpu_tier.drain()
            raise
        y_TD = self._cpu_result(x_TD.device) if len(self.cpu_tier) > 0 else torch.zeros_like(x_TD)
        return y_TD, shared_TD

    def _routed_overlapped(self, x_TD, ids_TK, weights_TK, on_gpu_TK, mine_TK):
        """Inference: the CPU part computes on its worker while the GPU part and the shared experts run here."""
        streamer = self.prefill_streamer
        layerwise = streamer is not None and streamer.applies(x_TD.shape[0])
        use_cpu = len(self.cpu_tier) > 0 and not layerwise
        carried = self.deferred.take(self.layer) if self.deferred is not None else None
        if use_cpu:
            self._submit_cpu(x_TD, ids_TK.masked_fill(on_gpu_TK, -1), weights_TK)
        try:
            y_TD = self.gpu_tier.forward(x_TD, ids_TK.masked_fill(~mine_TK, -1), weights_TK)
            if layerwise and len(self.cpu_tier) > 0:
                y_TD = y_TD + streamer.forward(self.cpu_tier, x_TD, ids_TK.masked_fill(on_gpu_TK, -1), weights_TK,
                                               self.gpu_tier.act)
            shared_TD = self._shared(x_TD)
        except BaseException:
            # A CUDA OOM or device error in the GPU part: without this the CPU job stays pending, and every later
            # forward of this layer fails with "submit called twice" instead of running (and hides this error).
            if use_cpu:
                self.cpu_tier.drain()
            if self.deferred is not None:
                self.deferred.drain()
            if carried is not None:
                wait([carried])
            raise
        if use_cpu:
            y_TD = y_TD + self._cpu_result(y_TD.device)
        if carried is not None:  # what the MoE layer before this one deferred (its job ran before this one's)
            y_TD = y_TD + to_device_async(carried.result(), y_TD.device)
        return y_TD, shared_TD

    def _submit_cpu(self, x_TD, cpu_ids_TK, weights_TK) -> None:
        """Start the CPU tier's part: all of it, or (deferred experts) the slots kept now, then the deferred ones
        as a second job for the next MoE layer to add."""
        out_TD = None
        if self.crosses_to_host:
            x_TD, cpu_ids_TK, weights_TK = self.host_ring.to_host(x_TD, cpu_ids_TK, weights_TK)  # the one wait
            out_TD = self.host_ring.result(x_TD)
        if self.deferred is None or not self.deferred.defers(self.layer):
            self.cpu_tier.submit(x_TD, cpu_ids_TK, weights_TK, out=out_TD)
            return
        now_TK, later_TK = split_deferred(cpu_ids_TK, weights_TK, self.deferred.per_token)
        self.cpu_tier.submit(x_TD, now_TK, weights_TK, out=out_TD)
        job = self.cpu_tier.start(x_TD, later_TK, weights_TK) if bool((later_TK >= 0).any()) else None
        self.deferred.put(self.layer, job)

    def _routed_differentiable(self, x_TD, ids_TK, weights_TK, on_gpu_TK, mine_TK) -> torch.Tensor:
        """Training: each tier through RoutedExperts, one after the other (the CPU part is the backward's
        bottleneck either way), with the layer's expert LoRA when it has one. The CPU tier computes in spans of
        `expert_chunk` tokens (host memory bounds a context); the GPU tier's part is one span."""
        lora = self.lora_experts
        factors, scalings = (lora.factors(), lora.scalings) if lora is not None else ((), (1.0, 1.0))
        act = self.gpu_tier.act
        y_TD = RoutedExperts.apply(x_TD, weights_TK, ids_TK.masked_fill(~mine_TK, -1), self.gpu_tier, act, scalings,
                                   0, *factors)
        if len(self.cpu_tier) > 0:
            y_TD = y_TD + RoutedExperts.apply(x_TD, weights_TK, ids_TK.masked_fill(on_gpu_TK, -1), self.cpu_tier,
                                              act, scalings, self.expert_chunk, *factors)
        return y_TD

    def _shared(self, x_TD: torch.Tensor) -> torch.Tensor | None:
        kind = self.spec.shared_kind
        if kind == "plain":
            return self.shared_experts(x_TD)
        if kind == "gated":
            return F.sigmoid(self.shared_expert_gate(x_TD)) * self.shared_expert(x_TD)
        return None

    def _tiers(self, to_gpu: bool):
        return (self.cpu_tier, self.gpu_tier) if to_gpu else (self.gpu_tier, self.cpu_tier)

    def check_movable(self, expert: int, to_gpu: bool) -> None:
        if expert not in self._tiers(to_gpu)[0]:
            source = "CPU" if to_gpu else "GPU"
            raise ValueError(f"layer {self.layer} expert {expert} is not on the {source} tier, so it cannot leave it")

    def start_move(self, expert: int, to_gpu: bool, copier):
        """Begin copying `expert` to the other tier (asynchronously); its assignment does not change yet. A
        demotion the CPU tier kept the stored form for copies nothing: its ticket has landed already."""
        self.check_movable(expert, to_gpu)
        src, dst = self._tiers(to_gpu)
        if not to_gpu and self.cpu_tier.parked(expert):
            return CopyTicket()
        return copier.start(src.get(expert), dst.device, pin=dst.pin, out=slab_destination(dst, expert))

    def finish_move(self, expert: int, to_gpu: bool, landed) -> int:
        """The copy has landed (None: a demotion the CPU tier kept the stored form for): the destination takes
        it, the assignment changes, the source releases its copy. Returns the bytes copied."""
        src, dst = self._tiers(to_gpu)
        if self.deferred is not None:
            self.deferred.drain()  # a stopped forward's deferred job may still read the expert about to be released
        if landed is None:
            self.cpu_tier.restore(expert)
        else:
            dst.add(expert, landed)
        self.assign(expert, self.rank if to_gpu else -1)
        src.pop(expert)
        return 0 if landed is None else landed.nbytes

    def move_experts(self, experts: Iterable[int], to_gpu: bool) -> int:
        """Move experts between tiers now; returns the bytes copied.

        Per expert: copy into the destination tier, reassign once the copy has landed, then release the
        source copy, so at every moment the assignment names a tier that holds the weights.
        """
        experts = list(experts)
        if to_gpu:
            self.gpu_tier.make_room(len(experts))
        moved = 0
        for e in experts:
            self.check_movable(e, to_gpu)
            src, dst = self._tiers(to_gpu)
            kept = not to_gpu and self.cpu_tier.parked(e)
            moved += self.finish_move(e, to_gpu, None if kept else copy_to_tier(src.get(e), dst, e))
        return moved
