"""One log line per dynamic expert update (KTransformers logs each layerwise prefill and update): which layers,
how many experts moved, how many bytes, how long from the proposal to the last copy landing. INFO on the
`tiermoe` logger, which `tiermoe serve` prints."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def log_update(label: str, layers, swaps: int, moved_bytes: int, seconds: float) -> None:
    """`swaps` swaps done (each moves two experts: one to each tier) in `layers`; label: the policy, or how the
    swaps ran (several ranks apply them synchronously)."""
    log.info("dynamic expert update (%s): %d experts moved (%d swaps) in layers %s, %.2f MiB, %.1f ms",
             label, 2 * swaps, swaps, sorted(set(layers)), moved_bytes / 2**20, seconds * 1e3)
