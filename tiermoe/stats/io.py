"""Reading activation statistics files: SGLang's recorder dumps, KTransformers' collector output, plain tensors.

Every file is loaded with torch.load(weights_only=True): statistics are data, not code. Accepted:
- a dict with `logical_count` [buf, num_hidden_layers, E] (SGLang's `--init-expert-location` format, and
  tiermoe's own), summed over the first dimension;
- a dict with `activation_counts` [L, E] (KTransformers' collect_expert_distribution.py);
- a bare tensor [L, E] or [buf, L, E].
"""

from __future__ import annotations

from pathlib import Path

import torch

from tiermoe.errors import TiermoeError


def load_counts(path: str | Path, num_layers: int, num_experts: int) -> torch.Tensor:
    """Activation counts [num_layers, num_experts] (float64) from a statistics file, checked against the model."""
    path = Path(path)
    if not path.is_file():
        raise TiermoeError(f"statistics file '{path}' does not exist")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unpickling failure is a bad file for the user
        raise TiermoeError(f"'{path}' is not a statistics file torch can load safely ({type(err).__name__}: "
                           f"{str(err).splitlines()[0][:200]})") from None
    counts = _counts_tensor(data, path)
    expected = f"[buf, {num_layers}, {num_experts}] or [{num_layers}, {num_experts}]"
    if counts.dim() == 3:
        if tuple(counts.shape[1:]) != (num_layers, num_experts):
            raise TiermoeError(f"'{path}' holds counts of shape {list(counts.shape)}; expected {expected} "
                               "(num_hidden_layers x experts of this model)")
        counts = counts.sum(dim=0)
    elif counts.dim() == 2:
        if tuple(counts.shape) != (num_layers, num_experts):
            raise TiermoeError(f"'{path}' holds counts of shape {list(counts.shape)}; expected {expected} "
                               "(num_hidden_layers x experts of this model)")
    else:
        raise TiermoeError(f"'{path}' holds a {counts.dim()}-D tensor of shape {list(counts.shape)}; expected {expected}")
    if counts.is_complex() or counts.dtype == torch.bool:
        raise TiermoeError(f"'{path}' counts have dtype {counts.dtype}; expected integers or floats")
    return counts.to(torch.float64)


def _counts_tensor(data, path: Path) -> torch.Tensor:
    if isinstance(data, torch.Tensor):
        return data
    if isinstance(data, dict):
        for key in ("logical_count", "activation_counts"):
            if isinstance(data.get(key), torch.Tensor):
                return data[key]
        raise TiermoeError(f"'{path}' is a dict without 'logical_count' or 'activation_counts' "
                           f"(keys: {', '.join(map(str, list(data)[:8]))})")
    raise TiermoeError(f"'{path}' holds a {type(data).__name__}; expected a dict with 'logical_count' or a tensor")
