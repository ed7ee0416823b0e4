"""A family's released checkpoint names, read from transformers' own conversion mapping.

transformers loads a release's checkpoint into its fused modules through a per-family list of renamings
(`.block_sparse_moe.` -> `.mlp.`, `block_sparse_moe.input_linear.weight` -> `...experts.gate_up_proj`) and merges
(`experts.*.w1.weight` and `experts.*.w3.weight` -> `experts.gate_up_proj`). Read backwards, the same list says
where a module's tensor is on disk, so tiermoe reads released checkpoints of families it never saw, one expert at
a time, with no table of its own. Only plain renamings and per-expert merges are read; a conversion that
computes (dequantises, interleaves) is left to a family override.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# A per-expert source pattern: `...experts.*.<projection>.weight`
_PER_EXPERT = re.compile(r"experts\.\*\.(\w+)\.weight$")
_LITERAL = re.compile(r"^[\w.]+$")


@dataclass(frozen=True)
class ReleasedNames:
    renames: tuple[tuple[str, str], ...]  # (on disk, in the model) substrings, in transformers' order
    projections: tuple[str, str, str] | None  # per-expert gate, up, down names ("" gate: experts without one)
    computed: tuple[str, ...] = ()  # model tensors a release stores in another form (split, dequantised, ...)


def released_names(model_type: str) -> ReleasedNames:
    """What transformers' conversion mapping of `model_type` says about its released checkpoint names."""
    # imported here: transformers' conversion mapping imports its model loading (seconds), and tiermoe.arch is
    # imported by commands that never read a checkpoint
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    try:
        mapping = get_checkpoint_conversion_mapping(model_type) or []
    except (KeyError, ValueError, TypeError):
        mapping = []
    renames, merged, computed = [], {}, []
    for entry in mapping:
        sources = [_unescape(p) for p in getattr(entry, "source_patterns", None) or []]
        targets = [_unescape(p) for p in getattr(entry, "target_patterns", None) or []]
        operations = [type(op).__name__ for op in getattr(entry, "operations", None) or []]
        literal = len(targets) == 1 and all(_LITERAL.match(p.replace("*", "")) for p in sources + targets)
        if literal and not operations and len(sources) == 1 and "*" not in sources[0]:
            renames.append((sources[0], targets[0]))
            continue
        names = [m.group(1) for m in map(_PER_EXPERT.search, sources) if m]
        if literal and set(operations) <= {"MergeModulelist", "Concatenate"} and operations and \
                len(names) == len(sources):
            merged[targets[0].rpartition(".")[2]] = names
        else:
            computed += targets
    return ReleasedNames(tuple(renames), _projections(merged), tuple(computed))


def _projections(merged: dict[str, list[str]]) -> tuple[str, str, str] | None:
    down = merged.get("down_proj")
    if down is None or len(down) != 1:
        return None
    if len(merged.get("gate_up_proj", [])) == 2:
        gate, up = merged["gate_up_proj"]
        return gate, up, down[0]
    if len(merged.get("up_proj", [])) == 1:
        return "", merged["up_proj"][0], down[0]
    return None


def on_disk(name: str, renames: tuple[tuple[str, str], ...]) -> list[str]:
    """Candidate checkpoint names of model tensor `name`: itself, each renaming undone, and all of them undone
    (last first, as transformers applied them first to last)."""
    candidates = [name]
    undone = name
    for disk, model in reversed(renames):
        if model in name:
            candidates += [name.replace(model, disk, 1), name.replace(model, disk)]
        # a renaming is not one to one ('.hc_pre.hc_' -> '.hc_'): undone at the first place it applies
        undone = undone.replace(model, disk, 1)
    candidates.append(undone)
    return list(dict.fromkeys(candidates))


def _unescape(pattern: str) -> str:
    return pattern.replace("\\.", ".").lstrip("^").rstrip("$")
