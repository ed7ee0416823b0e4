"""Routing taken from a trace: a real-shaped model (random weights) routes every token to the experts a real model
chose for it, so placement is measured with real expert sizes AND real routing (`tiermoe bench placement
--routing-trace`).

Each MoE block's router is wrapped by a TraceRouter. The engine announces every forward pass before it runs
(`begin_pass` with the pass's rows: request, position); TraceRouting looks each row up in the trace by (trace
request, position) and the routers return the trace's ids for their layer, in the trace's order, with equal
weights (placement does not depend on the weights). A row the trace does not hold (a warm-up request, a position
past the request's end, a layer the trace did not log) keeps the model's own routing. The model's router still
runs, so a timed pass does the router's work as the real model would. Legend: T rows, M mapped MoE layers, K top-k.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from tiermoe.errors import TiermoeError
from tiermoe.stats.recording import PassInfo


class TraceRouting:
    """The trace's routing per (request, position), for the model's MoE layers.

    ids_NMK: the trace's ids [N tokens, M, K] with column m for the model's MoE layer `layers[m]` (-1 where the
    trace did not log it); requests_N, positions_N: each token's request and position."""

    def __init__(self, ids_NMK: torch.Tensor, requests_N: torch.Tensor, positions_N: torch.Tensor,
                 layers: list[int], device: torch.device | str = "cpu", trace_layers: tuple[int, ...] = ()):
        self.ids_NMK = ids_NMK.to(torch.int64)
        self.trace_layers = trace_layers  # which of the trace's layers the columns are (for reports)
        self.column = {layer: m for m, layer in enumerate(layers)}
        self._row = {(int(r), int(p)): n for n, (r, p) in enumerate(zip(requests_N.tolist(), positions_N.tolist()))}
        if len(self._row) != len(requests_N):
            raise TiermoeError("the routing trace holds a (request, position) twice; expected one row per token")
        self.device = torch.device(device)
        # per engine (several run in lockstep; each counts sequence ids from 0): sequence id -> trace request
        self._requests: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._pass: tuple[int, torch.Tensor, torch.Tensor] | None = None  # (rows, ids [T, M, K], known [T, M])
        self.rows_routed = 0  # rows the trace routed (every mapped layer), for the caller's report
        self.rows_own = 0  # rows the model's own router routed

    def assign(self, engine, sequences: dict[int, int]) -> None:
        """Which trace request each of `engine`'s sequence ids serves; an engine never assigned keeps the model's
        own routing."""
        self._requests[engine] = dict(sequences)

    def begin_pass(self, info: PassInfo, engine=None) -> None:
        requests = self._requests.get(engine, {}) if engine is not None else {}
        rows = []
        for rid, n, start in zip(info.request_ids, info.num_tokens, info.start_positions):
            request = requests.get(rid)
            rows += [self._row.get((request, p), -1) for p in range(start, start + n)] if request is not None \
                else [-1] * n
        index_T = torch.tensor(rows, dtype=torch.int64)
        ids_TMK = self.ids_NMK[index_T.clamp(min=0)]
        known_TM = (index_T >= 0)[:, None] & (ids_TMK >= 0).all(-1)
        routed = int(known_TM.all(-1).sum())
        self.rows_routed += routed
        self.rows_own += len(rows) - routed
        self._pass = (len(rows), ids_TMK.to(self.device), known_TM.to(self.device))  # one copy per pass

    def end_pass(self) -> None:
        self._pass = None

    def current(self, layer: int, rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(ids [T, K], known [T]) of `layer` in the announced pass; None outside a pass (or another one)."""
        if self._pass is None or self._pass[0] != rows or layer not in self.column:
            return None
        m = self.column[layer]
        return self._pass[1][:, m], self._pass[2][:, m]


def traced(picked: tuple[torch.Tensor, torch.Tensor], weights_TK: torch.Tensor, ids_TK: torch.Tensor):
    """(weights, ids) with the trace's ids, at equal weights, on the rows the trace holds."""
    trace_TK, known_T = picked
    ids_TK = torch.where(known_T[:, None], trace_TK.to(ids_TK.dtype), ids_TK)
    equal = torch.full_like(weights_TK, 1.0 / weights_TK.shape[1])
    return torch.where(known_T[:, None], equal, weights_TK), ids_TK


class TraceRouter(nn.Module):
    """A MoE block's router with the trace's choice put in (the model's own for rows the trace does not hold), for
    the families whose block forward is tiermoe's (HybridMoE calls the router)."""

    def __init__(self, original: nn.Module, routing: TraceRouting, layer: int):
        super().__init__()
        self.original = original
        self.routing = routing
        self.layer = layer

    def forward(self, x_TD: torch.Tensor):
        logits, weights_TK, ids_TK = self.original(x_TD)
        picked = self.routing.current(self.layer, x_TD.shape[0])
        if picked is None:
            return logits, weights_TK, ids_TK
        return (logits, *traced(picked, weights_TK, ids_TK))


class TraceExperts(nn.Module):
    """A block's experts module (HybridExperts) called with the trace's choice in place of the block's own, for the
    families whose block forward stays the model's: the block routes as it does, then its experts call lands here."""

    def __init__(self, experts: nn.Module, routing: TraceRouting, layer: int):
        super().__init__()
        self.original = experts
        self.routing = routing
        self.layer = layer

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        picked = self.routing.current(self.layer, hidden_states.shape[0])
        if picked is not None:
            top_k_weights, top_k_index = traced(picked, top_k_weights, top_k_index)
        return self.original(hidden_states, top_k_index, top_k_weights)


def install_trace_routing(hybrid, routing: TraceRouting) -> None:
    """Wrap every MoE block's router of `hybrid` (a HybridModel) and let its engines announce passes to `routing`.
    The trace's top-k must be the model's: the tiers, recorders and cost model all count K pairs per token."""
    spec = hybrid.spec
    if spec.experts_call != "interface":  # the trace's ids go into the interface's call, which this block wraps
        raise TiermoeError(f"routing traces replace the ids of transformers' experts call, which {spec.model_type}'s "
                           f"block does not make as such (its experts call: {spec.experts_call}); use a model whose "
                           "experts take the interface")
    k = routing.ids_NMK.shape[-1]
    if k != spec.top_k:
        raise TiermoeError(f"the routing trace routes each token to {k} experts, the model to {spec.top_k}; "
                           f"use a model with top-k {k} (e.g. `tiermoe make-model ... --top-k {k}`)")
    if int(routing.ids_NMK.max()) >= spec.num_experts:
        raise TiermoeError(f"the routing trace uses expert {int(routing.ids_NMK.max())}; the model has "
                           f"{spec.num_experts} experts per layer")
    missing = [layer for layer in routing.column if layer not in hybrid.blocks]
    if missing:
        raise TiermoeError(f"the routing trace is mapped to layers {missing}, which are not MoE layers of the model")
    if spec.block_forward == "tiermoe":
        for layer, block in hybrid.blocks.items():
            router = block._modules[spec.router_attr]
            if isinstance(router, TraceRouter):
                router = router.original
            block._modules[spec.router_attr] = TraceRouter(router, routing, layer)
    else:
        for parent, name, experts in _experts_slots(hybrid):
            setattr(parent, name, TraceExperts(experts, routing, experts.layer))
    hybrid.routing_override = routing


def remove_trace_routing(hybrid) -> None:
    if hybrid.spec.block_forward == "tiermoe":
        for block in hybrid.blocks.values():
            router = block._modules[hybrid.spec.router_attr]
            if isinstance(router, TraceRouter):
                block._modules[hybrid.spec.router_attr] = router.original
    else:
        for parent, name, experts in _experts_slots(hybrid):
            setattr(parent, name, experts)
    hybrid.routing_override = None


def _experts_slots(hybrid) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent block, attribute, its HybridExperts) for each MoE layer whose block forward is the model's, the
    HybridExperts unwrapped if a trace wraps it."""
    experts_ids = {id(block) for block in hybrid.blocks.values()}
    slots = []
    for parent in hybrid.model.modules():
        if isinstance(parent, TraceExperts):  # its `original` is the slot's content, not a slot
            continue
        for name, child in parent.named_children():
            inner = child.original if isinstance(child, TraceExperts) else child
            if id(inner) in experts_ids:
                slots.append((parent, name, inner))
    return slots
