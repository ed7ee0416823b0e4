"""Shared by the benchmarks that compare configurations of one model side by side: decode speed measured in
alternating rounds (so a change in the machine's load hits every configuration alike), and the load average
printed before and after (these machines are shared: a figure taken under load is said to be one)."""

from __future__ import annotations

import os
import time

from tiermoe import LLM
from tiermoe.engine.sampling import SamplingParams


def decode_speed(llms: dict[str, LLM], prompts: list[list[int]], tokens: int, rounds: int) -> dict[str, float]:
    """Best-of-`rounds` decode tokens/s per configuration (configurations alternate within each round)."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    best = dict.fromkeys(llms, 0.0)
    for llm in llms.values():
        llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    for r in range(rounds):
        for label, llm in llms.items():
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            best[label] = max(best[label], sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0))
        print(f"  round {r + 1}/{rounds}: " + ", ".join(f"{k} {v:.1f}" for k, v in best.items()) + " tok/s",
              flush=True)
    return best


def print_load_average(when: str) -> None:
    load = os.getloadavg()
    print(f"load average {when}: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs", flush=True)


def generation_seconds(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, list]:
    """Mean seconds of a decode step of `prompts` (token ids) decoded together, the prefill step left out, and each
    sequence's output ids."""
    engine = llm.engine
    seqs = [engine.add(p, sp) for p, sp in zip(prompts, params)]
    engine.step()  # the prefill
    first = time.perf_counter()
    while engine.has_work():
        engine.step()
    assert all(s.finish_reason == "length" for s in seqs), [s.error for s in seqs]
    step = (time.perf_counter() - first) / max(1, max(len(s.output_ids) for s in seqs) - 1)
    return step, [s.output_ids for s in seqs]
