"""--lora DIR for `tiermoe generate` and `tiermoe serve`: a PEFT LoRA adapter merged into the model as it loads.

The flag only (light: parsers import it for `--help`); reading the adapter is tiermoe.cli.lora_args.
"""

from __future__ import annotations


def add_lora_flag(p) -> None:
    p.add_argument("--lora", metavar="DIR", default=None,
                   help="serve with this PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors, as "
                        "tiermoe finetune or PEFT's save_pretrained write it) merged into the weights, routed "
                        "experts included (needs the [train] extra)")
