"""Generated conversations served side by side, as the server batches them: a per_token trace of `slots` concurrent
conversations, each slot serving its own list of requests one after another (e.g. one task per slot), every pass
one token of each conversation running. A request's first token is its prompt (one prefill token in the pass that
starts it), the rest decode one a step. The routing comes from tiermoe.routing.generator; what this adds is
the interleaving, which the generator's own trace (requests one after another, one token a pass) does not have.
Legend: N tokens, M MoE layers, K top-k.
"""

from __future__ import annotations

import torch

from tiermoe.routing.generator import RequestRouting, RoutingShape


def interleave(slots: list[list[RequestRouting]], shape: RoutingShape) -> dict:
    """The per_token trace (tiermoe.stats.traces format) of `slots` served side by side: pass p holds, for every
    slot with work left, the next token of its current request; a slot moves to its next request once the last
    one's tokens are done (the server admits a waiting request into the freed slot)."""
    queues = [list(requests) for requests in slots]
    position = [0] * len(slots)
    rows, ids = [], []  # (pass, request, position, prefill), [M, K] of each token
    step = 0
    while any(queues):
        for s, queue in enumerate(queues):
            if not queue:
                continue
            request = queue[0]
            rows.append((step, request.request, position[s], position[s] == 0))
            ids.append(request.ids_TMK[position[s]])
            position[s] += 1
            if position[s] == request.ids_TMK.shape[0]:
                queue.pop(0)
                position[s] = 0
        step += 1
    column = lambda i, dtype: torch.tensor([r[i] for r in rows], dtype=dtype)
    return {"token_pass": column(0, torch.int32), "token_request": column(1, torch.int32),
            "token_position": column(2, torch.int32), "token_is_prefill": column(3, torch.bool),
            "topk_ids": torch.stack(ids) if ids else torch.zeros(0, shape.moe_layers, shape.top_k, dtype=torch.int16),
            "moe_layers": list(shape.layer_ids), "num_layers": shape.first_moe_layer + shape.moe_layers,
            "num_experts": shape.num_experts}
