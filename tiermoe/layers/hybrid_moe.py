"""HybridMoE: a transformers MoE block whose routed experts live on two tiers.

route -> split (token, expert) pairs by the GPU mask -> submit the CPU part -> GPU part and shared experts
meanwhile -> sync -> combine. The model's own router and shared-expert modules are kept under their original
attribute names (so checkpoint names and routing stay exactly transformers'); only the fused experts module is
dropped. Legend: T tokens, D hidden, K top-k, E experts.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tiermoe.arch.spec import ArchSpec
from tiermoe.experts.tiers import CPUExpertBackend, ExpertSet
from tiermoe.stats.recording import NO_RECORDER


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
        # The mask lives where each side needs it: on the GPU device to split ids without a host round trip,
        # and on the host for bookkeeping. Both flip together in set_on_gpu.
        self.gpu_mask_E = torch.zeros(spec.num_experts, dtype=torch.bool, device=gpu_tier.device)
        self.host_mask_E = torch.zeros(spec.num_experts, dtype=torch.bool)
        # Set by the engine: joins the per-sequence forwards of one step so experts run once for all tokens.
        self.batcher = None
        # Set by the engine: sees the routed ids of every pass (a no-op unless recording).
        self.recorder = NO_RECORDER

    def _router(self) -> nn.Module:
        return self._modules[self.spec.router_attr]

    def set_on_gpu(self, expert: int, on_gpu: bool) -> None:
        self.gpu_mask_E[expert] = on_gpu
        self.host_mask_E[expert] = on_gpu

    def forward(self, hidden: torch.Tensor):
        if self.batcher is not None and self.batcher.participating():
            return self.batcher.exchange(self.forward_tokens, hidden)
        return self.forward_tokens(hidden)

    def forward_tokens(self, hidden: torch.Tensor):
        """The block on all tokens of `hidden` [..., D]."""
        shape = hidden.shape
        x_TD = hidden.reshape(-1, shape[-1])
        _, weights_TK, ids_TK = self._router()(x_TD)
        if self.recorder.enabled:
            self.recorder.record(self.layer, ids_TK, self.gpu_mask_E)
        on_gpu_TK = self.gpu_mask_E[ids_TK]

        use_cpu = len(self.cpu_tier) > 0
        if use_cpu:
            cpu_ids_TK = ids_TK.masked_fill(on_gpu_TK, -1)
            self.cpu_tier.submit(x_TD.to("cpu"), cpu_ids_TK.to("cpu"), weights_TK.to("cpu"))

        y_TD = self.gpu_tier.forward(x_TD, ids_TK.masked_fill(~on_gpu_TK, -1), weights_TK)
        shared_TD = self._shared(x_TD)

        if use_cpu:
            y_TD = y_TD + self.cpu_tier.sync().to(y_TD.device)
        if shared_TD is not None:
            y_TD = y_TD + shared_TD
        y = y_TD.reshape(shape)
        return (y, weights_TK) if self.spec.returns_router_scores else y

    def _shared(self, x_TD: torch.Tensor) -> torch.Tensor | None:
        kind = self.spec.shared_kind
        if kind == "plain":
            return self.shared_experts(x_TD)
        if kind == "gated":
            return F.sigmoid(self.shared_expert_gate(x_TD)) * self.shared_expert(x_TD)
        return None

    def move_experts(self, experts: Iterable[int], to_gpu: bool) -> int:
        """Move experts between tiers; returns the bytes moved.

        Per expert: copy into the destination tier, flip the mask once the copy has landed, then release the
        source copy, so at every moment the mask names a tier that holds the weights.
        """
        src, dst = (self.cpu_tier, self.gpu_tier) if to_gpu else (self.gpu_tier, self.cpu_tier)
        moved = 0
        for e in experts:
            if e not in src:
                source = "CPU" if to_gpu else "GPU"
                raise ValueError(f"layer {self.layer} expert {e} is not on the {source} tier, so it cannot leave it")
            landed = src.get(e).to(dst.device, pin=dst.pin)
            dst.add(e, landed)
            self.set_on_gpu(e, to_gpu)
            moved += src.pop(e).nbytes
        return moved
