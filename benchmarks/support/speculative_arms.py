"""Shared by the speculative-decoding benchmarks: one arm's decode of a set of prompts, timed after the prefill,
and routing replayed from a decode trace for the sequences a run adds."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from tiermoe.analysis.trace_workload import spread_layers
from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import SamplingParams
from tiermoe.layers.trace_routing import TraceRouting, install_trace_routing
from tiermoe.routing.trace_convert import detect_layout, read_routing


def decode(llm: LLM, prompts: list[list[int]], tokens: int, batch: int,
           on_add: Callable[[list], None] | None = None) -> tuple[float, int, list[list[int]]]:
    """(decode seconds, decode tokens, every prompt's tokens): groups of `batch` prompts run together; each
    group's first step (its prefill) is left out of the timing. `on_add(seqs)`: told each group's sequences."""
    engine, params = llm.engine, SamplingParams(max_tokens=tokens, ignore_eos=True)
    seconds, counted, out = 0.0, 0, []
    for start in range(0, len(prompts), batch):
        seqs = [engine.add(p, params) for p in prompts[start:start + batch]]
        if on_add is not None:
            on_add(seqs)
        while not all(s.output_ids or s.finished for s in seqs):  # the prefill, to the first token of each
            engine.step()
        first = [len(s.output_ids) for s in seqs]
        t0 = time.perf_counter()
        while engine.has_work():
            engine.step()
        seconds += time.perf_counter() - t0
        counted += sum(len(s.output_ids) - f for s, f in zip(seqs, first, strict=True))
        assert all(s.finish_reason == "length" for s in seqs), [s.error for s in seqs]
        out += [s.output_ids for s in seqs]
    return seconds, counted, out


class ReplayedTrace:
    """A decode trace's routing installed in `llm`'s MoE layers (the trace's layers spread over the model's): every
    sequence `assign`ed replays the trace's first request at its positions; `prompt_length`: that request's
    prefill tokens."""

    def __init__(self, llm: LLM, path: str):
        trace = read_routing(Path(path), detect_layout(Path(path)))
        spec = llm.hybrid.spec
        layers = spread_layers([int(x) for x in range(int(trace["num_layers"]))], len(spec.moe_layers))
        self.ids_NMK = trace["topk_ids"][:, list(layers)].long()
        self.requests_N, self.positions_N = trace["token_request"].long(), trace["token_position"].long()
        self.request = int(self.requests_N[0])
        mine = self.requests_N == self.request
        self.prompt_length = max(1, int(trace["token_is_prefill"][mine].sum()))
        self.length = int(self.positions_N[mine].max()) + 1
        self.routing = TraceRouting(self.ids_NMK, self.requests_N, self.positions_N, list(spec.moe_layers),
                                    llm.hybrid.gpu_device, layers)
        install_trace_routing(llm.hybrid, self.routing)
        self.engine = llm.engine

    def assign(self, seqs: list) -> None:
        self.routing.assign(self.engine, {s.seq_id: self.request for s in seqs})

    def union_ratio(self, start: int, tokens: int) -> float | None:
        """The routed experts `tokens` consecutive positions from `start` read together, per layer, over one
        token's (mean over the model's MoE layers); None where the trace lacks a row."""
        rows = [((self.requests_N == self.request) & (self.positions_N == p)).nonzero() for p in
                range(start, start + tokens)]
        if any(len(r) != 1 for r in rows):
            return None
        ids_TMK = self.ids_NMK[[int(r[0, 0]) for r in rows]]
        if (ids_TMK < 0).any():
            return None
        k = ids_TMK.shape[-1]
        return sum(len(set(ids_TMK[:, m].flatten().tolist())) / k for m in range(ids_TMK.shape[1])) / ids_TMK.shape[1]


def check_against_plain(name: str, out: list[list[int]], reference: list[list[int]], dtype) -> None:
    """An arm's replies against plain decode's: SystemExit when they differ in fp32 (speculation must be exact
    there); in bf16 a verify segment can resolve an exact logit tie the other way, which is said, not fatal."""
    differ = sum(a != b for a, b in zip(out, reference, strict=True))
    if differ and dtype == torch.float32:
        raise SystemExit(f"{name} gave other tokens than plain decode: speculation is not exact")
    if differ:
        print(f"{name}: {differ} of {len(out)} replies differ from plain decode from a {dtype} tie on", flush=True)
