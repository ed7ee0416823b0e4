"""How long the kernel team's helpers should spin before they sleep: decode and prompt steps at each spin, one process.

After a job a helper spins `TIERMOE_TEAM_SPIN_US` microseconds (tiermoe.experts.kernels.SPIN_US), then sleeps; the
next job after that first waits for it to wake (bench_read_pace.py measures the wake-up). A longer spin keeps it
awake across the Python between a step's calls, and takes its core from anything else for that long (torch's
threads in a prompt step). This loads the model once per spin value in one process (each load's team takes the
value in force when it loads) and times, alternating the loads in every round: a decode step of one sequence
(`--tokens` steps) and the first token of a `--prompt`-token prompt (random tokens, new every time, so no
prefix is cached). Median and spread (min-max) of `--rounds` rounds, and in how many rounds each spin beat the
first one's time.

    python benchmarks/bench_team_spin.py --model DIR                            # spins 50 and 2000 us, 4-bit
    python benchmarks/bench_team_spin.py --model DIR --spins 0,50,500,2000 --format bf16 --rounds 9
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e.tiermoe_side import TiermoeSide

from tiermoe.experts.kernels import MAX_SPIN_US, SPIN_US


def load_at_spin(model: str, threads: int, fmt: str, spin_us: int) -> TiermoeSide:
    """The model loaded with its team spinning `spin_us` (TIERMOE_TEAM_SPIN_US while it loads)."""
    before = os.environ.get("TIERMOE_TEAM_SPIN_US")
    os.environ["TIERMOE_TEAM_SPIN_US"] = str(spin_us)
    try:
        return TiermoeSide(model, threads, fmt)
    finally:
        if before is None:
            del os.environ["TIERMOE_TEAM_SPIN_US"]
        else:
            os.environ["TIERMOE_TEAM_SPIN_US"] = before


def spins(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(v < 0 or v > MAX_SPIN_US for v in values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"expected distinct microsecond counts, 0 to {MAX_SPIN_US:,}, e.g. 50,2000")
    return values


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Example: python benchmarks/bench_team_spin.py --model DIR --spins 50,2000",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint directory (a Qwen3-30B-A3B-shaped one: make-model)")
    p.add_argument("--spins", type=spins, default=[SPIN_US, 2000],
                   help=f"microseconds, comma-separated; the first is the reference (default {SPIN_US},2000)")
    p.add_argument("--format", choices=("bf16", "4-bit"), default="4-bit", help="the model's CPU formats")
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1), help="kernel team size (default 2)")
    p.add_argument("--rounds", type=int, default=8, help="alternating rounds (default 8)")
    p.add_argument("--tokens", type=int, default=48, help="decode steps timed per round (default 48)")
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens of the first-token timing (default 256)")
    args = p.parse_args()
    if min(args.rounds, args.tokens, args.prompt, args.threads) < 1 or args.threads > (os.cpu_count() or 1):
        p.error(f"--rounds, --tokens and --prompt must be >= 1, --threads 1 to {os.cpu_count()}")

    short = list(range(100, 164))  # the decoded sequence's prompt
    sides = {}
    for spin in args.spins:
        print(f"loading at spin {spin} us", file=sys.stderr, flush=True)
        sides[spin] = load_at_spin(args.model, args.threads, args.format, spin)
        sides[spin].decode_s_per_token(short, 4)  # warm
    decode = {s: [] for s in args.spins}
    first = {s: [] for s in args.spins}
    vocab = next(iter(sides.values())).llm.hybrid.model.get_input_embeddings().num_embeddings
    tokens = torch.Generator().manual_seed(0)
    for r in range(args.rounds):
        order = args.spins if r % 2 == 0 else args.spins[::-1]
        for spin in order:
            decode[spin].append(sides[spin].decode_s_per_token(short, args.tokens) * 1e3)
            # a prompt of its own every time: a prompt seen before would be served from the prefix cache
            prompt = torch.randint(vocab // 4, vocab, (args.prompt,), generator=tokens).tolist()
            first[spin].append(sides[spin].first_token_s(prompt) * 1e3)
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{s} us {decode[s][-1]:.2f} ms" for s in args.spins),
              file=sys.stderr, flush=True)
    for side in sides.values():
        side.close()

    ref = args.spins[0]
    print(f"\n{args.model}, {args.format}, {args.threads} threads; {args.rounds} alternating rounds\n")
    print(f"| spin, us | decode ms / step, median (min-max) | vs {ref} us | rounds faster than {ref} us | "
          f"first token of {args.prompt}, ms (min-max) | vs {ref} us |")
    print("|---|---|---|---|---|---|")
    for spin in args.spins:
        d, f = decode[spin], first[spin]
        wins = sum(a < b for a, b in zip(d, decode[ref]))
        print(f"| {spin} | {statistics.median(d):.2f} ({min(d):.2f}-{max(d):.2f}) | "
              f"{statistics.median(d) / statistics.median(decode[ref]):.3f}x | "
              f"{'-' if spin == ref else f'{wins} / {args.rounds}'} | "
              f"{statistics.median(f):.1f} ({min(f):.1f}-{max(f):.1f}) | "
              f"{statistics.median(f) / statistics.median(first[ref]):.3f}x |")


if __name__ == "__main__":
    main()
