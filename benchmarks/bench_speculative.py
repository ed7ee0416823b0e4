"""Does n-gram speculative decoding speed up copy-heavy replies? Acceptance and decode tokens/s against plain decode.

The bundled demo model (or --model DIR) answers copy-heavy prompts (rewrite, summarise, quote or continue a given
passage: the reply repeats spans of the prompt, where prompt lookup finds its drafts), greedy, --tokens tokens each,
one sequence at a time (--batch N: N together), in alternating arms (the order rotating each round) for --rounds
rounds:
- plain: no speculation;
- ngram kN: n-gram drafts of up to N tokens verified every step (each --draft-tokens value);
- ngram adaptive: up to the largest N, each step's length chosen by the engine's cost model (0 where it does not
  pay).
Greedy speculation gives the plain arm's tokens: the benchmark checks it (--dtype fp32: any difference is an error;
in bf16 two logits can tie exactly, and a verify step's rows, computed as one segment, may then pick the other one,
as a sequence decoded alone and in a batch may: the arms' prompts that differ are counted and shown).
Figures: decode tokens/s (tokens after the first, over the time after the prefill step), the median of the rounds
and their spread (min-max); the acceptance (drafted tokens accepted) and the tokens each sequence's step yields.

    python benchmarks/bench_speculative.py
    python benchmarks/bench_speculative.py --tokens 96 --rounds 7 --draft-tokens 2,4,8 --threads 2
    python benchmarks/bench_speculative.py --batch 8          # 8 sequences together: does drafting still pay?
    python benchmarks/bench_speculative.py --model /models/Qwen3-30B-A3B --tokens 64
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
from support.speculative_arms import check_against_plain, decode

from tiermoe.engine.llm import LLM
from tiermoe.engine.speculative_config import MAX_DRAFT_TOKENS, SpeculativeConfig
from tiermoe.engine.speculative_drafting import Drafter, step_cost_of
from tiermoe.engine.speculative_timing import MeasuredStepCost

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PASSAGES = [
    "The river rises in the hills north of the town and runs south through farmland for forty miles before it "
    "reaches the sea. In spring the water is high and fast, and the old stone bridge near the mill is closed.",
    "To reset the router, hold the small button on the back for ten seconds until the light turns orange, then "
    "wait two minutes. The router restarts with its factory settings, and the network name is printed below.",
    "Our meeting moved to Thursday at three in the afternoon. Please bring the budget sheet, the list of open "
    "issues, and your notes from the customer visit, so that we can agree on the plan for the next quarter.",
    "def mean(values):\n    total = 0\n    for value in values:\n        total += value\n    return total / "
    "len(values)\n\ndef variance(values):\n    m = mean(values)\n    return mean([(v - m) ** 2 for v in values])",
]
TASKS = ["Rewrite the following text in your own words:\n\n{}", "Summarise the following text:\n\n{}",
         "Repeat the following text exactly:\n\n{}", "Fix any mistakes in this text and return it:\n\n{}"]


def prompts_of(llm: LLM, count: int) -> list[list[int]]:
    """`count` copy-heavy prompts as token ids (through the chat template when the tokenizer has one)."""
    texts = [TASKS[i % len(TASKS)].format(PASSAGES[(i // len(TASKS) + i) % len(PASSAGES)]) for i in range(count)]
    if llm.tokenizer is not None and getattr(llm.tokenizer, "chat_template", None):
        return [llm.chat_prompt_ids([{"role": "user", "content": t}]) for t in texts]
    return [llm.encode(t) for t in texts]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the bundled demo model)")
    parser.add_argument("--prompts", type=int, default=8, help="copy-heavy prompts (1-64)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens each reply decodes (2-1024)")
    parser.add_argument("--batch", type=int, default=1, help="sequences decoding together (1-64)")
    parser.add_argument("--draft-tokens", default="4", help="comma-separated fixed draft lengths N (1-16), e.g. 2,4,8")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (1-50; >= 5 for a spread)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="weights' dtype (default: the model's)")
    args = parser.parse_args(argv)
    try:
        lengths = sorted({int(x) for x in args.draft_tokens.split(",") if x.strip()})
    except ValueError:
        parser.error(f"--draft-tokens must be comma-separated integers, got {args.draft_tokens!r}")
    if not lengths or not all(1 <= n <= MAX_DRAFT_TOKENS for n in lengths):
        parser.error(f"--draft-tokens values must be 1-{MAX_DRAFT_TOKENS}")
    if not (1 <= args.prompts <= 64 and 2 <= args.tokens <= 1024 and 1 <= args.batch <= 64
            and 1 <= args.rounds <= 50):
        parser.error("--prompts 1-64, --tokens 2-1024, --batch 1-64, --rounds 1-50")
    if args.threads:
        torch.set_num_threads(min(args.threads, os.cpu_count() or 1))
    print(f"load average {os.getloadavg()[0]:.2f}; torch threads {torch.get_num_threads()}", flush=True)
    dtype = DTYPES[args.dtype] if args.dtype else None
    with LLM(args.model, progress=False, max_running=args.batch, dtype=dtype) as llm:
        cost = step_cost_of(llm.hybrid)
        configs = {"plain": None, **{f"ngram k{n}": SpeculativeConfig(num_draft_tokens=n, adaptive=False)
                                     for n in lengths},
                   "ngram adaptive": SpeculativeConfig(num_draft_tokens=max(lengths), adaptive=True)}
        prompts = prompts_of(llm, args.prompts)
        print(f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens; "
              f"routed experts' share of a step (cost model): {cost.expert_share:.2f}", flush=True)
        # one cost model per arm for the whole run, as an engine keeps its own across requests (it learns from the
        # steps it times, warm-up round included)
        costs = {name: MeasuredStepCost(cost) for name in configs}
        drafters, speed, reference = {}, {name: [] for name in configs}, None
        for r in range(args.rounds + 1):  # round 0 warms up and checks the tokens
            names = list(configs) if r % 2 == 0 else list(configs)[::-1]
            for name in names:
                config = configs[name]
                drafter = None if config is None else Drafter(config, costs[name], llm.engine.max_context)
                llm.engine.drafter = drafter
                seconds, counted, out = decode(llm, prompts, args.tokens, args.batch)
                if r == 0:
                    reference = reference or out
                    check_against_plain(name, out, reference, llm.hybrid.model.dtype)
                    continue
                speed[name].append(counted / seconds)
                if drafter is not None:
                    drafters[name] = drafters.get(name, []) + [(drafter.drafted_tokens, drafter.accepted_tokens)]
            if r:
                print(f"round {r}/{args.rounds}: " + ", ".join(f"{n} {v[-1]:.1f}" for n, v in speed.items())
                      + " tok/s", flush=True)
    base = statistics.median(speed["plain"])
    print(f"\n| arm ({args.prompts} prompts, {args.tokens} tokens, batch {args.batch}) | decode tok/s, median "
          f"| min - max | vs plain | acceptance | tokens per sequence-step |")
    print("|---|---|---|---|---|---|")
    for name, values in speed.items():
        med = statistics.median(values)
        drafted = sum(d for d, _ in drafters.get(name, []))
        accepted = sum(a for _, a in drafters.get(name, []))
        acceptance = f"{accepted / drafted:.2f} ({accepted}/{drafted})" if drafted else "-"
        print(f"| {name} | {med:.1f} | {min(values):.1f} - {max(values):.1f} | {med / base:.2f}x | {acceptance} | "
              f"{_tokens_per_step(args, drafted, accepted):.2f} |")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


def _tokens_per_step(args, drafted: int, accepted: int) -> float:
    """Decode tokens per sequence and step: 1 without drafts; each accepted draft adds one to a step's yield."""
    decoded = args.rounds * args.prompts * (args.tokens - 1)
    return decoded / max(1, decoded - accepted)


if __name__ == "__main__":
    main()
