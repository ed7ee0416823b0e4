"""Layerwise GPU prefill: a large prefill batch computes its CPU-tier experts on the GPU as well.

For a batch of at least `threshold` tokens the CPU would be the bottleneck by far, so the CPU-tier experts the
batch routes to are streamed to the GPU device in chunks through two reusable buffers: while chunk k computes,
chunk k + 1 is read from the CPU tier (dequantised on the host if it is stored quantised) and copied on a side
stream. The extra GPU memory is the two buffers, each `chunk` experts, within `buffer_bytes` and never more
experts than a layer has (--gpu-prefill-buffer-gb); the second is made only when a batch needs two chunks. The
math is the CPU tier's reference (`routed_experts_forward`'s order), so the output is exact. One streamer
serves all layers of a model (layers run one after another).

Ordering, by design (the buffers are shared by every layer and call, so the events that guard a buffer live
with it, not with one call):
- a buffer is overwritten only once the compute stream is done with the last launch that read it (`free`),
  whichever layer or call that was; a launch reads a buffer only once its copy landed (`ready`);
- chunk k's compute is launched before chunk k + 1 is staged, so the device computes while the host stages;
- the (token, expert) pairs are grouped by expert with one host read per layer (which experts, how many pairs):
  the launches themselves never wait for the device.
Streams and events come from `tiermoe.experts.stream_queues` (CUDA, or the host where everything is in order
already).
"""

from __future__ import annotations

import torch

from tiermoe.experts.ffn import expert_ffn
from tiermoe.experts.stream_queues import queues_for
from tiermoe.experts.weights import ExpertWeights


class StagingBuffer:
    """`chunk` experts' weights on the device, and the events that order its reuse."""

    def __init__(self, tensors: list[torch.Tensor | None], free):
        self.tensors = tensors  # gate_up [chunk, 2I, H], down [chunk, H, I], the biases [chunk, ...] or None
        self.free = free  # the compute stream is done with every read of this buffer issued so far
        self.ready = None  # the side stream finished writing what the buffer holds now

    def slot(self, i: int) -> ExpertWeights:
        return ExpertWeights(*(None if t is None else t[i] for t in self.tensors))


class ExpertPairs:
    """The (token, slot) pairs of ids_TK grouped by expert, with one host read: the experts hit (ascending) and
    each one's pairs as flat indices into [T * K], in token order (the order `routed_experts_forward` uses)."""

    def __init__(self, ids_TK: torch.Tensor, num_experts: int):
        flat = ids_TK.reshape(-1)
        self.top_k = ids_TK.shape[1]
        self.order = torch.argsort(flat, stable=True)  # the -1 pairs first, then expert 0's, 1's, ...
        counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
        counts = counts.index_add_(0, flat + 1, torch.ones_like(flat)).tolist()  # the one host read
        self.spans: dict[int, tuple[int, int]] = {}
        start = counts[0]
        for e, n in enumerate(counts[1:]):
            if n:
                self.spans[e] = (start, start + n)
            start += n
        self.experts = list(self.spans)

    def of(self, expert: int) -> torch.Tensor:
        start, end = self.spans[expert]
        return self.order[start:end]


class PrefillStreamer:
    def __init__(self, device: torch.device | str, threshold: int, buffer_bytes: int, bytes_per_expert: int,
                 num_experts: int, queues=None):
        self.device = torch.device(device)
        self.threshold = threshold
        self.num_experts = num_experts
        # experts per buffer: two buffers within buffer_bytes, and no more slots than a layer has experts
        self.chunk = max(1, min(num_experts, buffer_bytes // (2 * max(1, bytes_per_expert))))
        self.batches = 0  # prefill batches that took this path
        self.queues = queues if queues is not None else queues_for(self.device)
        self._buffers: list[StagingBuffer | None] = [None, None]

    def applies(self, num_tokens: int) -> bool:
        return num_tokens >= self.threshold

    def forward(self, cpu_tier, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, act) -> torch.Tensor:
        """Sum over each token's CPU-tier experts (ids >= 0), computed on this device: [T, D]."""
        self.batches += 1
        pairs = ExpertPairs(ids_TK, self.num_experts)
        chunks = [pairs.experts[i:i + self.chunk] for i in range(0, len(pairs.experts), self.chunk)]
        out_TD = torch.zeros_like(x_TD)
        if not chunks:
            return out_TD
        queues = self.queues
        compute = queues.compute()
        weights_P = weights_TK.reshape(-1)
        staged = self._stage(cpu_tier, chunks[0], 0, compute)
        for k, experts in enumerate(chunks):
            buf = self._buffers[k % 2]
            queues.wait(compute, buf.ready)
            for e in experts:
                pair_N = pairs.of(e)
                tok_N = pair_N // pairs.top_k
                y_ND = expert_ffn(staged[e], x_TD[tok_N], act) * weights_P[pair_N, None]
                out_TD.index_add_(0, tok_N, y_ND.to(out_TD.dtype))
            buf.free = queues.record(compute)
            if k + 1 < len(chunks):  # issued after chunk k's compute: the host stages while the device computes
                staged = self._stage(cpu_tier, chunks[k + 1], (k + 1) % 2, compute)
        return out_TD

    def _stage(self, cpu_tier, experts: list[int], b: int, compute) -> dict[int, ExpertWeights]:
        """Copy `experts` into buffer `b` on the side stream once it is free; its `ready` marks the copies."""
        first = cpu_tier.get(experts[0])
        buf = self._buffer(b, first, compute)  # outside the side stream: allocated on the compute stream's pool
        side = self.queues.side()
        with self.queues.on(side):
            self.queues.wait(side, buf.free)
            # one expert at a time: a dequantised host copy lives only until its copy is issued
            staged = {experts[0]: _copy_into(buf.slot(0), first)}
            del first
            for i, e in enumerate(experts[1:], start=1):
                staged[e] = _copy_into(buf.slot(i), cpu_tier.get(e))
            buf.ready = self.queues.record(side)
        return staged

    def _buffer(self, b: int, like: ExpertWeights, compute) -> StagingBuffer:
        if self._buffers[b] is None:
            def alloc(t):
                return None if t is None else torch.empty((self.chunk, *t.shape), dtype=t.dtype, device=self.device)
            tensors = [alloc(t) for t in (like.gate_up, like.down, like.gate_up_bias, like.down_bias)]
            # Made on the compute stream's pool: the side stream may write it only after the compute stream got
            # here (the memory may have been another tensor's that pending compute work still reads).
            self._buffers[b] = StagingBuffer(tensors, free=self.queues.record(compute))
        return self._buffers[b]


def _copy_into(dst: ExpertWeights, src: ExpertWeights) -> ExpertWeights:
    for d, s in zip(dst.tensors(), src.tensors()):
        d.copy_(s, non_blocking=True)
    return dst
