"""Eight sequences of different lengths through the engine's paged pool against the unmodified transformers model:
what the suite checks on the CPU and the GPU check on CUDA, by the same code.

Chunks of 7 put chunk boundaries inside GPT-OSS's sliding window (16 in the tiny configs) and through Qwen3-Next's
linear-attention layers, and decode rows run beside chunks in the same forward. Each sequence samples greedily
from the engine's logits; the reference runs each sequence alone, in one forward over all its tokens, on the same
device. fp32: max |a - b| / max |b| of each sampled row against the reference's row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PROMPT_LENGTHS = (1, 3, 9, 17, 23, 30, 5, 12)
CHUNK = 7
DECODE_STEPS = 3


def prompt(n: int, salt: int) -> list[int]:
    return [3 + (7 * i + 11 * salt) % 240 for i in range(n)]


@dataclass(frozen=True)
class PoolExactness:
    worst_rel_err: float  # over every sampled row of every sequence
    forwards: int  # engine forwards for all eight (one per step)
    tokens_equal: bool  # each greedy token the engine sampled is the reference's argmax there
    pages_left: int  # pool pages still held once every sequence is released (0 expected)


def eight_sequences_against(llm, reference) -> PoolExactness:
    """Feed the eight prompts through `llm`'s engine (one forward per step for all that still feed), then compare
    every sampled row with `reference` (a transformers causal LM on the engine's device, fp32)."""
    engine = llm.engine
    prompts = [prompt(n, i) for i, n in enumerate(PROMPT_LENGTHS)]
    seqs = [engine.new_sequence() for _ in prompts]
    tokens = [list(p) for p in prompts]  # what each sequence has fed or will feed
    got: list[list[torch.Tensor]] = [[] for _ in prompts]  # logits of each fed position that was sampled
    forwards = 0
    while any(s.num_fed < len(p) + DECODE_STEPS for s, p in zip(seqs, prompts)):
        feeding = [i for i, (s, p) in enumerate(zip(seqs, prompts)) if s.num_fed < len(p) + DECODE_STEPS]
        inputs = [tokens[i][seqs[i].num_fed:seqs[i].num_fed + CHUNK] for i in feeding]
        logits = engine.feed([seqs[i] for i in feeding], inputs)
        forwards += 1
        for i, row in zip(feeding, logits):
            if seqs[i].num_fed == len(tokens[i]):  # its known tokens are through: it "samples" greedily
                got[i].append(row[-1])
                tokens[i].append(int(row[-1].argmax()))
    worst, equal = 0.0, True
    device = next(reference.parameters()).device
    for i, p in enumerate(prompts):
        with torch.no_grad():
            want = reference(torch.tensor([tokens[i][:-1]], device=device)).logits[0].float().cpu()
        for k, row in enumerate(got[i]):
            ref_row = want[len(p) - 1 + k]
            worst = max(worst, float((row - ref_row).abs().max() / ref_row.abs().max()))
            equal &= int(ref_row.argmax()) == tokens[i][len(p) + k]
        engine.release(seqs[i])
    return PoolExactness(worst, forwards, equal, sum(engine.pool.used_pages().values()))
