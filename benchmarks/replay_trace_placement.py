"""The estimate of `tiermoe bench placement --routing-trace` on a routing trace, replayed without the model: in seconds
instead of 11-20 minutes, for checking a policy change against the real-size run (issue 23, honest default).

The workload is formed as the bench forms it (tiermoe.analysis.trace_workload): the model's 4 MoE layers replay the
trace layers `--layers` (1, 9, 18, 26 for the ESFT traces); the trace's even requests calibrate (their counts), the
first `--served` odd ones are served `--concurrency` at a time (with `--calibration FILE`, as the bench's
--routing-calibration: that statistics file's counts calibrate and the first `--served` requests of the trace are
served), each with its prompt (the trace's prefill tokens, at least its first token: ESFT requests have none) in its
first pass, then one token a step. Each pass goes through the same estimate (placement_traffic, pass_seconds_P) with the
cost model the recorded run fitted: the `calibration` block of its --out JSON (CPU tier, host costs, model costs) and
its GPU profile. With the cost model of the run's time it gives the ESFT runs' figures exactly (frequency and adaptive,
every ratio, both profiles), so what differs after a policy change is the policy; a trace with rows it does not log (the
Qwen3 decode trace: 27), or a run whose prefill passes reach the layerwise-prefill threshold (512 prompt tokens), only
approximately (the run routes those rows by the model, and streams the experts of those passes). (Runs recorded before
the cost model charged one non-expert forward per pass, 2026-12-05, replay with today's model: their figures differ.)

    PYTHONPATH=$PWD python benchmarks/replay_trace_placement.py \
        --trace data/routing/esft-deepseek-v2-lite/trace_law.txt \
        --result benchmarks/results/placement_esft_law_rtx4090.json
    tiermoe trace convert data/routing/esft-deepseek-v2-lite/counts_intent.csv scratch/esft_intent_heat.csv
    PYTHONPATH=$PWD python benchmarks/replay_trace_placement.py --served 16 \
        --trace data/routing/esft-deepseek-v2-lite/trace_law.txt --calibration scratch/esft_intent_heat.csv \
        --result benchmarks/results/placement_esft_intent_to_law_rtx4090_settled.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch

from tiermoe.analysis.placement_traffic import (
    pass_shapes,
    placement_traffic,
    strategy_mask,
)
from tiermoe.config import AdaptiveSettings
from tiermoe.errors import TiermoeError
from tiermoe.placement.model_costs import ModelCosts
from tiermoe.placement.pass_cost import HostCosts, PassCostModel
from tiermoe.placement.pass_traffic import static_traffic
from tiermoe.placement.profiles import GPUProfile, load_profile
from tiermoe.placement.tier_time import TierFit
from tiermoe.routing.trace_convert import detect_layout, read_routing
from tiermoe.stats.io import load_counts


def recorded_cost_model(result: dict) -> PassCostModel:
    """The cost model a `bench placement` run estimated with, from its --out JSON (a this-cpu run: the GPU tier as
    timed on this CPU, the tiers taking turns, its both-tiers term and forward correction)."""
    fit = result["calibration"]
    host = HostCosts(**{k: fit["host"][k] for k in ("op_seconds", "step_seconds", "sequence_seconds")})
    if result["gpu_profile"]["name"] != "this-cpu":
        return PassCostModel(load_profile(result["gpu_profile"]["name"]), ModelCosts.from_dict(fit["model"]),
                             TierFit(**fit["cpu_backend"]), host)
    host = HostCosts(**{k: fit.get("this_cpu_host", fit["host"])[k]
                        for k in ("op_seconds", "step_seconds", "sequence_seconds")})
    return PassCostModel(GPUProfile(**result["gpu_profile"]), ModelCosts.from_dict(fit["model"]),
                         TierFit(**fit["cpu_backend"]), host, device_is_host=True, tiers_overlap=False,
                         both_tiers_seconds=fit.get("both_tiers_seconds", 0.0),
                         gpu_tier=TierFit(**fit["gpu_tier_on_this_cpu"]),
                         forward_correction_seconds=fit.get("forward_correction_seconds", 0.0))


def refit_on_totals(cost: PassCostModel, result: dict, shapes, counts) -> PassCostModel:
    """A this-cpu run recorded before the per-step term could go below 0 (host_cost_fit.fit_this_cpu): the step and
    both-tiers terms fitted again, on the calibration runs' recorded totals (the JSON keeps no per-pass times), with
    the per-sequence term held at the recorded one. An approximation of what the run would fit now."""
    zero = replace(cost, both_tiers_seconds=0.0, forward_correction_seconds=0.0,
                   host=replace(cost.host, step_seconds=0.0))
    rows, measured = [], []
    for label, run in result["calibration"]["host"]["fit"]["runs"].items():
        strategy, ratio = label.split("@")
        mask = strategy_mask(strategy, shapes.moe_rows_L, shapes.num_experts, float(ratio), counts)
        traffic = static_traffic(shapes, mask[list(shapes.moe_layers)])
        both = float(((traffic.cpu_distinct_PM > 0) & (traffic.gpu_distinct_PM > 0)).sum())
        rows.append([float(shapes.num_passes), both])
        measured.append(run["measured_seconds"] - float(zero.pass_seconds_P(shapes, traffic).sum()))
    coef = torch.linalg.lstsq(torch.tensor(rows, dtype=torch.float64),
                              torch.tensor(measured, dtype=torch.float64)[:, None]).solution[:, 0]
    step, both = float(coef[0]), float(coef[1])
    return replace(zero, host=replace(cost.host, step_seconds=max(0.0, step)), both_tiers_seconds=both,
                   forward_correction_seconds=min(0.0, step))


def bench_workload(trace: dict, layers: list[int], served: int, calibration: int, concurrency: int,
                   calibration_LE: torch.Tensor | None = None):
    """(pass shapes of the served requests, calibration counts [1 + MoE layers, E]) as the bench forms them;
    calibration_LE: counts [trace layers, E] of a statistics file instead of the trace's even requests."""
    columns = [list(trace["moe_layers"]).index(x) for x in layers]
    ids = trace["topk_ids"][:, columns]
    request, position = trace["token_request"].long(), trace["token_position"].long()
    order = list(dict.fromkeys(request.tolist()))
    m, e = len(layers), int(trace["num_experts"])
    counts = torch.zeros(m + 1, e, dtype=torch.float64)  # row 0: a dense first layer (empty where the model has none)
    if calibration_LE is not None:
        counts[1:] = calibration_LE[layers]
        served_requests = order[:served]
    else:
        for r in order[0::2][:calibration]:
            for col in range(m):
                counts[col + 1] += torch.bincount(ids[request == r][:, col].flatten(), minlength=e).double()
        served_requests = order[1::2][:served]
    length = {r: int(position[request == r].max()) + 1 for r in served_requests}
    prompt = {r: min(length[r], max(1, int(trace["token_is_prefill"][request == r].sum()))) for r in length}
    rows, running, waiting, step = [], {}, list(length), 0  # (pass, request, position), admitted as slots free
    while waiting or running:
        while waiting and len(running) < concurrency:
            running[waiting.pop(0)] = 0
        for r in list(running):
            fed = prompt[r] if running[r] == 0 else 1  # the prompt in its first pass, then a token a step
            rows += [(step, r, running[r] + i) for i in range(fed)]
            running[r] += fed
            if running[r] == length[r]:
                del running[r]
        step += 1
    row_of = {(r, p): n for n, (r, p) in enumerate(zip(request.tolist(), position.tolist()))}
    pick = torch.tensor([row_of[(r, p)] for _, r, p in rows])
    served_trace = {"token_pass": torch.tensor([s for s, _, _ in rows]), "token_request": request[pick],
                    "token_position": position[pick],
                    "token_is_prefill": torch.tensor([p < prompt[r] for _, r, p in rows]),
                    "topk_ids": ids[pick], "moe_layers": list(range(1, m + 1)), "num_layers": m + 1,
                    "num_experts": e}
    return pass_shapes(served_trace), counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", required=True, help="an ESFT trace_<task>.txt")
    ap.add_argument("--result", required=True, help="a `bench placement --routing-trace` --out JSON (its cost model)")
    ap.add_argument("--layers", default="1,9,18,26", help="trace layers the model's MoE layers replay")
    ap.add_argument("--served", type=int, default=8)
    ap.add_argument("--calibration-requests", type=int, default=16,
                    help="even requests of the trace that calibrate (default 16; the bench's --calibration-prompts)")
    ap.add_argument("--calibration", metavar="FILE",
                    help="a statistics file of the trace model's shape that calibrates instead (the bench's "
                         "--routing-calibration); the first --served requests are then served")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--ratios", default="0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9")
    ap.add_argument("--strategies", default="frequency,adaptive",
                    help="placements to replay (any of bench placement's; the first is the reference column)")
    ap.add_argument("--refit-totals", action="store_true",
                    help="a this-cpu run recorded before the forward correction: refit its step and both-tiers "
                         "terms on the calibration runs' totals (refit_on_totals)")
    args = ap.parse_args()
    if min(args.served, args.calibration_requests, args.concurrency) < 1:
        ap.error("--served, --calibration-requests and --concurrency must be positive")
    try:
        layers = [int(x) for x in args.layers.split(",")]
        ratios = [float(x) for x in args.ratios.split(",")]
    except ValueError:
        ap.error("--layers takes comma-separated integers and --ratios comma-separated numbers, e.g. 0.1,0.5")
    try:
        result = json.loads(Path(args.result).read_text())
        cost = recorded_cost_model(result)
    except (OSError, ValueError, KeyError, TypeError) as e:
        ap.error(f"--result {args.result}: not a readable `bench placement --routing-trace` --out JSON ({e!r})")
    try:
        trace = read_routing(Path(args.trace), detect_layout(Path(args.trace)))
    except (OSError, TiermoeError) as e:
        ap.error(f"--trace {args.trace}: {e}")
    unknown = sorted(set(layers) - {int(x) for x in trace["moe_layers"]})
    if unknown:
        ap.error(f"--layers {unknown} are not MoE layers of the trace (it has {list(trace['moe_layers'])})")
    calibration_LE = None
    if args.calibration:
        try:
            calibration_LE = load_counts(args.calibration, int(trace["num_layers"]), int(trace["num_experts"]))
        except (OSError, TiermoeError) as e:
            ap.error(f"--calibration {args.calibration}: {e}")
    shapes, counts = bench_workload(trace, layers, args.served, args.calibration_requests, args.concurrency,
                                    calibration_LE)
    settings = AdaptiveSettings(**result["setup"]["adaptive"])  # as the run recorded them
    if args.refit_totals:
        cost = refit_on_totals(cost, result, shapes, counts)
    output = int(shapes.output_tokens_P.sum())
    batch = result["setup"].get("concurrency", args.concurrency)
    strategies = args.strategies.split(",")
    print(f"{shapes.num_passes} passes, {output} output tokens; GPU profile {cost.profile.name} (ESTIMATE)\n")
    print("| ratio | " + " | ".join(f"{s} tok/s (hit, swaps)" for s in strategies) + f" | vs {strategies[0]} |")
    print("|---" * (len(strategies) + 2) + "|")
    for ratio in ratios:
        cells = {}
        for strategy in strategies:
            traffic = placement_traffic(shapes, strategy, ratio, counts, cost, None, settings, tokens_per_pass=batch)
            cells[strategy] = (traffic, output / float(cost.pass_seconds_P(shapes, traffic).sum()))
        ref = cells[strategies[0]][1]
        print(f"| {ratio:.0%} | " + " | ".join(f"{tps:.1f} ({t.hit_rate:.1%}, {t.swaps()})" for t, tps in (
            cells[s] for s in strategies)) + " | " + ", ".join(
            f"{s} {cells[s][1] / ref - 1:+.1%}" for s in strategies[1:]) + " |")


if __name__ == "__main__":
    main()
