"""The adapter `--lora DIR` names (tiermoe.cli.lora_flag), read and checked against the model before any weight
loads. Run-side: imports the adapter reader (torch, safetensors)."""

from __future__ import annotations

from tiermoe.bundled import resolve_model
from tiermoe.errors import TiermoeError
from tiermoe.model.lora_merge import MergedLoRA
from tiermoe.training.adapter_merge import merged_lora


def lora_from_args(args) -> MergedLoRA | None:
    """The adapter --lora names, read and checked against the model (before any weight loads), or None."""
    if not getattr(args, "lora", None):
        return None
    try:
        import peft  # noqa: F401  (the [train] extra: reading an adapter's config needs it)
    except ImportError:
        raise TiermoeError("--lora needs PEFT to read the adapter: pip install 'tiermoe[train]'") from None
    return merged_lora(args.lora, resolve_model(args.model))
