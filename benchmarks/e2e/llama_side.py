"""llama.cpp's side of bench_e2e_cpu.py, run inside an e2e/worker.py process: a GGUF loaded by llama-cpp-python
(memory-mapped, as llama.cpp runs by default) and timed through its low-level eval, greedy.

A token is chosen by argmax over the last position's logits, read in place (llama_get_logits_ith): tiermoe's greedy
sampling reads its logits the same way. llama-cpp-python's own sampler chain and its per-eval Python bookkeeping
stay out of the timed path, so llama.cpp is measured at its fastest.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import llama_cpp
import numpy as np
import torch
import torch.nn.functional as F

BATCH = 512  # tokens per llama_decode call: a 512-token prompt is one batch, as in tiermoe's one prefill chunk


class LlamaSide:
    def __init__(self, path: str, threads: int, context: int, repack: bool = True):
        """repack False: the same file without llama.cpp's weight repacking (bench_e2e_cpu.py falls back to it
        where the repacking path fails on a machine)."""
        self.path, self.threads, self.repack = path, threads, repack
        self.model = self._open(context, logits_all=False)
        meta = self.model.metadata
        self.layers = int(meta[f"{meta['general.architecture']}.block_count"])

    def _open(self, context: int, logits_all: bool) -> llama_cpp.Llama:
        with _repacking(self.repack):
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
        """Mean next-token cross-entropy (nats), teacher-forced."""
        total, count = 0.0, 0
        for row, log_p in zip(rows, self._log_probs(rows)):
            total += F.nll_loss(log_p, torch.tensor(row[1:]), reduction="sum").item()
            count += len(row) - 1
        return total / count

    def quality(self, rows: list[list[int]], reference: str) -> dict:
        """Teacher-forced over `rows`: the mean next-token loss (nats), the mean KL(reference || this model) per
        position and the share of positions whose most likely token is the reference's. `reference`: an .npy of
        another model's next-token log-probabilities [positions, vocab] (fp32), every row's scored positions in
        turn (what bench_non_expert_quant.py writes for its unquantised model)."""
        ref_all = torch.from_numpy(np.load(reference))
        loss = kl = 0.0
        same = count = 0
        for row, log_p in zip(rows, self._log_probs(rows)):
            ref = ref_all[count:count + len(row) - 1]
            loss += F.nll_loss(log_p, torch.tensor(row[1:]), reduction="sum").item()
            kl += F.kl_div(log_p, ref, log_target=True, reduction="sum").item()
            same += int((ref.argmax(-1) == log_p.argmax(-1)).sum())
            count += len(row) - 1
        if count != ref_all.shape[0]:
            raise ValueError(f"the reference has {ref_all.shape[0]} positions, the rows {count}")
        return {"loss": loss / count, "kl": kl / count, "top1": same / count}

    def _log_probs(self, rows: list[list[int]]):
        """Per row: its next-token log-probabilities [len - 1, vocab] (fp32), from a second context that keeps
        every position's logits (logits_all), opened for this only (it would slow the timed prefill down)."""
        scorer = self._open(max(len(r) for r in rows) + 8, logits_all=True)
        try:
            for row in rows:
                scorer.reset()
                scorer.eval(row)
                logits = torch.from_numpy(np.array(scorer.scores[:len(row) - 1], dtype=np.float32))
                yield F.log_softmax(logits, dim=-1)
        finally:
            scorer.close()

    def close(self) -> None:
        self.model.close()


@contextmanager
def _repacking(allowed: bool):
    """llama.cpp repacks a model's weights at load for its fastest CPU kernels (its "extra buffer types": AMX and
    interleaved layouts) unless the model parameters' use_extra_bufts is off, as llama.cpp's own --no-repack sets it.
    llama-cpp-python has no keyword for it, so for a load without repacking its default parameters are wrapped for
    the duration of that load."""
    if allowed:
        yield
        return
    module = llama_cpp.llama_cpp
    default = module.llama_model_default_params

    def without_repacking():
        params = default()
        params.use_extra_bufts = False
        return params

    module.llama_model_default_params = without_repacking
    try:
        yield
    finally:
        module.llama_model_default_params = default
