"""tiermoe trace's runs: `convert` (another tool's routing as tiermoe's CSV) and `generate` (trace_generate_run)."""

from __future__ import annotations

from tiermoe.cli.trace_generate_run import run_generate
from tiermoe.routing.trace_convert import convert


def run(args) -> int:
    if args.trace_command == "generate":
        return run_generate(args)
    print(convert(args.source, args.out, args.layout, args.first_moe_layer, args.prompt_share).describe())
    return 0
