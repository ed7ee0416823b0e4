"""llama.cpp's side of bench_e2e_cpu.py, run inside an e2e/worker.py process: a GGUF loaded by llama-cpp-python
(memory-mapped, as llama.cpp runs by default) and timed through its low-level eval, greedy.

A token is chosen by argmax over the last position's logits, read in place (llama_get_logits_ith): tiermoe's greedy
sampling reads its logits the same way. llama-cpp-python's own sampler chain and its per-eval Python bookkeeping
stay out of the timed path, so llama.cpp is measured at its fastest.
"""

from __future__ import annotations

import time

import llama_cpp
import numpy as np
import torch
import torch.nn.functional as F

BATCH = 512  # tokens per llama_decode call: a 512-token prompt is one batch, as in tiermoe's one prefill chunk


class LlamaSide:
    def __init__(self, path: str, threads: int, context: int):
        self.path, self.threads = path, threads
        self.model = self._open(context, logits_all=False)
        meta = self.model.metadata
        self.layers = int(meta[f"{meta['general.architecture']}.block_count"])

    def _open(self, context: int, logits_all: bool) -> llama_cpp.Llama:
        return llama_cpp.Llama(self.path, n_ctx=context, n_threads=self.threads, n_threads_batch=self.threads,
                               n_batch=BATCH, n_ubatch=BATCH, logits_all=logits_all, verbose=False)

    def _next_token(self) -> int:
        logits = llama_cpp.llama_get_logits_ith(self.model.ctx, -1)
        return int(np.ctypeslib.as_array(logits, shape=(self.model.n_vocab(),)).argmax())

    def first_token_s(self, prompt: list[int]) -> float:
        self.model.reset()
        start = time.perf_counter()
        self.model.eval(prompt)
        self._next_token()
        return time.perf_counter() - start

    def decode_s_per_token(self, prompt: list[int], tokens: int) -> float:
        return self.greedy(prompt, tokens + 1)[0] / tokens

    def greedy(self, prompt: list[int], tokens: int) -> tuple[float, list[int]]:
        """The first `tokens` greedy tokens after `prompt`, and the seconds from the first to the last."""
        self.model.reset()
        self.model.eval(prompt)
        out = [self._next_token()]
        start = time.perf_counter()
        while len(out) < tokens:
            self.model.eval(out[-1:])
            out.append(self._next_token())
        return time.perf_counter() - start, out

    def loss(self, rows: list[list[int]]) -> float:
        """Mean next-token cross-entropy (nats), teacher-forced: a second context that keeps every position's
        logits (logits_all), opened for this only (it would slow the timed prefill down)."""
        scorer = self._open(max(len(r) for r in rows) + 8, logits_all=True)
        total, count = 0.0, 0
        try:
            for row in rows:
                scorer.reset()
                scorer.eval(row)
                logits = torch.from_numpy(np.array(scorer.scores[:len(row) - 1], dtype=np.float32))
                total += F.cross_entropy(logits, torch.tensor(row[1:]), reduction="sum").item()
                count += len(row) - 1
        finally:
            scorer.close()
        return total / count

    def close(self) -> None:
        self.model.close()
