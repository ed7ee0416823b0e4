"""Synthetic per-token routing with the statistics of real MoE routing (fitted in tiermoe.routing.fit).

A token's router logits at MoE layer m are a sum of independent Gaussian parts, and its experts are the top-k of
the logits plus Gumbel noise (sampling k experts without replacement from the softmax, in router order):

    logit[e] = skew[m] * (sqrt(shared) * world[m, e] + sqrt(1 - shared) * task[m, e])   task-level popularity
             + request_spread * request[m, e]                                           per-request perturbation
             + fast_spread * fast[m, e] + slow_spread * slow[m, e]                       token-local state

- `skew[m]` (the log-popularity spread of layer m) sets the layer's Gini; it is given from the first to the last
  MoE layer and interpolated over relative depth for another number of layers, so skew rises with depth as fitted.
- `shared` is the share of popularity common to every task: it sets how much two tasks' hot sets overlap.
- `request` is redrawn per request: the dominant effect in real traces (reuse after shuffling a request's tokens).
- `fast` and `slow` are local states that a token keeps from the previous one with probability `fast_keep` /
  `slow_keep` and redraws otherwise: short-range reuse that decays with the lag. The keep/redraw choice is made
  once per token for all layers (consecutive tokens that continue a word resemble each other at every layer, as
  in the files) while the states themselves are drawn per layer (no expert-id correlation between layers).
Every draw comes from a torch.Generator passed in (no global random state); each task and request gets its own
child seed, so a request's routing does not depend on how many requests are generated at once or which tasks are
written.
Legend: T tokens of a request, M MoE layers, E experts, K top-k.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from tiermoe.routing.trace_import import trace_dict
from tiermoe.stats.traces import ids_dtype

SEED_BITS = 62


@dataclass(frozen=True)
class RoutingParams:
    """Generator parameters (logit units: the Gumbel noise that picks experts has scale 1)."""

    skew_by_depth: tuple[float, ...]  # task popularity spread per MoE layer, first to last
    shared: float  # share of popularity variance common to all tasks, in [0, 1]
    request_spread: float  # per-request perturbation
    fast_spread: float
    fast_keep: float  # chance a token keeps the previous token's fast state, in [0, 1)
    slow_spread: float
    slow_keep: float
    source: str = ""  # what the values were fitted to

    def __post_init__(self):
        if not self.skew_by_depth or min(self.skew_by_depth) < 0:
            raise ValueError("skew_by_depth must be a non-empty tuple of spreads >= 0")
        if not 0 <= self.shared <= 1 or not 0 <= self.fast_keep < 1 or not 0 <= self.slow_keep < 1:
            raise ValueError("shared is in [0, 1], fast_keep and slow_keep in [0, 1)")
        if min(self.request_spread, self.fast_spread, self.slow_spread) < 0:
            raise ValueError("spreads are >= 0")

    def skew(self, num_layers: int) -> np.ndarray:
        """Spread [M] for a model of `num_layers` MoE layers: the fitted profile over relative depth."""
        profile = np.asarray(self.skew_by_depth, dtype=np.float64)
        if num_layers == profile.size:
            return profile
        fitted_at = (np.arange(profile.size) + 0.5) / profile.size
        return np.interp((np.arange(num_layers) + 0.5) / num_layers, fitted_at, profile)


@dataclass(frozen=True)
class RoutingShape:
    """What is generated: MoE layers (decoder layers first_moe_layer..), experts, top-k."""

    moe_layers: int
    num_experts: int
    top_k: int
    first_moe_layer: int = 0
    model_type: str = "synthetic"

    def __post_init__(self):
        if self.moe_layers < 1 or self.num_experts < 2 or not 1 <= self.top_k < self.num_experts:
            raise ValueError(f"need >= 1 MoE layer, >= 2 experts and 1 <= top_k < experts; got {self.moe_layers} "
                             f"layers, {self.num_experts} experts, top-{self.top_k}")

    @property
    def layer_ids(self) -> list[int]:
        return list(range(self.first_moe_layer, self.first_moe_layer + self.moe_layers))


@dataclass(frozen=True)
class RequestRouting:
    """One generated request: its task, its index in the whole workload, and its experts [T, M, K]."""

    task: int
    request: int
    ids_TMK: torch.Tensor = field(repr=False)


def child(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def child_seeds(rng: torch.Generator, n: int) -> list[int]:
    return torch.randint(0, 2**SEED_BITS, (n,), generator=rng, dtype=torch.int64).tolist()


def task_popularity(params: RoutingParams, shape: RoutingShape, num_tasks: int,
                    rng: torch.Generator) -> tuple[torch.Tensor, list[int]]:
    """Log-popularity [tasks, M, E] of each task and one seed per task for its requests (drawn from `rng` in a
    fixed order, so task t is the same whatever subset of tasks is then generated)."""
    m, e = shape.moe_layers, shape.num_experts
    world = torch.randn(m, e, generator=rng, dtype=torch.float64)
    seeds = child_seeds(rng, 2 * num_tasks)
    popularity_seeds, request_seeds = seeds[:num_tasks], seeds[num_tasks:]
    skew = torch.from_numpy(params.skew(m))[:, None]
    pops = [skew * (params.shared ** 0.5 * world + (1 - params.shared) ** 0.5 *
                    torch.randn(m, e, generator=child(seed), dtype=torch.float64)) for seed in popularity_seeds]
    return torch.stack(pops).float(), request_seeds


def segment_state(keep_T: torch.Tensor, shape_ME: tuple[int, int], rng: torch.Generator) -> torch.Tensor:
    """A state [T, M, E] that each token keeps from the previous one where keep_T is True and redraws (standard
    normal) otherwise; token 0 always draws. Only the redraws are drawn: token t holds segment cumsum(redraw)[t]."""
    redraw_T = ~keep_T
    redraw_T[0] = True
    draws = torch.randn(int(redraw_T.sum()), *shape_ME, generator=rng)
    return draws[torch.cumsum(redraw_T, 0) - 1]


def request_logits(params: RoutingParams, popularity_ME: torch.Tensor, length: int,
                   rng: torch.Generator) -> torch.Tensor:
    """Router logits [T, M, E] of one request of `length` tokens of a task with log-popularity [M, E]."""
    m, e = popularity_ME.shape
    logits = popularity_ME + params.request_spread * torch.randn(m, e, generator=rng)
    logits = logits.expand(length, m, e).clone()
    for spread, keep in ((params.fast_spread, params.fast_keep), (params.slow_spread, params.slow_keep)):
        if spread > 0:
            logits += spread * segment_state(torch.rand(length, generator=rng) < keep, (m, e), rng)
    return logits


def pick_experts(logits_TME: torch.Tensor, top_k: int, rng: torch.Generator) -> torch.Tensor:
    """Top-k of logits + Gumbel noise, in order (k draws without replacement from the softmax) [T, M, K]."""
    gumbel = torch.rand(logits_TME.shape, generator=rng).clamp_(min=1e-12).log_().neg_().log_().neg_()
    return torch.topk(logits_TME.add_(gumbel), top_k, dim=-1, sorted=True).indices


def generate_requests(params: RoutingParams, shape: RoutingShape, lengths_by_task: list[list[int]],
                      rng: torch.Generator, tasks: list[int] | None = None) -> Iterator[RequestRouting]:
    """Yield the requests of every task in `tasks` (default all), task by task; request indices count over all
    tasks in order (task 0's requests first), so a subset keeps the indices it has in the whole workload."""
    popularity, seeds = task_popularity(params, shape, len(lengths_by_task), rng)
    chosen = range(len(lengths_by_task)) if tasks is None else tasks
    first = np.concatenate([[0], np.cumsum([len(x) for x in lengths_by_task])]).astype(int)
    dtype = ids_dtype(shape.num_experts)
    for t in chosen:
        request_seeds = child_seeds(child(seeds[t]), len(lengths_by_task[t]))
        for r, (length, seed) in enumerate(zip(lengths_by_task[t], request_seeds)):
            request_rng = child(seed)
            logits = request_logits(params, popularity[t], int(length), request_rng)
            yield RequestRouting(t, int(first[t] + r), pick_experts(logits, shape.top_k, request_rng).to(dtype))


def generated_trace(shape: RoutingShape, requests: list[RequestRouting]) -> dict:
    """The per_token trace dict of generated requests (as a trace CSV reads back): every token a decode token and
    a pass of its own, one request after another."""
    token_rows, ids = [], []
    for req in requests:
        n = req.ids_TMK.shape[0]
        token_rows += [(req.request, pos, False, len(token_rows) + pos) for pos in range(n)]
        ids.append(req.ids_TMK)
    ids_NMK = torch.cat(ids) if ids else torch.zeros(0, shape.moe_layers, shape.top_k, dtype=torch.int16)
    trace = trace_dict(token_rows, ids_NMK, shape.layer_ids, shape.first_moe_layer + shape.moe_layers,
                       shape.num_experts, shape.model_type, "generated")
    trace["request_task"] = {req.request: req.task for req in requests}
    return trace
