"""A failed step, traced to the sequence(s) that caused it: one sequence's failure must not end the others.

When a step's forward raises, its sequences are re-run in halves, recursively, until each either has its logits
or fails alone. This does not depend on how the step's forward batches its sequences: one forward for all of them
fails as a whole and is split here. Re-running needs nothing rolled back: a forward writes K/V only at positions
its sequences have not fed yet (a re-run writes them again), and linear-attention states are committed only when
the forward succeeds (tiermoe.layers.linear_attention_slots).

A sticky device error (tiermoe.engine.device_errors) is not bisected: every re-run on a poisoned CUDA context fails
the same way and would blame every sequence. It is raised at once as a fatal DeviceLostError.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tiermoe.engine.device_errors import device_lost, sticky_device_error
from tiermoe.engine.sequence import Sequence

Forward = Callable[[list[Sequence], list[list[int]]], list[torch.Tensor]]


def forward_isolating(forward: Forward, batch: list[Sequence],
                      inputs: list[list[int]]) -> tuple[list[torch.Tensor | None], dict[int, BaseException]]:
    """`forward(batch, inputs)` -> (each sequence's logits, {index: error} of the sequences that failed).
    Raises DeviceLostError (fatal) on a sticky device error, without re-running anything.

    The halves are a stack of row lists, first half first, not a recursive closure: a nested function that calls
    itself is a reference cycle (the function, its cell), and every step's would have held its logits and its
    sequences until a garbage collection found it (under load that was 15,000 logits rows of a 152k vocabulary
    per 10 s for the collector to walk and free)."""
    logits: list[torch.Tensor | None] = [None] * len(batch)
    errors: dict[int, BaseException] = {}
    pending = [list(range(len(batch)))]
    while pending:
        rows = pending.pop()
        try:
            for i, row_logits in zip(rows, forward([batch[i] for i in rows], [inputs[i] for i in rows])):
                logits[i] = row_logits
            continue
        except Exception as err:  # noqa: BLE001 - found below: which sequence(s) it belongs to
            failure = err
        sticky = sticky_device_error(failure)
        if sticky is not None:
            raise device_lost(sticky) from failure
        if len(rows) == 1:
            errors[rows[0]] = failure
            continue
        half = (len(rows) + 1) // 2
        pending += [rows[half:], rows[:half]]  # the first half is popped first
    return logits, errors
