"""llama.cpp's prompt-lookup speculative decoding for bench_speculative.py: llama-cpp-python's `Llama.generate`,
greedy (temp 0, top_k 1, no repeat penalty), plain or with `LlamaPromptLookupDecoding(num_pred_tokens=N)` as its
draft model, one sequence at a time. Run inside an e2e/worker.py process (or in the benchmark's own).

Speculation is llama-cpp-python's own loop: after each sampled token the draft model proposes up to N tokens
found after an earlier match of the last 1-2 tokens (its default max_ngram_size 2); one eval verifies them and
the sampler walks the verified rows until a draft token differs, whose K/V is then removed. A Llama made with a
draft model keeps every position's logits (logits_all, a copy of each eval's rows into its scores array): that is
how it is driven, so it is timed too. Plain decode is the same generate loop without a draft model, and also
(`eval_loop`) llama-cpp-python's low-level eval with an argmax of the logits, no sampler chain and no generator
(e2e/llama_side.py, as bench_e2e_cpu.py times llama.cpp): llama.cpp's plain decode at its fastest from Python.

Acceptance is counted by wrapping the draft model: each draft, at the position it was made for, against the
tokens the reply has there; draft tokens past the reply's last token (verified, but nothing says whether they
would have been kept) count neither as drafted nor as accepted.
"""

from __future__ import annotations

import os
import time
from typing import Any

import llama_cpp
import numpy as np
from llama_cpp.llama_speculative import LlamaDraftModel, LlamaPromptLookupDecoding

from e2e.llama_side import LlamaSide


class CountingDraft(LlamaDraftModel):
    """A draft model that keeps what it proposed: (tokens known when asked, the draft)."""

    def __init__(self, inner: LlamaDraftModel):
        self.inner = inner
        self.drafts: list[tuple[int, list[int]]] = []

    def __call__(self, input_ids: np.ndarray, /, **kwargs: Any) -> np.ndarray:
        draft = self.inner(input_ids, **kwargs)
        self.drafts.append((len(input_ids), draft.tolist()))
        return draft


def judged(drafts: list[tuple[int, list[int]]], sequence: list[int]) -> tuple[int, int]:
    """(drafted, accepted) of `drafts` against `sequence` (prompt and reply): each draft's tokens within the
    sequence, and of them the leading run that equals it (the sampler stops at the first that differs)."""
    drafted = accepted = 0
    for at, draft in drafts:
        inside = draft[:max(0, len(sequence) - at)]
        drafted += len(inside)
        run = 0
        while run < len(inside) and inside[run] == sequence[at + run]:
            run += 1
        accepted += run
    return drafted, accepted


class LlamaLookupSide:
    """One Llama per arm: `lookups` maps an arm's name to its num_pred_tokens (None: plain decode); `eval_loop`
    names the arm of plain decode by the low-level eval loop (None: no such arm)."""

    def __init__(self, path: str, threads: int, context: int, lookups: dict[str, int | None],
                 eval_loop: str | None = None, cpus: list[int] | None = None):
        """`cpus`: the CPUs llama.cpp's threads may use (None: this process's). A process started by one that ran
        tiermoe inherits the pin its kernel team puts on the calling thread (one core): llama.cpp's threads
        would share that core."""
        if cpus:
            os.sched_setaffinity(0, cpus)
        self.eval_loop = {} if eval_loop is None else {eval_loop: LlamaSide(path, threads, context)}
        self.drafts = {name: None if n is None else CountingDraft(LlamaPromptLookupDecoding(num_pred_tokens=n))
                       for name, n in lookups.items()}
        self.models = {name: llama_cpp.Llama(path, n_ctx=context, n_threads=threads, n_threads_batch=threads,
                                             draft_model=draft, verbose=False)
                       for name, draft in self.drafts.items()}
        meta = next(iter(self.models.values())).metadata
        self.layers = int(meta[f"{meta['general.architecture']}.block_count"])

    def decode(self, arm: str, prompts: list[list[int]], tokens: int) -> dict:
        """Each prompt's reply of `tokens` tokens by `arm`: decode seconds (from the first token to the last),
        decode tokens (all but the first), the replies, and the drafted / accepted tokens."""
        if arm in self.eval_loop:
            timed = [self.eval_loop[arm].greedy(prompt, tokens) for prompt in prompts]
            return {"seconds": sum(s for s, _ in timed), "counted": len(prompts) * (tokens - 1),
                    "out": [reply for _, reply in timed], "drafted": 0, "accepted": 0}
        model, draft = self.models[arm], self.drafts[arm]
        seconds, counted, out, drafted, accepted = 0.0, 0, [], 0, 0
        for prompt in prompts:
            model.reset()  # a full prefill each time, no prefix reuse from the previous prompt (it is not timed)
            if draft is not None:
                draft.drafts.clear()
            reply, start = [], 0.0
            for token in model.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0):
                reply.append(int(token))
                if len(reply) == 1:
                    start = time.perf_counter()
                if len(reply) == tokens:
                    break
            seconds += time.perf_counter() - start
            counted += len(reply) - 1
            out.append(reply)
            if draft is not None:
                d, a = judged(draft.drafts, prompt + reply)
                drafted, accepted = drafted + d, accepted + a
        return {"seconds": seconds, "counted": counted, "out": out, "drafted": drafted, "accepted": accepted}

    def close(self) -> None:
        for model in self.models.values():
            model.close()
        for side in self.eval_loop.values():
            side.close()
