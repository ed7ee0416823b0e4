"""`tiermoe trace generate`'s flags: a synthetic routing trace with the statistics of real MoE routing, written as
a trace CSV (seq,pos,layer,experts) that stats, place --init-expert-location and bench dynamic read
(docs/traces.md). The run is trace_generate_run.
"""

from __future__ import annotations

from tiermoe.cli.choices import ROUTING_PRESETS
from tiermoe.cli.flags import (
    add_command,
    fraction,
    non_negative_float,
    non_negative_int,
    output_file,
    positive_int,
    seed_int,
)


def add_generate_parser(commands) -> None:
    g = add_command(
        commands, "generate",
        "Generate per-token routing with the statistics of real MoE routing (docs/traces.md, 'Routing generator'): "
        "per-layer skew rising with depth, task-level popularity (hot sets of two tasks share 25 to 40 percent of "
        "their experts), a popularity perturbation per request, reuse between nearby tokens that fades by lag 4-8, "
        "layers routed independently. Parameters come from a preset fitted to the files of data/routing "
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
    g.add_argument("--preset", choices=sorted(ROUTING_PRESETS), default="esft-deepseek-v2-lite",
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
