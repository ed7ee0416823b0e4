"""--lora for `tiermoe generate` and `tiermoe serve`: PEFT LoRA adapters, merged into the model as it loads, or (serve)
served per request, unmerged, several at once.

The flags only (light: parsers import it for `--help`); reading the adapters is tiermoe.cli.lora_args.
"""

from __future__ import annotations

import argparse

from tiermoe.cli.choices import DEFAULT_LOADED_ADAPTERS, MAX_LOADED_ADAPTERS
from tiermoe.cli.flags import positive_int

ADAPTER_FILES = "adapter_config.json + adapter_model.safetensors, as tiermoe finetune or PEFT's save_pretrained write them"


def add_lora_flag(p) -> None:
    p.add_argument("--lora", metavar="DIR", default=None,
                   help=f"serve with this PEFT LoRA adapter ({ADAPTER_FILES}) merged into the weights, routed "
                        "experts included (needs the [train] extra)")


def loaded_adapters(value: str) -> int:
    number = positive_int(value)
    if number > MAX_LOADED_ADAPTERS:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_LOADED_ADAPTERS} adapters (each loaded one widens "
                                         f"every product it adapts), got {number}")
    return number


def add_served_lora_flags(p) -> None:
    """serve's: adapters per request (--lora NAME=DIR, SGLang's --lora-paths), or one merged (--lora DIR)."""
    p.add_argument("--lora", metavar="NAME=DIR", action="append", default=None,
                   help=f"a PEFT LoRA adapter ({ADAPTER_FILES}; needs the [train] extra). NAME=DIR, repeatable: "
                        "served per request, unmerged, several at once, routed experts included; a request asks "
                        "for it by name (`lora_path`, or `model` \"<served name>:NAME\" or \"NAME\") and the others "
                        "run without it, in the same steps. DIR alone (once): merged into the weights as they load, "
                        "so every request runs with it")
    p.add_argument("--lora-paths", metavar="NAME=DIR", nargs="+", action="extend", default=None,
                   help="SGLang's: adapters served per request, as --lora NAME=DIR (a DIR alone is named by itself, "
                        "as SGLang names it; SGLang's JSON form {\"lora_name\", \"lora_path\"} is taken too)")
    p.add_argument("--max-loras-per-batch", type=loaded_adapters, default=DEFAULT_LOADED_ADAPTERS, metavar="N",
                   help=f"adapters served per request at once (SGLang's flag; default {DEFAULT_LOADED_ADAPTERS}, at "
                        f"most {MAX_LOADED_ADAPTERS}): every loaded adapter is in every step's products, so this "
                        "bounds the loaded ones; /load_lora_adapter beyond it is a 400")
    p.add_argument("--enable-lora", action="store_true",
                   help="SGLang's: take adapters while serving (POST /load_lora_adapter, /unload_lora_adapter), "
                        "also with none at start; on with --lora NAME=DIR or --lora-paths. Loading reads any "
                        "directory the server may read: keep the server behind an API key")
