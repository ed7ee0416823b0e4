"""Which swaps to make: experts to promote paired with experts to demote, by what each would save on the GPU tier.

A swap's worth is value(in) - value(out) - its copies, for one way of valuing it (how long the swap is expected
to stay, and so which copies it pays: one way, or there and back). For one valuation the best set of r swaps
pairs the r most valuable candidates with the r least valuable victims, in that order; over several valuations
the pairs of each are pooled and taken best first, no expert twice.

Within a layer (the default of every policy: each layer keeps its GPU count) the pairing is done per layer;
across layers (`cross_layer`) the candidates and victims of all layers are ranked together, so a GPU slot of a
cold layer goes to a hot expert of another and the total stays. Legend: L layers, E experts.
"""

from __future__ import annotations

import torch

from tiermoe.placement.policies import Swap

NONE = float("-inf")


def _pairs(in_value_LE: torch.Tensor, out_value_LE: torch.Tensor, wanted_LE: torch.Tensor, victims_LE: torch.Tensor,
           budget: int, cost: float, cross_layer: bool) -> list[tuple[float, int, int, int, int]]:
    """(gain, layer_in, expert_in, layer_out, expert_out) of the `budget` best pairs of one valuation."""
    num_experts = in_value_LE.shape[1]
    rows = (lambda t: t.reshape(1, -1)) if cross_layer else (lambda t: t)
    r = min(budget, rows(in_value_LE).shape[1])
    in_val, in_idx = torch.topk(torch.where(rows(wanted_LE), rows(in_value_LE), NONE), r, dim=1)
    out_val, out_idx = torch.topk(torch.where(rows(victims_LE), -rows(out_value_LE), NONE), r, dim=1)
    gain = in_val + out_val - cost
    gain = torch.where(torch.isfinite(in_val) & torch.isfinite(out_val), gain, NONE)
    best_val, best = torch.topk(gain.flatten(), min(budget, gain.numel()))
    out = []
    for value, pos in zip(best_val.tolist(), best.tolist()):
        if value <= 0:
            break
        row, rank = divmod(pos, r)
        flat_in, flat_out = int(in_idx[row, rank]), int(out_idx[row, rank])
        if cross_layer:
            out.append((value, *divmod(flat_in, num_experts), *divmod(flat_out, num_experts)))
        else:
            out.append((value, row, flat_in, row, flat_out))
    return out


def best_swaps(options: list[tuple[torch.Tensor, torch.Tensor, float]], wanted_LE: torch.Tensor,
               victims_LE: torch.Tensor, budget: int, cross_layer: bool = False) -> list[Swap]:
    """At most `budget` swaps with a positive gain, best first. options: (value [L, E] of having each expert on
    the GPU tier when promoted, the same when demoted (a cautious valuation takes the low end of an estimate for
    the one and the high end for the other), the copies a swap valued that way must pay); wanted_LE: experts
    that may be promoted; victims_LE: experts that may be demoted."""
    if budget <= 0:
        return []
    pooled = sorted((p for in_value, out_value, cost in options
                     for p in _pairs(in_value, out_value, wanted_LE, victims_LE, budget, cost, cross_layer)),
                    key=lambda p: -p[0])
    used, swaps = set(), []
    for _, layer_in, expert_in, layer_out, expert_out in pooled:
        if (layer_in, expert_in) in used or (layer_out, expert_out) in used:
            continue
        used |= {(layer_in, expert_in), (layer_out, expert_out)}
        swaps.append(Swap(layer_in, expert_in, expert_out, None if layer_in == layer_out else layer_out))
        if len(swaps) == budget:
            break
    return swaps
