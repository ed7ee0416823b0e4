"""What does a verify step cost, and what do drafts accepted at a set rate give? Speculative decoding measured
against plain decoding on one model, in alternating arms (the order reversed every other round), the median and
spread (min-max) of --rounds rounds.

--table verify: one sequence's forward of k + 1 tokens (its last token and k drafts, every row's logits kept, as a
  verify step runs) against a plain one-token step, for each --verify-tokens k + 1, at --positions decode
  positions, for each CPU-tier expert format (--expert-dtypes: bf16 is the checkpoint's, int4 converted at load).
  With --routing-trace (a decode trace, e.g. data/routing/decode-route-traces/qwen.route.csv, top-6 over 128
  experts: make the model with --top-k 6) every MoE layer routes each position as the traced model did, so
  consecutive tokens share the experts a real model's do; the table gives the routed experts k + 1 tokens read
  together over one token's (per layer, mean). A round's time of an arm is the sum over the positions.
--table acceptance: decode tokens/s, greedy, --batch sequences together (1: one at a time), with drafts accepted at
  each --acceptance rate p against plain decoding. The drafter (tiermoe.testing.forced_drafts) knows the plain
  run's tokens and drafts, per position, the true next token with probability p, else a wrong one; the verify step
  does the work of real drafts and rejects the wrong one. Arms: adaptive draft length up to --draft-tokens (the
  engine's cost model chooses k, 0 included), and with --fixed also k = --draft-tokens every step. Every arm's
  tokens are checked against plain decoding's (fp32: any difference is an error; bf16: counted, from a tie on).
  The acceptance shown is measured (drafted tokens accepted): below p, as drafts after a wrong token count too.

    python benchmarks/bench_speculative_verify.py --table verify --model q30b-8l-top6 \\
        --routing-trace data/routing/decode-route-traces/qwen.route.csv --expert-dtypes bf16,int4
    python benchmarks/bench_speculative_verify.py --table acceptance --model q30b-8l-top6 --expert-dtypes int4 \\
        --acceptance 0,0.5,0.7,0.9 --tokens 32 --prompts 2
    python benchmarks/bench_speculative_verify.py --table acceptance --batch 8 --model q30b-8l-top6 \\
        --expert-dtypes int4 --acceptance 0,0.7 --prompts 8
    python benchmarks/bench_speculative_verify.py --table acceptance --dtype fp32 --rounds 1   # the demo model

(q30b-8l-top6: `tiermoe make-model --preset qwen3-30b-a3b --layers 8 --top-k 6 --out q30b-8l-top6`.)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from support.decode_rounds import print_load_average
from support.speculative_arms import ReplayedTrace, check_against_plain, decode

from tiermoe.config import CPUConfig
from tiermoe.engine.llm import LLM
from tiermoe.engine.speculative_config import MAX_DRAFT_TOKENS, SpeculativeConfig
from tiermoe.engine.speculative_drafting import step_cost_of
from tiermoe.engine.speculative_timing import MeasuredStepCost
from tiermoe.errors import TiermoeError
from tiermoe.stats.recording import PassInfo
from tiermoe.testing.forced_drafts import ForcedAcceptanceDrafter

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
EXPERT_DTYPES = ("bf16", "int8", "int4")


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def verify_table(args, expert_dtype: str) -> None:
    """Forward seconds of k + 1 tokens against one, per arm, at the chosen decode positions."""
    with LLM(args.model, progress=False, max_running=1, dtype=DTYPES.get(args.dtype),
             cpu=CPUConfig(expert_dtype=None if expert_dtype == "bf16" else expert_dtype)) as llm:
        engine = llm.engine
        trace = ReplayedTrace(llm, args.routing_trace) if args.routing_trace else None
        prompt_length = trace.prompt_length if trace else 16
        last = (trace.length if trace else prompt_length + 128) - max(args.verify_tokens)
        if last <= prompt_length:
            raise SystemExit("the routing trace decodes fewer tokens than the longest verify")
        positions = sorted({prompt_length + round(i * (last - prompt_length) / max(1, args.positions - 1))
                            for i in range(args.positions)})
        gen = torch.Generator().manual_seed(0)
        seq = engine.new_sequence(torch.randint(0, engine.vocab_size, (prompt_length,), generator=gen).tolist())
        if trace:
            trace.assign([seq])

        def forward(tokens: int, keep: bool = False) -> float:
            """Feed `tokens` random tokens at the sequence's position, timed; unless `keep`, the position is then as
            before (the fed positions' pages handed back, as a verify step's rejected ones are)."""
            past = seq.num_fed
            ids = torch.randint(0, engine.vocab_size, (tokens,), generator=gen).tolist()
            if trace:
                trace.routing.begin_pass(PassInfo((seq.seq_id,), (tokens,), (past,), (False,)), engine)
            t0 = time.perf_counter()
            try:
                engine.feed([seq], [ids], ["all" if tokens > 1 else "last"])
            finally:
                if trace:
                    trace.routing.end_pass()
            seconds = time.perf_counter() - t0
            if not keep:
                seq.num_fed = past
                engine.pool.shrink(seq.pages, past)
            return seconds

        arms = [1, *args.verify_tokens]
        seconds = {n: [0.0] * args.rounds for n in arms}
        forward(prompt_length, keep=True)  # the prompt
        for position in positions:
            while seq.num_fed < position:  # decode to the position (one token a step, as plain decoding)
                forward(1, keep=True)
            for n in arms:  # warm-up at this position
                forward(n)
            for r in range(args.rounds):
                for n in arms if r % 2 == 0 else arms[::-1]:
                    seconds[n][r] += forward(n)
        engine.release(seq)
        unions = {n: [u for p in positions if (u := trace.union_ratio(p, n)) is not None] if trace else []
                  for n in arms}
    per = len(positions)
    plain = [s / per * 1e3 for s in seconds[1]]
    print(f"\nexperts {expert_dtype}; {per} decode positions {positions[0]}..{positions[-1]}; ms per forward, "
          f"median (min-max) of {args.rounds} rounds")
    print("| tokens in the forward | ms per forward | vs plain step | routed experts read, over one token's |")
    print("|---|---|---|---|")
    for n in arms:
        ms = [s / per * 1e3 for s in seconds[n]]
        ratios = [a / b for a, b in zip(ms, plain, strict=True)]
        union = f"{statistics.mean(unions[n]):.2f}x" if unions[n] else "-"
        print(f"| {n}{' (plain step)' if n == 1 else ''} | {spread(ms)} | {spread(ratios)}x | {union} |",
              flush=True)


def acceptance_table(args, expert_dtype: str) -> None:
    """Decode tokens/s per arm: plain, and forced acceptance rates with adaptive (and fixed) draft lengths."""
    with LLM(args.model, progress=False, max_running=args.batch, dtype=DTYPES.get(args.dtype),
             cpu=CPUConfig(expert_dtype=None if expert_dtype == "bf16" else expert_dtype),
             speculative=SpeculativeConfig()) as llm:
        engine = llm.engine
        engine.drafter = None
        trace = ReplayedTrace(llm, args.routing_trace) if args.routing_trace else None
        on_add = trace.assign if trace else None
        prompt_length = trace.prompt_length if trace else 16
        if trace and prompt_length + args.tokens > trace.length:
            print(f"the trace routes {trace.length} positions: the last {prompt_length + args.tokens - trace.length}"
                  " of each reply route as the model does", flush=True)
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, engine.vocab_size, (prompt_length,), generator=gen).tolist()
                   for _ in range(args.prompts)]
        _, _, reference = decode(llm, prompts, args.tokens, args.batch, on_add)  # what the drafter knows
        continuations = {tuple(p): out for p, out in zip(prompts, reference, strict=True)}
        base_cost = step_cost_of(llm.hybrid)
        arms = {"plain": None}
        for p in args.acceptance:
            arms[f"p={p:g} adaptive"] = (p, True)
            if args.fixed:
                arms[f"p={p:g} k={args.draft_tokens}"] = (p, False)
        costs = {name: MeasuredStepCost(base_cost) for name in arms}  # one per arm, learning across rounds
        speed = {name: [] for name in arms}
        counts = {name: [0, 0] for name in arms}
        for r in range(args.rounds + 1):  # round 0 warms up (and the cost models learn) and checks the tokens
            for name in list(arms) if r % 2 == 0 else list(arms)[::-1]:
                engine.drafter = drafter = None if arms[name] is None else ForcedAcceptanceDrafter(
                    SpeculativeConfig(num_draft_tokens=args.draft_tokens, adaptive=arms[name][1]), costs[name],
                    engine.max_context, continuations, arms[name][0], engine.vocab_size, seed=r)
                seconds, counted, out = decode(llm, prompts, args.tokens, args.batch, on_add)
                check_against_plain(name, out, reference, llm.hybrid.model.dtype)
                if r:
                    speed[name].append(counted / seconds)
                    if drafter is not None:
                        counts[name][0] += drafter.drafted_tokens
                        counts[name][1] += drafter.accepted_tokens
            engine.drafter = None
            if r:
                print(f"round {r}/{args.rounds}: " + ", ".join(f"{n} {v[-1]:.2f}" for n, v in speed.items())
                      + " tok/s", flush=True)
    plain = speed["plain"]
    print(f"\nexperts {expert_dtype}; {args.prompts} prompts of {prompt_length} tokens, {args.tokens} tokens each, "
          f"{args.batch} together; drafts of up to {args.draft_tokens}")
    print("| arm | decode tok/s, median (min-max) | vs plain, median (min-max) | acceptance measured |")
    print("|---|---|---|---|")
    for name, values in speed.items():
        drafted, accepted = counts[name]
        ratios = [a / b for a, b in zip(values, plain, strict=True)]
        measured = f"{accepted / drafted:.2f} ({accepted}/{drafted})" if drafted else "- (no drafts)"
        print(f"| {name} | {spread(values)} | {spread(ratios)}x | {measured if arms[name] else '-'} |", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", choices=("verify", "acceptance"), required=True)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the bundled demo model)")
    parser.add_argument("--routing-trace", default=None, help="a decode trace whose routing the MoE layers replay "
                        "(any layout `tiermoe trace convert` reads; its top-k must be the model's)")
    parser.add_argument("--expert-dtypes", default="bf16", help=f"CPU-tier expert formats, comma-separated "
                        f"({', '.join(EXPERT_DTYPES)}); bf16: the checkpoint's own")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="weights' dtype (default: the model's)")
    parser.add_argument("--verify-tokens", default="2,3,4,5", help="verify: tokens per forward (2-17), comma-separated")
    parser.add_argument("--positions", type=int, default=8, help="verify: decode positions measured (1-64)")
    parser.add_argument("--acceptance", default="0,0.5,0.7,0.9", help="acceptance: forced rates 0-1, comma-separated")
    parser.add_argument("--draft-tokens", type=int, default=4, help=f"acceptance: most drafted (1-{MAX_DRAFT_TOKENS})")
    parser.add_argument("--fixed", action="store_true", help="acceptance: also a fixed-length arm per rate")
    parser.add_argument("--prompts", type=int, default=2, help="acceptance: prompts (1-64)")
    parser.add_argument("--tokens", type=int, default=32, help="acceptance: tokens each reply decodes (2-1024)")
    parser.add_argument("--batch", type=int, default=1, help="acceptance: sequences decoding together (1-64)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (1-50; >= 5 for a spread)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    try:
        args.verify_tokens = sorted({int(x) for x in args.verify_tokens.split(",") if x.strip()})
        args.acceptance = [float(x) for x in args.acceptance.split(",") if x.strip()]
    except ValueError:
        parser.error("--verify-tokens takes comma-separated integers, --acceptance comma-separated numbers")
    dtypes = [x.strip() for x in args.expert_dtypes.split(",") if x.strip()]
    if not dtypes or any(d not in EXPERT_DTYPES for d in dtypes):
        parser.error(f"--expert-dtypes takes some of {', '.join(EXPERT_DTYPES)}, got {args.expert_dtypes!r}")
    if not args.verify_tokens or not all(2 <= n <= MAX_DRAFT_TOKENS + 1 for n in args.verify_tokens):
        parser.error(f"--verify-tokens values must be 2-{MAX_DRAFT_TOKENS + 1}")
    if not args.acceptance or not all(0 <= p <= 1 for p in args.acceptance):
        parser.error("--acceptance values must be from 0 to 1")
    if not (1 <= args.positions <= 64 and 1 <= args.draft_tokens <= MAX_DRAFT_TOKENS and 1 <= args.prompts <= 64
            and 2 <= args.tokens <= 1024 and 1 <= args.batch <= 64 and 1 <= args.rounds <= 50):
        parser.error(f"--positions 1-64, --draft-tokens 1-{MAX_DRAFT_TOKENS}, --prompts 1-64, --tokens 2-1024, "
                     "--batch 1-64, --rounds 1-50")
    if args.threads:
        torch.set_num_threads(min(args.threads, os.cpu_count() or 1))
    print_load_average("before")
    print(f"torch threads {torch.get_num_threads()}", flush=True)
    try:
        for expert_dtype in dtypes:
            (verify_table if args.table == "verify" else acceptance_table)(args, expert_dtype)
    except TiermoeError as err:
        raise SystemExit(f"error: {err}") from None
    print_load_average("after")


if __name__ == "__main__":
    main()
