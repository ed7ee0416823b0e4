"""tiermoe convert's run (its flags: tiermoe.cli.convert_cmd): every routed expert converted to the CPU tier's
format once, into a directory that loads on its own (tiermoe.convert)."""

from __future__ import annotations

from tiermoe.convert import convert_cpu_experts


def run(args) -> int:
    out = convert_cpu_experts(args.model, args.cpu_expert_dtype, args.out, args.dtype,
                              down_fmt=args.cpu_expert_down_dtype)
    print(f"converted CPU-tier experts written to {out}; load them with --model {out}")
    return 0
