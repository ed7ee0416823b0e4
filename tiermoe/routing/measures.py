"""Statistics of a per-token routing trace that decide how placement fares: skew, hot-set transfer, reuse by lag.

Every function takes the per_token trace dict (tiermoe.stats.traces; a trace CSV read, a converted ESFT file or
a generated trace), so the files of `data/routing` and the routing generator are measured by the same
code (docs/traces.md, "Routing generator").

- `gini_by_layer`: Gini of each MoE layer's counts over the first `num_tokens` tokens. Gini falls with the sample
  (a uniform router scores 0.02-0.09 on a few thousand tokens): compare traces at the same number of tokens.
- `hot_set_hit`: share of a trace's routed pairs that land in the hottest `hot` experts of each layer of some
  calibration counts (the GPU hit rate of a static placement with `hot` experts a layer); `hot_set_overlap`: the
  share of two hot sets in common.
- `lag_reuse`: mean |S_t ∩ S_t-d| / k over tokens t, t-d of one request, per lag d = 1..D, and the same after
  shuffling each request's tokens (what per-request popularity alone gives); their difference is short-range
  locality.
- `cross_layer_correlation`: correlation, over consecutive token pairs, of a layer's lag-1 reuse with the next
  layer's (0 when layers route independently).
- `cross_layer_dependence`: how far a token's experts at layer m+1 depend on its experts at layer m (total
  variation between their joint distribution and the product of the marginals; a shuffle gives the floor).
Legend: N tokens, M MoE layers, K top-k, E experts, D lags, P token pairs.
"""

from __future__ import annotations

import numpy as np
import torch

from tiermoe.routing.balance import gini
from tiermoe.stats.traces import counts_from_trace

PAIR_CHUNK = 1 << 16  # token pairs compared at once: [P, M, K, K] booleans stay a few hundred MB at most


def moe_counts(trace: dict, num_tokens: int | None = None) -> torch.Tensor:
    """Counts [M, E] of the trace's MoE layers over its first `num_tokens` tokens (all when None)."""
    if num_tokens is not None:
        trace = dict(trace, topk_ids=trace["topk_ids"][:num_tokens])
    counts_LE = counts_from_trace(trace, int(trace["num_layers"]), int(trace["num_experts"]))
    return counts_LE[[int(x) for x in trace["moe_layers"]]].double()


def gini_by_layer(trace: dict, num_tokens: int | None = None) -> np.ndarray:
    """Gini [M] of each MoE layer's counts over the first `num_tokens` tokens."""
    return np.array([gini(row) for row in moe_counts(trace, num_tokens)])


def hot_sets(counts_ME: torch.Tensor, hot: int) -> torch.Tensor:
    """The `hot` most-routed experts [M, hot] of each layer (ties to the lower id, as a stable sort gives)."""
    order = torch.sort(counts_ME, dim=1, descending=True, stable=True).indices
    return order[:, :hot]


def hot_set_hit(calibration_ME: torch.Tensor, served_ME: torch.Tensor, hot: int) -> float:
    """Share of `served` routed pairs whose expert is among the calibration's `hot` hottest of its layer."""
    hit = served_ME.gather(1, hot_sets(calibration_ME, hot)).sum()
    return float(hit / served_ME.sum().clamp(min=1))


def hot_set_overlap(a_ME: torch.Tensor, b_ME: torch.Tensor, hot: int) -> float:
    """Mean over layers of |hot set of a ∩ hot set of b| / hot."""
    a, b = hot_sets(a_ME, hot), hot_sets(b_ME, hot)
    return float((a[:, :, None] == b[:, None, :]).any(-1).double().mean())


def request_order(trace: dict) -> torch.Tensor:
    """Token indices sorted by (request, position): each request's tokens in a row, in order."""
    key = trace["token_request"].long() * (1 << 32) + trace["token_position"].long()
    return torch.sort(key, stable=True).indices


def shuffled_order(trace: dict, rng: np.random.Generator) -> torch.Tensor:
    """Token indices with each request's tokens in a random order (requests kept in a row)."""
    noise = torch.from_numpy(rng.random(trace["topk_ids"].shape[0]))
    request = trace["token_request"].double()
    order = torch.from_numpy(np.lexsort((noise.numpy(), request.numpy())))
    return order


BYTE_BITS = torch.tensor([bin(i).count("1") for i in range(256)], dtype=torch.uint8)


def expert_sets(ids_NMK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Each token's expert set per layer as bits [N, M, W] int64 (W = ceil(E / 64)); a layer without routing
    (-1) is the empty set."""
    n, m, _ = ids_NMK.shape
    ids = ids_NMK.long()
    logged = ids >= 0
    words = torch.zeros(n, m, (num_experts + 63) // 64, dtype=torch.int64)
    bits = torch.where(logged, torch.ones_like(ids) << (ids.clamp(min=0) % 64), 0)  # distinct bits: sum = or
    words.scatter_add_(2, (ids.clamp(min=0) // 64), bits)
    return words


def shared_count(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a ∩ b| of expert sets as bits [..., W] -> [...]."""
    both = (a & b).contiguous()
    return BYTE_BITS[both.view(torch.uint8).long()].sum(-1, dtype=torch.int64).view(both.shape).sum(-1)


def lag_reuse(trace: dict, max_lag: int = 8, order: torch.Tensor | None = None,
              lags: tuple[int, ...] | None = None) -> np.ndarray:
    """Mean reuse [D] at lags 1..max_lag (or at `lags`): |S_t ∩ S_t-d| / k over token pairs d apart in one
    request (in `order`, default by position), pooled over MoE layers."""
    order = request_order(trace) if order is None else order
    request = trace["token_request"].long()[order]
    ids = trace["topk_ids"][order]
    sets, logged = expert_sets(ids, int(trace["num_experts"])), ids[..., 0] >= 0
    lags = tuple(range(1, max_lag + 1)) if lags is None else lags
    out = np.zeros(len(lags))
    for n, d in enumerate(lags):
        total, pairs = 0.0, 0.0
        for start in range(0, max(ids.shape[0] - d, 0), PAIR_CHUNK):
            later = slice(start + d, min(start + d + PAIR_CHUNK, ids.shape[0]))
            earlier = slice(start, later.stop - d)
            both = logged[later] & logged[earlier] & (request[later] == request[earlier])[:, None]  # [P, M]
            total += float((shared_count(sets[later], sets[earlier]) * both).sum())
            pairs += float(both.sum())
        out[n] = total / ids.shape[2] / max(pairs, 1.0)
    return out


def shuffled_lag_reuse(trace: dict, rng: np.random.Generator, max_lag: int = 8,
                       lags: tuple[int, ...] | None = None) -> np.ndarray:
    """`lag_reuse` after shuffling each request's tokens: what per-request popularity alone gives at any lag."""
    return lag_reuse(trace, max_lag, shuffled_order(trace, rng), lags)


def task_shuffled_reuse(trace: dict, rng: np.random.Generator) -> float:
    """Reuse of two random tokens of the trace (any requests): what task-level popularity alone gives. The gap to
    the within-request shuffle is what per-request popularity adds."""
    pooled = dict(trace, token_request=torch.zeros_like(trace["token_request"]))
    return float(lag_reuse(pooled, 1, torch.from_numpy(rng.permutation(trace["topk_ids"].shape[0])))[0])


def cross_layer_correlation(trace: dict) -> float:
    """Mean over adjacent MoE layers of the correlation, over consecutive tokens of a request, between one
    layer's lag-1 reuse and the next layer's (about 0 when layers route independently)."""
    order = request_order(trace)
    request = trace["token_request"].long()[order]
    same = (request[1:] == request[:-1]).nonzero().flatten()
    ids = trace["topk_ids"]
    sets, logged_N = expert_sets(ids, int(trace["num_experts"])), ids[..., 0] >= 0
    i, j = order[same + 1], order[same]
    reuse_PM = shared_count(sets[i], sets[j]).double()
    logged = logged_N[i] & logged_N[j]
    corrs = []
    for m in range(reuse_PM.shape[1] - 1):
        both = logged[:, m] & logged[:, m + 1]
        x, y = reuse_PM[both, m], reuse_PM[both, m + 1]
        if x.numel() > 2 and float(x.std()) > 0 and float(y.std()) > 0:
            corrs.append(float(torch.corrcoef(torch.stack([x, y]))[0, 1]))
    return float(np.mean(corrs)) if corrs else 0.0


def split_by_request(trace: dict) -> tuple[dict, dict]:
    """(even requests, odd requests) of a trace: calibrate on one half of a task, serve the other."""
    odd = trace["token_request"] % 2 == 1
    return select_tokens(trace, ~odd), select_tokens(trace, odd)


def select_tokens(trace: dict, keep_N: torch.Tensor) -> dict:
    """The trace restricted to the tokens where keep_N is True (counts recomputed)."""
    out = dict(trace)
    for key in ("token_pass", "token_request", "token_position", "token_is_prefill", "topk_ids"):
        out[key] = trace[key][keep_N]
    out["logical_count"] = counts_from_trace(out, int(trace["num_layers"]), int(trace["num_experts"]))[None]
    return out


def request_oracle_hit(trace: dict, hot: int) -> float:
    """Hit rate of a hot set chosen per request on that request's own routing (in-sample): the ceiling a
    per-request placement approaches; the gap to a pooled set is what per-request popularity is worth."""
    hits, total = 0.0, 0.0
    request = trace["token_request"]
    for r in torch.unique(request).tolist():
        counts = moe_counts(select_tokens(trace, request == r))
        hits += hot_set_hit(counts, counts, hot) * float(counts.sum())
        total += float(counts.sum())
    return hits / max(total, 1.0)


def cross_layer_dependence(trace: dict, order: torch.Tensor | None = None) -> float:
    """Mean over adjacent MoE layers of the total-variation distance between the joint distribution of (expert
    at layer m, expert at layer m+1) over a token's k x k pairs and the product of the two marginals. Finite
    samples give a floor: compare with `order` = shuffled_order (layer m+1 taken from another token of the same
    request), which keeps per-request popularity and breaks only the same-token link."""
    by_request = request_order(trace)
    ids = trace["topk_ids"].long()[by_request]
    other = ids if order is None else trace["topk_ids"].long()[order]  # both grouped by request alike
    logged = (ids[..., 0] >= 0) & (other[..., 0] >= 0)
    e = int(trace["num_experts"])
    distances = []
    for m in range(ids.shape[1] - 1):
        rows = logged[:, m] & logged[:, m + 1]
        if int(rows.sum()) < 2:
            continue
        a = torch.zeros(int(rows.sum()), e, dtype=torch.float64).scatter_(1, ids[rows, m], 1.0)
        b = torch.zeros(int(rows.sum()), e, dtype=torch.float64).scatter_(1, other[rows, m + 1], 1.0)
        joint = a.T @ b
        joint /= joint.sum()
        distances.append(float((joint - torch.outer(joint.sum(1), joint.sum(0))).abs().sum() / 2))
    return float(np.mean(distances)) if distances else 0.0
