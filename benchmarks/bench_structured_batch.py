"""Do unconstrained sequences keep their speed beside structured-output ones? (goal: within 10%)

The bundled demo model (or --model DIR) decodes --batch sequences together, greedy, --tokens tokens each, in two arms run
alternately (the order rotating each round) for --rounds rounds:
- plain: every sequence unconstrained;
- mixed: half of them held to a grammar, the other half unconstrained. The grammar (a regex that admits any text)
  allows every token the model picks, so each sequence decodes the very tokens it decodes in the plain arm
  (checked): the batch, its routing and so its forward passes are the same, and the difference is the grammar's
  work on the engine thread (a full mask per constrained row and step, its token accepted). A grammar that changed
  the tokens would change which experts the step reads, which is not the grammar's cost. The figure is the
decode steps' mean time (the whole generation less its first step, the prefill), the median of the rounds and
their spread (min-max); the ratio mixed / plain is what an unconstrained sequence's time per token pays.

    python benchmarks/bench_structured_batch.py
    python benchmarks/bench_structured_batch.py --batch 16 --tokens 96 --rounds 7 --threads 2
    tiermoe make-model --arch qwen3_moe --preset qwen3-30b-a3b --layers 2 --out q30b-2l
    python benchmarks/bench_structured_batch.py --model q30b-2l --tokens 32   # real vocabulary, bigger steps
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
from support.decode_rounds import generation_seconds

from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import Grammar, SamplingParams


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8, help="sequences decoding together (half constrained)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens each sequence decodes")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (>= 5 for a spread)")
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the bundled demo model)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.batch < 2 or args.tokens < 2 or args.rounds < 1:
        parser.error("--batch and --tokens must be >= 2, --rounds >= 1")
    if args.threads:
        torch.set_num_threads(min(args.threads, os.cpu_count() or 1))
    texts = [f"Tell me about the city number {i}." for i in range(args.batch)]
    plain = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    held = SamplingParams(max_tokens=args.tokens, ignore_eos=True, grammar=Grammar("regex", r"[\s\S]*"))
    arms = {"plain": [plain] * args.batch, "mixed": [held if i % 2 else plain for i in range(args.batch)]}
    print(f"load average {os.getloadavg()[0]:.2f}; torch threads {torch.get_num_threads()}", flush=True)
    with LLM(args.model, progress=False) as llm:
        prompts = [llm.encode(text) for text in texts]
        llm.compile_grammar(held.grammar)  # the tokenizer's description is built once, outside the timing
        _, tokens = generation_seconds(llm, prompts, arms["plain"])  # warm-up
        if generation_seconds(llm, prompts, arms["mixed"])[1] != tokens:
            raise SystemExit("the grammar changed a sequence's tokens: the arms would not run the same passes")
        times = {name: [] for name in arms}
        for r in range(args.rounds):
            for name in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
                step, _ = generation_seconds(llm, prompts, arms[name])
                times[name].append(step)
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {t[-1] * 1e3:.2f} ms" for n, t in times.items()),
                  flush=True)
    med = {n: statistics.median(t) for n, t in times.items()}
    print(f"\n| arm ({args.batch} sequences, {args.tokens} tokens) | decode step, median (ms) | min - max (ms) |")
    print("|---|---|---|")
    for name, t in times.items():
        print(f"| {name} | {med[name] * 1e3:.2f} | {min(t) * 1e3:.2f} - {max(t) * 1e3:.2f} |")
    ratio = med["mixed"] / med["plain"]
    print(f"\nmixed / plain: {ratio:.3f} (goal <= 1.10: {'met' if ratio <= 1.10 else 'NOT met'})")


if __name__ == "__main__":
    main()
