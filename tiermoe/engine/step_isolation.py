"""A failed step, traced to the sequence(s) that caused it: one sequence's failure must not end the others.

When a step's forward raises, every sequence's cache is rolled back to where the step began
(tiermoe.engine.cache_rollback) and the sequences are re-run in halves, recursively, until each either has its
logits or fails alone. This does not depend on how the step groups its sequences into forwards: one forward for
all of them fails as a whole and is split here. A sequence whose cache cannot be rolled back (sliding windows,
linear-attention state changed in place) fails with the step's error.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tiermoe.engine.cache_rollback import mark, roll_back
from tiermoe.engine.sequence import Sequence

Forward = Callable[[list[Sequence], list[list[int]]], list[torch.Tensor]]


def forward_isolating(forward: Forward, batch: list[Sequence],
                      inputs: list[list[int]]) -> tuple[list[torch.Tensor | None], dict[int, BaseException]]:
    """`forward(batch, inputs)` -> (each sequence's logits, {index: error} of the sequences that failed)."""
    marks = [mark(seq.cache) for seq in batch]
    logits: list[torch.Tensor | None] = [None] * len(batch)
    errors: dict[int, BaseException] = {}

    def run(rows: list[int]) -> None:
        try:
            for i, row_logits in zip(rows, forward([batch[i] for i in rows], [inputs[i] for i in rows])):
                logits[i] = row_logits
            return
        except Exception as err:  # noqa: BLE001 - found below: which sequence(s) it belongs to
            failure = err
        restored = []
        for i in rows:
            if roll_back(batch[i], marks[i]):
                restored.append(i)
            else:
                errors[i] = failure
        if len(rows) == 1:
            errors[rows[0]] = failure
        elif restored:
            half = (len(restored) + 1) // 2
            run(restored[:half])
            run(restored[half:])

    run(list(range(len(batch))))
    return logits, errors
