"""A tier's time, measured and fitted: seconds = a x distinct experts + b x (token, expert) pairs + c per call
(tiermoe.placement.tier_time.TierFit, a curve fit of timed calls, not a memory fit).

Timed calls of a tier on the model's real expert weights, rotating over the MoE layers as a forward pass does:
- the CPU tier through its backend's submit/sync protocol (whatever `CPUConfig` chose): this is the CPU share of
  every estimate;
- the GPU tier, when it runs on this CPU (estimates on a CPU-only machine): it tells the cost model what one op
  the GPU tier dispatches costs this host.
A pass reads each distinct expert once (a: weights read, per-expert dispatch), every pair costs math (b), and every
call a fixed amount (c; for the CPU tier the hand-off to its worker thread, paid whenever a layer's CPU tier holds
experts, even when no token routes to them). The fit minimises relative error, so small decode calls weigh as
much as large prefill ones; every point is the best of a few interleaved rounds, since the machine may be shared.
Legend: T tokens, K top-k, D hidden.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import torch

from tiermoe.analysis.device_profile import synchronizer
from tiermoe.placement.tier_time import TierFit


def _ids(distinct: int, pairs: int, top_k: int, experts: list[int]) -> torch.Tensor:
    """ids_TK with `pairs` slots routed round-robin over `distinct` experts, the rest -1 (another tier)."""
    tokens = max(1, -(-pairs // top_k))
    flat = torch.full((tokens * top_k,), -1, dtype=torch.long)
    if distinct:
        flat[:pairs] = torch.tensor(experts[:distinct])[torch.arange(pairs) % distinct]
    return flat.reshape(tokens, top_k)


def sample_grid(num_experts: int, max_pairs: int = 2048) -> list[tuple[int, int]]:
    """(distinct, pairs) points: decode-sized to prefill-sized calls, and empty calls for c."""
    points = [(0, 0)]
    d = 1
    while True:
        for per in (1, 4, 16, 64):
            points.append((d, min(max_pairs, d * per)))
        if d == num_experts:
            break
        d = min(num_experts, d * 2)
    return sorted(set(points))


def time_tier(calls: list[Callable], spec, dtype: torch.dtype, device, repeats: int = 7,
              max_pairs: int = 2048) -> TierFit:
    """Fit a, b, c on `calls` (one per MoE layer: call(x_TD, ids_TK, weights_TK) computes and waits).
    Every point is timed once per round, rounds interleaved, and keeps its fastest round: a burst of load from
    other processes then slows one round of every point, not every round of one point."""
    gen = torch.Generator().manual_seed(0)
    device = torch.device(device)
    sync = synchronizer(device)
    grid = sample_grid(spec.num_experts, max_pairs)
    inputs = []
    for distinct, pairs in grid:
        experts = torch.randperm(spec.num_experts, generator=gen).tolist()
        ids = _ids(distinct, pairs, spec.top_k, experts).to(device)
        x = torch.randn(ids.shape[0], spec.hidden_size, generator=gen).to(device, dtype)
        inputs.append((x, ids, torch.full(ids.shape, 1.0 / spec.top_k, dtype=dtype, device=device)))
    best = [float("inf")] * len(grid)
    with torch.inference_mode():
        for r in range(repeats + 1):  # round 0 warms up
            for i, (x, ids, w) in enumerate(inputs):
                sync()
                start = time.perf_counter()
                calls[(i + r) % len(calls)](x, ids, w)
                sync()
                if r:
                    best[i] = min(best[i], time.perf_counter() - start)
    rows = [[float(distinct), float(pairs), 1.0] for distinct, pairs in grid]
    return fit_abc(torch.tensor(rows, dtype=torch.float64), torch.tensor(best, dtype=torch.float64))


def measure_cpu_tier(hybrid, repeats: int = 7) -> TierFit:
    """The CPU tier's backend; every MoE layer's CPU tier must hold all its experts (an all-CPU placement)."""
    spec = hybrid.spec
    tiers = [block.cpu_tier for block in hybrid.blocks.values()]
    if any(len(t) < spec.num_experts for t in tiers):
        raise ValueError("measure_cpu_tier needs every expert on the CPU tier (an all-CPU placement)")

    def call(tier):
        def run(x, ids, w):
            tier.submit(x.cpu(), ids.cpu(), w.cpu())
            tier.sync()
        return run

    fit = time_tier([call(t) for t in tiers], spec, hybrid.expert_dtype, "cpu", repeats)
    return replace(fit, backend=type(tiers[0]).__name__)


def measure_gpu_tier(hybrid, repeats: int = 7) -> TierFit:
    """The GPU tier on its device; every MoE layer's GPU tier must hold all its experts (an all-GPU placement)."""
    spec = hybrid.spec
    tiers = [block.gpu_tier for block in hybrid.blocks.values()]
    if any(len(t) < spec.num_experts for t in tiers):
        raise ValueError("measure_gpu_tier needs every expert on the GPU tier (an all-GPU placement)")
    fit = time_tier([t.forward for t in tiers], spec, hybrid.expert_dtype, hybrid.gpu_device, repeats)
    return replace(fit, backend=f"{type(tiers[0]).__name__} on {hybrid.gpu_device}")


def fit_abc(rows_S3: torch.Tensor, seconds_S: torch.Tensor) -> TierFit:
    """Least squares on relative error of seconds ~ rows @ [a, b, c], coefficients kept >= 0."""
    active = [0, 1, 2]
    coef = torch.zeros(3, dtype=torch.float64)
    scale = 1.0 / seconds_S.clamp(min=1e-9)
    while active:
        sol = torch.linalg.lstsq(rows_S3[:, active] * scale[:, None], (seconds_S * scale)[:, None]).solution[:, 0]
        if bool((sol >= 0).all()):
            coef[active] = sol
            break
        active = [j for j, v in zip(active, sol.tolist()) if v >= 0]
    pred = rows_S3 @ coef
    rel = float(((pred - seconds_S).abs() / seconds_S.clamp(min=1e-9)).mean())
    return TierFit(float(coef[0]), float(coef[1]), float(coef[2]), rel, int(seconds_S.numel()))
