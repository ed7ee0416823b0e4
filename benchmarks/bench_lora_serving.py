"""Adapters served per request: 8 sequences over 3 LoRA adapters batched together, against 8 with none (goal: >= 0.8x
the throughput).

The bundled demo model (or --model DIR) serves 3 adapters per request (tiermoe.model.served_adapters), each with LoRA
on attention, the routers and every routed expert (PEFT's "all-linear" on transformers 5; rank --rank), unmerged.
Two arms decode --batch sequences together, greedy, --tokens tokens each, run alternately (the order rotating each
round) for --rounds rounds:
- none: every sequence without an adapter (the server's base model, adapters loaded beside it);
- adapters: sequence i with adapter i mod 3, all in the same steps.
The figure is the decode steps' mean time (the whole generation less its first step, the prefill): the median of the
rounds and their spread (min-max), and tokens/s = batch / step; the throughput ratio is given from the medians and
round by round (each round's two arms ran back to back, so a load that changes between rounds cancels out). The adapters change the tokens, and so which experts
each step reads: that is part of what serving adapters costs.

Before timing, an fp32 check (the model loaded in fp32): each sequence's greedy tokens batched equal its tokens
alone and its tokens with its adapter merged into the weights (`--lora DIR`). Adapters come from --adapters DIR DIR
DIR (e.g. three runs of `tiermoe finetune`), else three random ones are made with PEFT (its [train] extra), their
factors all non-zero.

    python benchmarks/bench_lora_serving.py
    python benchmarks/bench_lora_serving.py --rounds 7 --tokens 96
    python benchmarks/bench_lora_serving.py --adapters runs/a runs/b runs/c
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

import torch
from support.decode_rounds import generation_seconds

from tiermoe.bundled import resolve_model
from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import SamplingParams
from tiermoe.training.adapter_merge import merged_lora

NAMES = ("a", "b", "c")


def random_adapters(model_dir: Path, out: Path, rank: int) -> list[Path]:
    """Three PEFT adapters of `model_dir` with random factors (none zero), saved as PEFT saves them."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    dirs = []
    for seed, name in enumerate(NAMES, start=1):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        torch.manual_seed(seed)
        config = LoraConfig(r=rank, lora_alpha=rank, target_modules="all-linear", init_lora_weights=False)
        get_peft_model(model, config).save_pretrained(out / name)
        dirs.append(out / name)
    return dirs


def serving(model, adapters: list[Path], **kwargs) -> LLM:
    llm = LLM(model, progress=False, **kwargs)
    served = llm.engine.serve_adapters()
    for name, path in zip(NAMES, adapters):
        served.load(name, merged_lora(path, llm.model_dir), str(path))
    return llm


def check_fp32(model, adapters: list[Path], prompts: list[list[int]], tokens: int) -> None:
    """Batched == alone == merged, each sequence's greedy tokens in fp32; SystemExit naming the first that differs."""
    which = [NAMES[i % len(NAMES)] for i in range(len(prompts))]
    params = [SamplingParams(max_tokens=tokens, ignore_eos=True, adapter=name) for name in which]
    with serving(model, adapters, dtype=torch.float32, max_running=len(prompts)) as llm:
        together = [out.token_ids for out in llm.generate(prompts, params)]
        alone = [llm.generate([p], [sp])[0].token_ids for p, sp in zip(prompts, params)]
    merged = {}
    for name, path in zip(NAMES, adapters):
        with LLM(model, progress=False, dtype=torch.float32, lora=merged_lora(path, resolve_model(model))) as llm:
            rows = [i for i, w in enumerate(which) if w == name]
            got = llm.generate([prompts[i] for i in rows], SamplingParams(max_tokens=tokens, ignore_eos=True))
            merged.update({i: out.token_ids for i, out in zip(rows, got)})
    for i in range(len(prompts)):
        if not together[i] == alone[i] == merged[i]:
            raise SystemExit(f"sequence {i} (adapter {which[i]}): batched {together[i]}, alone {alone[i]}, merged "
                             f"{merged[i]}")
    print(f"fp32 check: each of {len(prompts)} sequences over {len(NAMES)} adapters gives, batched, its {tokens} "
          "greedy tokens alone and with its adapter merged", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8, help="sequences decoding together")
    parser.add_argument("--tokens", type=int, default=64, help="tokens each sequence decodes")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (>= 5 for a spread)")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank of the random adapters (default 8)")
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the bundled demo model)")
    parser.add_argument("--adapters", nargs=3, metavar="DIR", default=None, help="three PEFT adapter directories "
                        "(default: three random ones, made with PEFT)")
    parser.add_argument("--check-tokens", type=int, default=16, help="tokens per sequence of the fp32 check")
    args = parser.parse_args(argv)
    if args.batch < 2 or args.tokens < 2 or args.rounds < 1 or args.rank < 1:
        parser.error("--batch and --tokens must be >= 2, --rounds and --rank >= 1")
    model_dir = resolve_model(args.model)
    prompts = [[1, *(5 + 7 * i + j for j in range(8))] for i in range(args.batch)]
    print(f"load average {os.getloadavg()[0]:.2f}; torch threads {torch.get_num_threads()}", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        adapters = [Path(a) for a in args.adapters] if args.adapters else random_adapters(model_dir, Path(scratch),
                                                                                          args.rank)
        check_fp32(model_dir, adapters, prompts, args.check_tokens)
        arms = {"none": [SamplingParams(max_tokens=args.tokens, ignore_eos=True)] * args.batch,
                "adapters": [SamplingParams(max_tokens=args.tokens, ignore_eos=True, adapter=NAMES[i % len(NAMES)])
                             for i in range(args.batch)]}
        with serving(model_dir, adapters, max_running=args.batch) as llm:
            for params in arms.values():  # warm-up
                generation_seconds(llm, prompts, params)
            times = {name: [] for name in arms}
            for r in range(args.rounds):
                for name in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
                    times[name].append(generation_seconds(llm, prompts, arms[name])[0])
                print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {t[-1] * 1e3:.2f} ms"
                                                                   for n, t in times.items()), flush=True)
    med = {n: statistics.median(t) for n, t in times.items()}
    print(f"\nload average {os.getloadavg()[0]:.2f} after the rounds")
    print(f"\n| arm ({args.batch} sequences, {args.tokens} tokens) | decode step, median (ms) | min - max (ms) | "
          "tokens/s (median) |")
    print("|---|---|---|---|")
    for name, t in times.items():
        print(f"| {name} | {med[name] * 1e3:.2f} | {min(t) * 1e3:.2f} - {max(t) * 1e3:.2f} | "
              f"{args.batch / med[name]:.0f} |")
    ratio = med["none"] / med["adapters"]
    paired = sorted(n / a for n, a in zip(times["none"], times["adapters"]))  # each round's two arms, side by side
    print(f"\nthroughput adapters / none: {ratio:.3f} (goal >= 0.80: {'met' if ratio >= 0.8 else 'NOT met'}); "
          f"round by round: median {statistics.median(paired):.3f}, {paired[0]:.3f} - {paired[-1]:.3f}")


if __name__ == "__main__":
    main()
