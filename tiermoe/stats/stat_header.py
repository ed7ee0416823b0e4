"""The fields every tiermoe statistics dump starts with, whatever its mode.

A dump is a plain dict of tensors, ints, strings and lists, so `torch.load(weights_only=True)` reads it. SGLang's
stat dumps carry `rank` and `logical_count`; tiermoe keeps those names and adds its own fields beside them.
"""

from __future__ import annotations

from tiermoe import __version__
from tiermoe.stats.model_shape import ModelShape

DUMP_FORMAT = "tiermoe-expert-distribution"
DUMP_VERSION = 1


def dump_header(mode: str, shape: ModelShape, buffer_size: int) -> dict:
    return {"format": DUMP_FORMAT, "format_version": DUMP_VERSION, "mode": mode, "rank": 0,
            **shape.metadata(), "buffer_size": buffer_size, "tiermoe_version": __version__}
