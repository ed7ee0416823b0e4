"""bench_speculative.py's llama.cpp arms: llama-cpp-python's plain decode and its prompt-lookup speculative decoding
(e2e/llama_lookup_side.py) on the same checkpoint as tiermoe's arms, converted once to a bf16 GGUF by llama.cpp's
own converter (e2e/llama_cpp.py: cached, keyed by the checkpoint's contents).

The arms run in a process of their own (e2e/worker.py), as bench_e2e_cpu.py runs llama.cpp, on every CPU the
benchmark had when it started. In the benchmark's own process llama.cpp's threads would inherit what tiermoe does
to the thread that calls its kernel team: it pins that thread to one core, so llama.cpp's threads, started from
it, would share that core; a process started from that thread inherits the pin too, hence the CPUs given
explicitly (taskset -c 0 against -c 0,1 changes llama.cpp's 2-thread decode of the demo model by itself).
"""

from __future__ import annotations

from pathlib import Path

from e2e.llama_cpp import cached_gguf
from e2e.side_process import Worker

DEFAULT_LOOKUP = 10  # LlamaPromptLookupDecoding's default num_pred_tokens
PLAIN = "llama.cpp plain"
EVAL_LOOP = "llama.cpp plain, eval loop"  # plain decode without generate's sampler chain (e2e/llama_side.py)


def lookup_arms(lengths: list[int]) -> dict[str, int | None]:
    """Arm name -> num_pred_tokens (None: plain decode): --draft-tokens' lengths and llama-cpp-python's default."""
    return {PLAIN: None, **{f"llama.cpp prompt-lookup {n}": n for n in sorted({*lengths, DEFAULT_LOOKUP})}}


class LlamaArms:
    """The llama.cpp arms of one run; decode(arm, prompts, tokens) -> {seconds, counted, out, drafted, accepted}."""

    def __init__(self, model_dir: Path, lengths: list[int], threads: int, context: int, cpus: list[int]):
        lookups = lookup_arms(lengths)
        self.arms = [PLAIN, EVAL_LOOP, *list(lookups)[1:]]
        load = {"path": str(cached_gguf(model_dir)), "threads": threads, "context": context, "lookups": lookups,
                "eval_loop": EVAL_LOOP, "cpus": cpus}
        self.worker = Worker("llama.cpp", "llama.cpp-lookup", load, None)

    def decode(self, arm: str, prompts: list[list[int]], tokens: int) -> dict:
        return self.worker.call("decode", arm=arm, prompts=prompts, tokens=tokens)

    def close(self) -> None:
        self.worker.close()


def same_replies(out: list[list[int]], reference: list[list[int]]) -> tuple[int, float]:
    """(replies equal to the reference's, the mean tokens before the first that differs)."""
    equal, leading = 0, 0
    for a, b in zip(out, reference, strict=True):
        equal += a == b
        leading += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return equal, leading / max(1, len(out))
