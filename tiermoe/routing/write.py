"""Generated routing written as a trace CSV (docs/traces.md) one request at a time, so a long workload never sits
in memory whole: the same header and rows `write_trace_csv` writes for a trace of decode tokens, one pass each.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from tiermoe.errors import TiermoeError
from tiermoe.routing.generator import RequestRouting, RoutingShape
from tiermoe.stats.trace_csv import TRACE_MAGIC


def row_bytes(shape: RoutingShape, requests: int, tokens: int) -> int:
    """About how many bytes one row takes (seq, pos, layer, ids, prefill): for the disk check before writing."""
    digits = lambda n: len(str(max(n - 1, 0)))  # noqa: E731
    ids = shape.top_k * (digits(shape.num_experts) + 1)
    return digits(requests) + digits(tokens) + digits(shape.first_moe_layer + shape.moe_layers) + ids + 6


def write_generated_csv(path: str | Path, shape: RoutingShape, requests: Iterable[RequestRouting],
                        comments: list[str], done: Callable[[int], None] | None = None) -> tuple[int, int]:
    """Write the requests as a trace CSV; `done(tokens)` after each request. Returns (requests, tokens) written."""
    path = Path(path)
    layers = shape.layer_ids
    meta = (f"num_layers={shape.first_moe_layer + shape.moe_layers} num_experts={shape.num_experts} "
            f"top_k={shape.top_k} model_type={shape.model_type}")
    count, tokens = 0, 0
    try:
        with path.open("w") as out:
            out.write(f"{TRACE_MAGIC}\n# {meta}\n" + "".join(f"# {c}\n" for c in comments))
            out.write("seq,pos,layer,experts,prefill\n")
            ids_row = " ".join(["%d"] * shape.top_k)
            for req in requests:
                t = req.ids_TMK.shape[0]
                # one %-format per request (C speed): each row's position, then its ids
                token = "".join(f"{req.request},%d,{layer},{ids_row},0\n" for layer in layers)
                pos_TM1 = torch.arange(t)[:, None, None].expand(t, len(layers), 1)
                out.write((token * t) % tuple(torch.cat([pos_TM1, req.ids_TMK.long()], 2).flatten().tolist()))
                count, tokens = count + 1, tokens + t
                if done:
                    done(t)
    except OSError as err:
        raise TiermoeError(f"cannot write trace to '{path}': {err.strerror or err}") from None
    return count, tokens
