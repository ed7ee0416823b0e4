"""Layerwise GPU prefill: a large prefill batch computes its CPU-tier experts on the GPU as well.

For a batch of at least `threshold` tokens the CPU would be the bottleneck by far, so the CPU-tier experts the
batch routes to are streamed to the GPU device in chunks through two reusable buffers: while chunk k computes,
chunk k + 1 is copied on a side stream. The extra GPU memory is the two buffers, sized within `buffer_bytes`
whatever the model (--gpu-prefill-buffer-gb). The math is the GPU tier's, so the output stays exact. One
streamer serves all layers of a model (layers run one after another).
"""

from __future__ import annotations

import torch

from tiermoe.experts.ffn import routed_experts_forward
from tiermoe.experts.weights import ExpertWeights


class PrefillStreamer:
    def __init__(self, device: torch.device | str, threshold: int, buffer_bytes: int, bytes_per_expert: int):
        self.device = torch.device(device)
        self.threshold = threshold
        self.chunk = max(1, buffer_bytes // (2 * max(1, bytes_per_expert)))  # experts per buffer
        self.batches = 0  # prefill batches that took this path
        self._buffers: list[list[ExpertWeights]] | None = None
        self._side = None

    def applies(self, num_tokens: int) -> bool:
        return num_tokens >= self.threshold

    def forward(self, cpu_tier, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, act) -> torch.Tensor:
        """Sum over each token's CPU-tier experts (ids >= 0), computed on this device: [T, D]."""
        self.batches += 1
        hit = torch.unique(ids_TK[ids_TK >= 0]).tolist()
        chunks = [hit[i:i + self.chunk] for i in range(0, len(hit), self.chunk)]
        out_TD = torch.zeros_like(x_TD)
        if self.device.type != "cuda":
            # The "GPU" is the host: the CPU-tier weights are already where the math runs.
            for experts in chunks:
                out_TD += routed_experts_forward({e: cpu_tier.get(e) for e in experts}, x_TD,
                                                 _only(ids_TK, experts), weights_TK, act)
            return out_TD
        return self._stream(cpu_tier, chunks, x_TD, ids_TK, weights_TK, act, out_TD)

    def _stream(self, cpu_tier, chunks, x_TD, ids_TK, weights_TK, act, out_TD):
        compute = torch.cuda.current_stream(self.device)
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        done = [None, None]  # event: compute finished reading buffer b

        def stage(k: int):
            b = k % 2
            with torch.cuda.stream(self._side):
                if done[b] is not None:
                    self._side.wait_event(done[b])  # do not overwrite a buffer still being read
                staged = {}
                for slot, e in enumerate(chunks[k]):
                    staged[e] = _copy_into(self._buffer(cpu_tier.get(e), b, slot), cpu_tier.get(e))
                ready = torch.cuda.Event()
                ready.record(self._side)
            return staged, ready

        pending = stage(0) if chunks else None
        for k, experts in enumerate(chunks):
            staged, ready = pending
            if k + 1 < len(chunks):
                pending = stage(k + 1)
            compute.wait_event(ready)
            out_TD += routed_experts_forward(staged, x_TD, _only(ids_TK, experts), weights_TK, act)
            done[k % 2] = torch.cuda.Event()
            done[k % 2].record(compute)
        return out_TD

    def _buffer(self, like: ExpertWeights, b: int, slot: int) -> ExpertWeights:
        if self._buffers is None:
            def alloc(t):
                return None if t is None else torch.empty((self.chunk, *t.shape), dtype=t.dtype, device=self.device)
            self._buffers = [[alloc(t) for t in (like.gate_up, like.down, like.gate_up_bias, like.down_bias)]
                             for _ in range(2)]
        return ExpertWeights(*(None if t is None else t[slot] for t in self._buffers[b]))


def _copy_into(dst: ExpertWeights, src: ExpertWeights) -> ExpertWeights:
    for d, s in zip(dst.tensors(), src.tensors()):
        d.copy_(s, non_blocking=True)
    return dst


def _only(ids_TK: torch.Tensor, experts: list[int]) -> torch.Tensor:
    """ids_TK with every expert not in `experts` set to -1."""
    keep = torch.isin(ids_TK, torch.tensor(experts, device=ids_TK.device))
    return torch.where(keep, ids_TK, torch.full_like(ids_TK, -1))
