"""Bytes of K/V a decode step moves: what tells a step that reads the KV pool in place from one that gathers it.

`decode_step_bytes(llm, past)` runs one decode step of a sequence `past` tokens long and sums the bytes of the
floating-point tensors its ops write (views left out: they move nothing; integer metadata such as page tables, 8
bytes a page, is not K/V). A step that reads the pool in place writes the same bytes at any past; one that gathers
writes each layer's past K/V again. The Triton kernel's launches are left out: its interpreter copies a launch's
tensors to run it on the host, which a GPU does not. Used by the suite and by the GPU check.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tiermoe.engine.sampling import SamplingParams


class StepBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused and not func.is_view:
            self.bytes += sum(t.nbytes for t in (out if isinstance(out, (tuple, list)) else [out])
                              if isinstance(t, torch.Tensor) and t.is_floating_point())
        return out


def decode_step_bytes(llm, past: int) -> tuple[int, list[int]]:
    """(bytes the ops of one decode step write, the sequence's greedy tokens) for a prompt of `past` tokens; the
    prompt's last page is at the same offset for pasts that differ by a multiple of the page size."""
    engine = llm.engine
    seq = engine.add([3 + i % 200 for i in range(past)], SamplingParams(max_tokens=4, temperature=0.0,
                                                                      ignore_eos=True))
    while not seq.output_ids:  # the prompt, then its first token: the next step is a decode step
        engine.step()
    counter = StepBytes()
    kernel = engine.decode_attention
    if kernel is not None:
        attend = kernel.attend

        def unseen(*args, **kwargs):
            counter.paused = True
            try:
                attend(*args, **kwargs)
            finally:
                counter.paused = False

        kernel.attend = unseen
    try:
        with counter:
            engine.step()
    finally:
        if kernel is not None:
            del kernel.attend
    engine.run_to_completion()
    if seq.error is not None:
        raise RuntimeError(f"the sequence failed: {seq.error}")
    return counter.bytes, list(seq.output_ids)
