"""`tiermoe trace generate`: a synthetic routing trace with the statistics of real MoE routing, written as a trace
CSV (seq,pos,layer,experts) that stats, place --init-expert-location and bench dynamic read (docs/traces.md).

Sizes are bounded before any work: the largest request's logits must fit in available memory (with room for the
Gumbel noise and the top-k), and the CSV in the output's free disk space.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from tiermoe.cli.flags import (
    add_command,
    fraction,
    non_negative_float,
    non_negative_int,
    output_file,
    positive_int,
    seed_int,
)
from tiermoe.errors import TiermoeError
from tiermoe.placement.free_memory import available_ram
from tiermoe.stats.routing_fit import fit_routing, targets_from_traces
from tiermoe.stats.routing_generator import RoutingShape, generate_requests
from tiermoe.stats.routing_presets import PRESETS
from tiermoe.stats.routing_sources import load_task_traces
from tiermoe.stats.routing_write import row_bytes, write_generated_csv

WORKING_COPIES = 4  # a request's logits, its Gumbel noise, a local state and topk's scratch: float32 [T, M, E] each
MAX_EXPERTS = 1 << 20


def add_generate_parser(commands) -> None:
    g = add_command(
        commands, "generate",
        "Generate per-token routing with the statistics of real MoE routing (docs/traces.md, 'Routing generator'): "
        "per-layer skew rising with depth, task-level popularity (hot sets of two tasks share 25 to 40 percent of "
        "their experts), a popularity perturbation per request, reuse between nearby tokens that fades by lag 4-8, "
        "layers routed independently. Parameters come from a preset fitted to the files of ../shared/routing-data "
        "(esft-deepseek-v2-lite: the ESFT DeepSeek-V2-Lite traces; qwen3-30b-a3b: skew by depth from the Qwen3 heat) "
        "or are fitted now to traces of your own (--fit-from; minutes). Another number of layers reuses the skew "
        "profile over relative depth. Every token is a decode token, one pass each; the sequences of all tasks are "
        "numbered task by task, so with --tasks 2 a file serves task 0 and then task 1 (a workload shift), and "
        "--task picks one task of the same seeded workload (calibrate on one, replay another).",
        "tiermoe trace generate synth.csv",
        "tiermoe trace generate calib.csv --tasks 3 --task 0 --sequences 64 --seed 7",
        "tiermoe trace generate serve.csv --tasks 3 --task 1 --sequences 64 --seed 7",
        "tiermoe trace generate long.csv --preset qwen3-30b-a3b --sequences 4 --tokens 8192",
        "tiermoe trace generate big.csv --layers 60 --experts 256 --top-k 8 --sequences 32",
        "tiermoe trace generate mine.csv --fit-from esft-deepseek-v2-lite/ --tasks 5",
        "tiermoe trace generate chat.csv --request-spread 1.5 --sequences 100   # requests that differ a lot",
        "tiermoe bench dynamic --trace serve.csv --calibration calib.csv --model DeepSeek-V2-Lite/config.json",
    )
    g.prog = "tiermoe trace generate"
    g.add_argument("out", type=output_file, help="the trace CSV to write")
    g.add_argument("--preset", choices=sorted(PRESETS), default="esft-deepseek-v2-lite",
                   help="fitted parameters and default shape (default esft-deepseek-v2-lite)")
    g.add_argument("--fit-from", nargs="+", metavar="PATH",
                   help="fit the parameters to these traces instead (files in any layout `trace convert` reads, "
                        "or folders of them; one task per file)")
    g.add_argument("--layers", type=positive_int, help="MoE layers (default: the preset's / the fitted traces')")
    g.add_argument("--first-moe-layer", type=non_negative_int,
                   help="decoder-layer index of the first MoE layer (default: the preset's)")
    g.add_argument("--experts", type=positive_int, help="routed experts per layer (default: the preset's)")
    g.add_argument("--top-k", type=positive_int, help="experts per token (default: the preset's)")
    g.add_argument("--tasks", type=positive_int, default=1, help="tasks with their own popularity (default 1)")
    g.add_argument("--task", type=non_negative_int, help="write only this task (0-based; default all)")
    g.add_argument("--sequences", type=positive_int, default=16, help="sequences (requests) per task (default 16)")
    g.add_argument("--tokens", type=positive_int, help="tokens per sequence (default: the preset's median)")
    g.add_argument("--shared", type=fraction, help="override: share of expert popularity common to all tasks "
                   "(0 = unrelated tasks, 1 = one popularity; ESFT fit 0.2)")
    g.add_argument("--request-spread", type=non_negative_float, help="override: per-request popularity "
                   "perturbation (logit std; ESFT fit about 0.1, where requests of one task route alike; 1 or more "
                   "makes a per-request placement worth much more than a pooled one)")
    g.add_argument("--seed", type=seed_int, default=0, help="seed of the whole workload (default 0)")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def _params_and_shape(args):
    preset = PRESETS[args.preset]
    params, shape, tokens = preset.params, preset.shape, preset.tokens_per_request
    if args.fit_from:
        traces = load_task_traces(args.fit_from)
        targets = targets_from_traces(traces)
        print(f"fitting to {len(traces)} trace(s) ({', '.join(traces)}); this takes minutes", file=sys.stderr)
        params = replace(fit_routing(targets, progress=lambda line: print(line, file=sys.stderr, flush=True)),
                         source=f"fitted to {', '.join(traces)}")
        shape = targets.shape
        tokens = int(np.median([x for lengths in targets.lengths_by_task for x in lengths]))
    overrides = {k: getattr(args, k) for k in ("shared", "request_spread") if getattr(args, k) is not None}
    if overrides:
        params = replace(params, **overrides, source=f"{params.source}; set: " + ", ".join(
            f"{k}={v}" for k, v in overrides.items()))
    shape = RoutingShape(args.layers or shape.moe_layers, args.experts or shape.num_experts,
                         args.top_k or shape.top_k,
                         shape.first_moe_layer if args.first_moe_layer is None else args.first_moe_layer,
                         shape.model_type if not (args.layers or args.experts or args.top_k) else "synthetic")
    return params, shape, args.tokens or tokens


def _check_shape(args) -> None:
    experts = args.experts or PRESETS[args.preset].shape.num_experts
    top_k = args.top_k or PRESETS[args.preset].shape.top_k
    if experts > MAX_EXPERTS:
        raise TiermoeError(f"--experts {experts} is more than {MAX_EXPERTS} experts a layer")
    if args.fit_from is None and top_k >= experts:
        raise TiermoeError(f"--top-k {top_k} must be smaller than the number of experts ({experts})")
    if args.task is not None and args.task >= args.tasks:
        raise TiermoeError(f"--task {args.task} does not exist: --tasks {args.tasks} numbers tasks 0..{args.tasks - 1}")


def _check_sizes(shape: RoutingShape, tasks: int, sequences: int, tokens: int, out: str) -> None:
    working = WORKING_COPIES * 4 * tokens * shape.moe_layers * shape.num_experts
    ram = available_ram()
    if ram is not None and working > ram // 2:
        raise TiermoeError(f"one sequence of {tokens} tokens x {shape.moe_layers} layers x {shape.num_experts} "
                           f"experts needs about {working / 2**30:.1f} GiB while generating, more than half the "
                           f"{ram / 2**30:.1f} GiB available: use fewer --tokens (more --sequences)")
    rows = tasks * sequences * tokens * shape.moe_layers
    size = rows * row_bytes(shape, tasks * sequences, tokens)
    free = shutil.disk_usage(Path(out).resolve().parent).free
    if size > free:
        raise TiermoeError(f"the trace would take about {size / 2**30:.1f} GiB ({rows:,} rows), more than the "
                           f"{free / 2**30:.1f} GiB free where '{out}' goes")


def run_generate(args) -> int:
    _check_shape(args)
    params, shape, tokens = _params_and_shape(args)
    if shape.top_k >= shape.num_experts:
        raise TiermoeError(f"--top-k {shape.top_k} must be smaller than the number of experts ({shape.num_experts})")
    chosen = [args.task] if args.task is not None else list(range(args.tasks))
    _check_sizes(shape, len(chosen), args.sequences, tokens, args.out)
    from tqdm import tqdm

    lengths = [[tokens] * args.sequences for _ in range(args.tasks)]
    requests = generate_requests(params, shape, lengths, torch.Generator().manual_seed(args.seed), chosen)
    comments = [f"generated by tiermoe trace generate: {params.source or 'fitted'}; seed={args.seed} "
                f"tasks={args.tasks} sequences_per_task={args.sequences} tokens_per_sequence={tokens}",
                "task_of_seq: " + " ".join(f"{t}:{t * args.sequences}-{(t + 1) * args.sequences - 1}" for t in chosen)]
    with tqdm(total=len(chosen) * args.sequences * tokens, unit="tok", desc="generate",
              disable=None if args.progress else True, dynamic_ncols=True) as bar:  # None: off when not a terminal
        count, written = write_generated_csv(args.out, shape, requests, comments, bar.update)
    print(f"wrote {args.out}: {written:,} tokens ({count} sequences of {tokens}, task(s) "
          f"{','.join(map(str, chosen))} of {args.tasks}), {shape.moe_layers} MoE layers from layer "
          f"{shape.first_moe_layer} x {shape.num_experts} experts, top-{shape.top_k}, seed {args.seed}")
    return 0
