"""--lora DIR for `tiermoe generate` and `tiermoe serve`: a PEFT LoRA adapter merged into the model as it loads."""

from __future__ import annotations

from tiermoe.errors import TiermoeError
from tiermoe.model.lora_merge import MergedLoRA
from tiermoe.models import resolve_model
from tiermoe.training.adapter_merge import merged_lora


def add_lora_flag(p) -> None:
    p.add_argument("--lora", metavar="DIR", default=None,
                   help="serve with this PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors, as "
                        "tiermoe finetune or PEFT's save_pretrained write it) merged into the weights, routed "
                        "experts included (needs the [train] extra)")


def lora_from_args(args) -> MergedLoRA | None:
    """The adapter --lora names, read and checked against the model (before any weight loads), or None."""
    if not getattr(args, "lora", None):
        return None
    try:
        import peft  # noqa: F401  (the [train] extra: reading an adapter's config needs it)
    except ImportError:
        raise TiermoeError("--lora needs PEFT to read the adapter: pip install 'tiermoe[train]'") from None
    return merged_lora(args.lora, resolve_model(args.model))
