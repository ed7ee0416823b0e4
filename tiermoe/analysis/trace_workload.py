"""The placement benchmark on routing from a trace (`tiermoe bench placement --routing-trace`): the trace's
requests become the workload, and the model's routers pick the trace's experts (tiermoe.layers.trace_routing).

Each trace request is served as a request: its prompt is its prefill tokens (at least its first token; a trace
without prefill marks, as ESFT's teacher-forced text, decodes one token a step after it), its output the rest, so
the served positions are exactly the trace's. The model's MoE layers take the trace's MoE layers in
`layers` (default: evenly spread from the first to the last, so a 4-layer model sees shallow and deep routing
alike). Calibration: a statistics file (`calibration`, any file `tiermoe stats` reads, of the trace model's shape),
else the trace's even-numbered requests (served, so their counts are recorded like a dataset's), the odd ones held
out. Prompt token ids are seeded random ids: with routing given, what the tokens say does not matter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tiermoe.analysis.placement_workload import Workload
from tiermoe.errors import TiermoeError
from tiermoe.layers.trace_routing import TraceRouting
from tiermoe.stats.io import load_counts, load_trace


@dataclass(frozen=True)
class RoutingTraceSpec:
    path: str
    calibration: str | None = None  # statistics of the trace model's shape; None: the trace's even requests
    layers: tuple[int, ...] | None = None  # the trace's MoE layers (decoder indices) for the model's, in order
    seed: int = 0


@dataclass
class TraceWorkloads:
    routing: TraceRouting
    calibration: Workload | None  # None when the statistics come from a file
    heldout: Workload
    calibration_LE: torch.Tensor | None  # [model layers, E] from the file, else None (recorded by serving)
    layers: tuple[int, ...]  # the trace layer each model MoE layer replays

    def describe(self) -> str:
        return f"trace layers {list(self.layers)}"


def spread_layers(trace_layers: list[int], count: int) -> tuple[int, ...]:
    """`count` of `trace_layers`, evenly spread from the first to the last."""
    if count > len(trace_layers):
        raise TiermoeError(f"the model has {count} MoE layers, the routing trace only {len(trace_layers)}")
    if count == 1:
        return (trace_layers[len(trace_layers) // 2],)
    return tuple(trace_layers[round(i * (len(trace_layers) - 1) / (count - 1))] for i in range(count))


def trace_workloads(spec: RoutingTraceSpec, model_spec, vocab_size: int, num_prompts: int, calibration_prompts: int,
                    device="cpu") -> TraceWorkloads:
    trace = load_trace(spec.path)
    trace_layers = [int(x) for x in trace["moe_layers"]]
    model_layers = list(model_spec.moe_layers)
    if int(trace["num_experts"]) != model_spec.num_experts:
        raise TiermoeError(f"the routing trace has {trace['num_experts']} experts per layer, the model "
                           f"{model_spec.num_experts}")
    layers = tuple(spec.layers) if spec.layers else spread_layers(trace_layers, len(model_layers))
    unknown = [x for x in layers if x not in trace_layers]
    if unknown or len(layers) != len(model_layers):
        raise TiermoeError(f"--routing-layers needs {len(model_layers)} of the trace's MoE layers "
                           f"{_span(trace_layers)}, got {list(layers)}")
    columns = [trace_layers.index(x) for x in layers]
    ids_NMK = trace["topk_ids"][:, columns].to(torch.int64)
    requests_N, positions_N = trace["token_request"].to(torch.int64), trace["token_position"].to(torch.int64)
    routing = TraceRouting(ids_NMK, requests_N, positions_N, model_layers, device, layers)
    order = list(dict.fromkeys(requests_N.tolist()))  # requests in trace order
    calibration_LE = None
    if spec.calibration:
        counts = load_counts(spec.calibration, int(trace["num_layers"]), model_spec.num_experts)
        calibration_LE = torch.zeros(model_spec.num_layers, model_spec.num_experts, dtype=torch.float64)
        calibration_LE[model_layers] = counts[list(layers)].to(torch.float64)
        calibration, heldout = [], order
    elif len(order) < 2:
        raise TiermoeError(f"the routing trace holds {len(order)} request; give calibration statistics "
                           "(--routing-calibration) or a trace of several requests (even ones calibrate)")
    else:
        calibration, heldout = order[0::2], order[1::2]
    prefill_N = trace["token_is_prefill"].bool()
    gen = torch.Generator().manual_seed(spec.seed)

    def workload(name: str, requests: list[int], limit: int) -> Workload:
        prompts, lens = [], []
        for r in requests[:limit]:
            mine = requests_N == r
            length = int(positions_N[mine].max()) + 1
            prompt = min(length, max(1, int(prefill_N[mine].sum())))
            prompts.append(tuple(torch.randint(0, vocab_size, (prompt,), generator=gen).tolist()))
            lens.append(length - prompt + 1)  # the last output token is sampled, never fed back
        return Workload(name, tuple(prompts), tuple(lens), trace_requests=tuple(requests[:limit]))

    return TraceWorkloads(routing, workload("calibration", calibration, calibration_prompts) if calibration else None,
                          workload("held-out", heldout, num_prompts), calibration_LE, layers)


def _span(layers: list[int]) -> str:
    return f"{layers[0]}..{layers[-1]}" if layers == list(range(layers[0], layers[-1] + 1)) else str(layers)
