"""The host's costs on this machine, measured and curve-fitted (tiermoe.placement.pass_cost.HostCosts): one
dispatched op, and per engine step and per sequence in a step.

1. t_op (measure_op_seconds): the tiers' expert loop timed on tiny experts, where nothing but dispatch costs
   time (Python, the dispatcher, launching): seconds per op. Not fitted on runs: a pass's ops grow with its
   sequences, so t_op and t_seq would be confounded there.
2. t_step, t_seq and t_both (fit_host_costs), on timed calibration runs (by default every expert on the CPU
   tier, every expert on the GPU tier on the CPU device, and a 75% split), never on the configurations the cost
   model is validated on:
       measured_p - model_p(t_step = 0, t_seq = 0, t_both = 0) = t_step + t_seq x sequences_p + t_both x both_p
   both_p counts the MoE layers of pass p in which both tiers compute. t_both is the one interaction term of the
   model with the GPU tier on this CPU: the caller computes the GPU tier's experts while the CPU tier's worker
   computes the others, and they share the cores' caches, the memory bus and the GIL (t_both > 0: they slow
   each other; < 0: they overlap). Only the split run has layers with both tiers, so it alone sets t_both.
   A step is one forward over all its sequences: t_step is its host time as the runs show it (dispatching the
   forward's ops, Python between them, thread hand-offs), not ops x t_op (the forward's ops, many views and small
   norms, cost less each than the expert loop's that t_op is timed on); t_seq what each sequence adds (its pages,
   its rows, its sampling). Least squares over every pass of every run, both >= 0; absolute error, so the
   fit is best where the time is (the total of a run).
3. With the GPU tier on this CPU (fit_this_cpu) the same columns are fitted once more with the per-step term free
   to go below 0: there the model's non-expert forward is the roofline of this CPU's one-core profile, while the
   forward runs its fused kernels on every core, so a step costs less than estimated (the law run on this CPU: all
   on the CPU tier measured 48.2 s against 84.7 s estimated, all on the GPU tier 103.6 against 139.2, both off by
   the same 130 ms a step). Held at 0, the fit had put that into the both-tiers term (-33 ms a layer), which
   rewarded a placement for touching both tiers in every pass. The negative part stays with this CPU's model
   (PassCostModel.forward_correction_seconds); the host costs carried to a GPU profile are the bounded fit's.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from tiermoe.analysis.device_profile import synchronizer
from tiermoe.analysis.model_op_count import count_expert_ops
from tiermoe.experts.ffn import routed_experts_forward
from tiermoe.experts.weights import ExpertWeights
from tiermoe.placement.pass_cost import HostCosts, PassCostModel
from tiermoe.placement.pass_traffic import PassShapes, Traffic


def fit_host_costs(model: PassCostModel, shapes: PassShapes, runs: list[tuple[str, Traffic, list[float]]],
                   free_step: bool = False) -> PassCostModel:
    """runs: (label, traffic of that run's placement, measured seconds of each pass). `model` must have
    device_is_host True (the runs had the GPU tier on this CPU); returns it with t_step and t_seq (its host
    op_seconds kept) and both_tiers_seconds fitted (free_step: see fit_this_cpu)."""
    if not model.device_is_host:
        raise ValueError("host costs are fitted on runs with the GPU tier on the host CPU")
    op = model.host.op_seconds
    zero = replace(model, host=HostCosts(op, 0.0, 0.0), both_tiers_seconds=0.0, forward_correction_seconds=0.0)
    xs, ys = [], []
    for _, traffic, seconds in runs:
        measured = torch.tensor(seconds, dtype=torch.float64)
        if measured.numel() != shapes.num_passes:
            raise ValueError(f"a calibration run has {measured.numel()} steps, the trace {shapes.num_passes} passes")
        both_P = ((traffic.cpu_distinct_PM > 0) & (traffic.gpu_distinct_PM > 0)).sum(-1).double()
        xs.append(torch.stack([torch.ones(shapes.num_passes, dtype=torch.float64), shapes.seqs_P.double(), both_P],
                              dim=1))
        ys.append(measured - zero.pass_seconds_P(shapes, traffic))
    x, y = torch.cat(xs), torch.cat(ys)
    coef = _bounded_lstsq(x, y, lower=(-float("inf") if free_step else 0.0, 0.0, -float("inf")))
    residual = y - x @ coef
    n = shapes.num_passes
    totals = {label: {"measured_seconds": float(sum(s)),
                      "fitted_seconds": float(sum(s)) - float(residual[i * n:(i + 1) * n].sum())}
              for i, (label, _, s) in enumerate(runs)}
    host = HostCosts(op_seconds=op, step_seconds=max(0.0, float(coef[0])), sequence_seconds=float(coef[1]),
                     fit={"runs": totals, "passes": int(y.numel()),
                          "layers_with_both_tiers": int(x[:, 2].sum()),
                          "rms_pass_error_seconds": float(residual.pow(2).mean().sqrt())})
    return replace(model, host=host, both_tiers_seconds=float(coef[2]),
                   forward_correction_seconds=min(0.0, float(coef[0])))


def fit_this_cpu(model: PassCostModel, shapes: PassShapes, runs: list[tuple[str, Traffic, list[float]]]
                 ) -> PassCostModel:
    """fit_host_costs with the per-step term free to go below 0 (its negative part becomes the model's
    forward_correction_seconds, its positive part the host's step_seconds): the this-cpu model."""
    return fit_host_costs(model, shapes, runs, free_step=True)


def measure_op_seconds(act, device="cpu", experts: int = 8, repeats: int = 20) -> float:
    """Seconds per op the host spends dispatching the tiers' expert loop: `experts` tiny experts against one,
    divided by the ops that adds (on CUDA this is host dispatch or launch, whichever is slower)."""
    device = torch.device(device)
    sync = synchronizer(device)
    weights = {e: ExpertWeights(torch.randn(8, 8, device=device), torch.randn(8, 4, device=device))
               for e in range(experts)}
    x = torch.randn(experts, 8, device=device)
    w = torch.ones(experts, 1, device=device)
    one = torch.zeros(experts, 1, dtype=torch.long, device=device)
    many = torch.arange(experts, device=device)[:, None]

    def best(ids) -> float:
        times = []
        with torch.inference_mode():
            for _ in range(repeats + 1):
                sync()
                start = time.perf_counter()
                routed_experts_forward(weights, x, ids, w, act)
                sync()
                times.append(time.perf_counter() - start)
        return min(times[1:])

    return max(0.0, best(many) - best(one)) / ((experts - 1) * count_expert_ops(act).ops)


def _bounded_lstsq(x: torch.Tensor, y: torch.Tensor, lower: tuple[float, ...]) -> torch.Tensor:
    """Least squares with coefficient j >= lower[j]: a coefficient below its bound is fixed there and the rest
    refitted, until all are within bounds. A column of zeros (nothing to identify it) gets its bound clipped to 0."""
    coef = torch.zeros(x.shape[1], dtype=torch.float64)
    free = [j for j in range(x.shape[1]) if bool(x[:, j].abs().sum() > 0)]
    fixed: dict[int, float] = {}
    while free:
        rest = y - sum((x[:, j] * v for j, v in fixed.items()), torch.zeros_like(y))
        sol = torch.linalg.lstsq(x[:, free], rest[:, None]).solution[:, 0]
        low = [j for j, v in zip(free, sol.tolist()) if v < lower[j]]
        if not low:
            coef[free] = sol
            break
        for j in low:
            fixed[j] = lower[j]
            free.remove(j)
    for j, v in fixed.items():
        coef[j] = v
    return coef
