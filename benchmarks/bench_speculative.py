"""Does n-gram speculative decoding speed up copy-heavy replies? Acceptance and decode tokens/s against plain decode
and against llama.cpp's prompt-lookup speculative decoding on the same model.

The bundled demo model (or --model DIR) answers copy-heavy prompts (rewrite, summarise, quote or continue a given
passage: the reply repeats spans of the prompt, where prompt lookup finds its drafts), greedy, --tokens tokens each,
one sequence at a time (--batch N: N together), in arms taken in turn (the order rotating each round) for --rounds
rounds:
- tiermoe plain: no speculation;
- tiermoe ngram kN: n-gram drafts of up to N tokens verified every step (each --draft-tokens value);
- tiermoe ngram adaptive: up to the largest N, each step's length chosen by the engine's cost model (0 where it
  does not pay);
- llama.cpp plain: llama-cpp-python's Llama.generate, greedy; llama.cpp plain, eval loop: its low-level eval and an
  argmax (no sampler chain: llama.cpp's plain decode at its fastest from Python);
- llama.cpp prompt-lookup N: Llama.generate with LlamaPromptLookupDecoding(num_pred_tokens=N) as its draft model,
  for each --draft-tokens value and its default 10.
llama.cpp runs the same prompts' token ids on a bf16 GGUF of the same checkpoint (llama.cpp's own converter, made
once and cached: benchmarks/e2e/llama_cpp.py), at the same thread count, in a process of its own
(support/speculative_llama.py says why); with --batch > 1, --no-llama-cpp, or llama-cpp-python not installed, its
arms are left out (the last said in one line) and the rest runs.
Greedy speculation gives the plain arm's tokens: the benchmark checks it (--dtype fp32: any difference is an error;
in bf16 two logits can tie exactly, and a verify step's rows, computed as one segment, may then pick the other one,
as a sequence decoded alone and in a batch may: the arms' prompts that differ are counted and shown). It also
counts llama.cpp's prompt-lookup replies equal to its plain ones, and llama.cpp's plain replies equal to tiermoe's
(the two round bf16 differently).
Figures: decode tokens/s (tokens after the first, over the time after the first token), the median of the rounds
and their spread (min-max); the acceptance (drafted tokens accepted; llama.cpp's counted from the drafts its draft
model made against the reply) and the tokens each sequence's step yields; then tiermoe's best arm against llama.cpp's
best, and the goal (>= 1.2x).

    python benchmarks/bench_speculative.py
    python benchmarks/bench_speculative.py --tokens 96 --rounds 7 --draft-tokens 2,4,8 --threads 2
    python benchmarks/bench_speculative.py --no-llama-cpp     # tiermoe's arms only
    python benchmarks/bench_speculative.py --batch 8          # 8 sequences together: does drafting still pay?
    python benchmarks/bench_speculative.py --model /models/Qwen3-30B-A3B --tokens 64
"""

from __future__ import annotations

import argparse
import os
import statistics
from functools import partial
from pathlib import Path

import torch
from e2e import llama_cpp
from support.speculative_arms import check_against_plain, decode
from support.speculative_llama import DEFAULT_LOOKUP, LlamaArms, same_replies
from support.speculative_llama import PLAIN as LLAMA_PLAIN

from tiermoe.engine.llm import LLM
from tiermoe.engine.speculative_config import MAX_DRAFT_TOKENS, SpeculativeConfig
from tiermoe.engine.speculative_drafting import Drafter, step_cost_of
from tiermoe.engine.speculative_timing import MeasuredStepCost

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TIERMOE_SIDE, LLAMA_SIDE, TIERMOE_PLAIN = "tiermoe", "llama.cpp", "tiermoe plain"
GOAL = 1.2  # tiermoe's best arm against llama.cpp's best (issue 63)
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


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[int]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the bundled demo model)")
    parser.add_argument("--prompts", type=int, default=8, help="copy-heavy prompts (1-64)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens each reply decodes (2-1024)")
    parser.add_argument("--batch", type=int, default=1, help="sequences decoding together (1-64; llama.cpp's arms "
                        "run with 1 only)")
    parser.add_argument("--draft-tokens", default="4", help="comma-separated fixed draft lengths N (1-16), e.g. 2,4,8")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (1-50; >= 5 for a spread)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads, and llama.cpp's (default: torch's)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="weights' dtype (default: the model's)")
    parser.add_argument("--no-llama-cpp", action="store_true", help="leave llama.cpp's arms out")
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
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    return args, lengths


def run_tiermoe(llm: LLM, config: SpeculativeConfig | None, cost: MeasuredStepCost, prompts: list[list[int]],
                tokens: int, batch: int) -> dict:
    """One round of a tiermoe arm: {seconds, counted, out, drafted, accepted} (as LlamaArms.decode gives)."""
    drafter = None if config is None else Drafter(config, cost, llm.engine.max_context)
    llm.engine.drafter = drafter
    seconds, counted, out = decode(llm, prompts, tokens, batch)
    return {"seconds": seconds, "counted": counted, "out": out,
            "drafted": drafter.drafted_tokens if drafter else 0, "accepted": drafter.accepted_tokens if drafter else 0}


def open_llama(args, model_dir: Path, lengths: list[int], prompts: list[list[int]], threads: int,
               cpus: list[int]) -> LlamaArms | None:
    """llama.cpp's arms, or None (and why, one line) where they do not run."""
    if args.no_llama_cpp:
        return None
    if not llama_cpp.llama_cpp_installed():
        print(llama_cpp.missing_message(), flush=True)
        return None
    if args.batch != 1:
        print("llama.cpp arms skipped: they decode one sequence at a time (--batch 1)", flush=True)
        return None
    context = max(map(len, prompts)) + args.tokens + max(*lengths, DEFAULT_LOOKUP) + 1
    return LlamaArms(model_dir, lengths, threads, context, cpus)


def side_of(name: str) -> str:
    return LLAMA_SIDE if name.startswith(LLAMA_SIDE) else TIERMOE_SIDE


def check_replies(outs: dict[str, list[list[int]]], dtype: torch.dtype) -> list[str]:
    """The warm-up round's replies: tiermoe's arms against its plain arm (exact in fp32, see check_against_plain);
    llama.cpp's prompt-lookup arms against its plain arm, and llama.cpp's plain replies against tiermoe's (other
    kernels, other bf16 rounding: counted, not required). Returns the lines to print with the table."""
    notes = []
    for name, out in outs.items():
        if side_of(name) == TIERMOE_SIDE:
            check_against_plain(name, out, outs[TIERMOE_PLAIN], dtype)
    if LLAMA_PLAIN not in outs:
        return notes
    for name, out in outs.items():
        if side_of(name) == LLAMA_SIDE and name != LLAMA_PLAIN:
            equal, leading = same_replies(out, outs[LLAMA_PLAIN])
            notes.append(f"{name}: {equal} of {len(out)} replies equal llama.cpp plain's (mean {leading:.1f} tokens "
                         "before a difference)")
    equal, leading = same_replies(outs[LLAMA_PLAIN], outs[TIERMOE_PLAIN])
    notes.append(f"llama.cpp plain: {equal} of {len(outs[LLAMA_PLAIN])} replies equal tiermoe plain's (mean "
                 f"{leading:.1f} tokens before a difference; the two sides round bf16 differently)")
    return notes


def main(argv: list[str] | None = None) -> None:
    args, lengths = parse_args(argv)
    # the CPUs before tiermoe pins this thread (see support/speculative_llama.py); none where the OS cannot say
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if args.threads:
        torch.set_num_threads(min(args.threads, os.cpu_count() or 1))
    threads = torch.get_num_threads()
    print(f"load average {os.getloadavg()[0]:.2f}; torch threads {threads}", flush=True)
    dtype = DTYPES[args.dtype] if args.dtype else None
    llama = None
    with LLM(args.model, progress=False, max_running=args.batch, dtype=dtype) as llm:
        cost = step_cost_of(llm.hybrid)
        configs = {TIERMOE_PLAIN: None, **{f"tiermoe ngram k{n}": SpeculativeConfig(num_draft_tokens=n, adaptive=False)
                                           for n in lengths},
                   "tiermoe ngram adaptive": SpeculativeConfig(num_draft_tokens=max(lengths), adaptive=True)}
        prompts = prompts_of(llm, args.prompts)
        print(f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens; "
              f"routed experts' share of a step (cost model): {cost.expert_share:.2f}", flush=True)
        # one cost model per arm for the whole run, as an engine keeps its own across requests (it learns from the
        # steps it times, warm-up round included)
        arms = {name: partial(run_tiermoe, llm, config, MeasuredStepCost(cost), prompts, args.tokens, args.batch)
                for name, config in configs.items()}
        try:
            llama = open_llama(args, llm.model_dir, lengths, prompts, threads, cpus)
            if llama is not None:
                arms |= {name: partial(llama.decode, name, prompts, args.tokens) for name in llama.arms}
            speed, totals, notes = run_rounds(arms, args.rounds, llm.hybrid.model.dtype)
        finally:
            if llama is not None:
                llama.close()
        model_dtype = str(llm.hybrid.model.dtype).removeprefix("torch.")
    sides = [f"tiermoe in {model_dtype}"]
    if llama is not None:
        sides.append(f"llama.cpp (llama-cpp-python {llama_cpp.LLAMA_CPP_VERSION}) on a bf16 GGUF made by llama.cpp's "
                     "converter")
    print(f"\n{'; '.join(sides)}; {threads} threads" + " each" * (llama is not None))
    print_table(args, speed, totals)
    for line in notes:
        print(line)
    print(summary(speed))
    print(f"load average after: {os.getloadavg()[0]:.2f}")


def run_rounds(arms: dict[str, partial], rounds: int, dtype: torch.dtype) -> tuple[dict, dict, list[str]]:
    """Round 0 warms up and checks the replies; rounds 1.. are timed, the arms' order rotating each round.
    Returns each arm's decode tokens/s per round, its summed counts (counted, drafted, accepted), the check's lines."""
    names = list(arms)
    speed = {name: [] for name in names}
    totals = {name: {"counted": 0, "drafted": 0, "accepted": 0} for name in names}
    notes = []
    for r in range(rounds + 1):
        outs = {}
        for name in names[r % len(names):] + names[:r % len(names)]:
            done = arms[name]()
            if r == 0:
                outs[name] = done["out"]
                continue
            speed[name].append(done["counted"] / done["seconds"])
            for key in totals[name]:
                totals[name][key] += done[key]
        if r == 0:
            notes = check_replies({name: outs[name] for name in names}, dtype)
        else:
            print(f"round {r}/{rounds}: " + ", ".join(f"{n} {v[-1]:.1f}" for n, v in speed.items()) + " tok/s",
                  flush=True)
    return speed, totals, notes


def print_table(args, speed: dict[str, list[float]], totals: dict[str, dict]) -> None:
    base = {side: statistics.median(speed[plain]) for side, plain in ((TIERMOE_SIDE, TIERMOE_PLAIN),
                                                                        (LLAMA_SIDE, LLAMA_PLAIN)) if plain in speed}
    print(f"| arm ({args.prompts} prompts, {args.tokens} tokens, batch {args.batch}) | decode tok/s, median "
          f"| min - max | vs its side's plain | acceptance | tokens per sequence-step |")
    print("|---|---|---|---|---|---|")
    for name, values in speed.items():
        med, t = statistics.median(values), totals[name]
        acceptance = f"{t['accepted'] / t['drafted']:.2f} ({t['accepted']}/{t['drafted']})" if t["drafted"] else "-"
        per_step = t["counted"] / max(1, t["counted"] - t["accepted"])  # each accepted draft adds one to a step
        print(f"| {name} | {med:.1f} | {min(values):.1f} - {max(values):.1f} | {med / base[side_of(name)]:.2f}x | "
              f"{acceptance} | {per_step:.2f} |")


def summary(speed: dict[str, list[float]]) -> str:
    """tiermoe's best arm against llama.cpp's best, by median, and the issue's goal (>= 1.2x)."""
    best = {}
    for name, values in speed.items():
        side = side_of(name)
        if side not in best or statistics.median(values) > best[side][1]:
            best[side] = (name, statistics.median(values))
    if LLAMA_SIDE not in best:
        return f"tiermoe's best: {best[TIERMOE_SIDE][0]} ({best[TIERMOE_SIDE][1]:.1f} tok/s); llama.cpp did not run"
    (ours, x), (theirs, y) = best[TIERMOE_SIDE], best[LLAMA_SIDE]
    return (f"tiermoe's best / llama.cpp's best: {ours} {x:.1f} / {theirs} {y:.1f} tok/s = {x / y:.2f}x "
            f"(goal >= {GOAL:.1f}x: {'met' if x / y >= GOAL else 'not met'})")


if __name__ == "__main__":
    main()
