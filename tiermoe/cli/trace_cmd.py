"""tiermoe trace: routing traces from other tools (`convert`) or generated (`generate`), written as tiermoe's text
formats. The flags; the runs are trace_run."""

from __future__ import annotations

from tiermoe.cli.choices import TRACE_LAYOUTS
from tiermoe.cli.flags import add_command, fraction, non_negative_int, output_file
from tiermoe.cli.trace_generate import add_generate_parser


def add_parser(sub) -> None:
    p = add_command(sub, "trace", "Routing traces: `tiermoe trace convert` reads another tool's layout and writes "
                    "tiermoe's trace CSV (seq,pos,layer,experts) or heat-matrix CSV (layer,e0,e1,...), which "
                    "stats, place --init-expert-location and bench dynamic read (docs/traces.md); `tiermoe trace "
                    "generate` writes synthetic routing with the statistics of real traces.",
                    "tiermoe trace convert trace_law.txt law.csv",
                    "tiermoe trace generate synth.csv --tasks 3 --sequences 64",
                    "tiermoe bench dynamic --trace law.csv --calibration intent.csv --model config.json")
    commands = p.add_subparsers(dest="trace_command", metavar="COMMAND", required=True)
    c = add_command(
        commands, "convert",
        "Convert routing to tiermoe's text formats: a per-token trace to a trace CSV, counts to a heat matrix. "
        "Layouts: esft-trace (deepseek-ai/ESFT expert scores), esft-counts (ESFT counts_<task>.csv), route-trace "
        "(BigMoeOnEdge route_trace v1), heat (a layer,e0,... heat matrix), sglang (SGLang's per_token dump .pt), "
        "tiermoe (a tiermoe per_token trace, or any statistics file whose counts become a heat matrix). The layout "
        "is detected from the content unless --from names it.",
        "tiermoe trace convert esft-deepseek-v2-lite/trace_law.txt law.csv",
        "tiermoe trace convert esft-deepseek-v2-lite/counts_intent.csv intent_heat.csv",
        "tiermoe trace convert --from sglang expert_distribution_recorder_1730000000.0_0.pt sglang.csv",
        "tiermoe trace convert decode-route-traces/qwen.route.csv qwen.csv",
        "tiermoe trace convert esft-deepseek-v2-lite/trace_law.txt law_prompts.csv --prompt-share 0.5",
    )
    c.prog = "tiermoe trace convert"
    c.add_argument("source", help="the file to convert")
    c.add_argument("out", type=output_file, help="the CSV to write")
    c.add_argument("--from", dest="layout", choices=TRACE_LAYOUTS, default=None, help="the source's layout (default: "
                   "detected)")
    c.add_argument("--first-moe-layer", type=non_negative_int, default=1,
                   help="ESFT layouts: decoder layer of the first logged MoE layer (default 1, DeepSeek-V2-Lite's)")
    c.add_argument("--prompt-share", type=fraction, default=None,
                   help="mark the first SHARE of each request's tokens (rounded up) as its prompt, in place of the "
                        "source's marks: for traces that mark none (ESFT's), so prefill-time placement has prompts")

    add_generate_parser(commands)
