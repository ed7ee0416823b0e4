"""A PEFT adapter directory on disk: adapter_config.json and adapter_model.safetensors, read and checked.

Whatever is wrong with a directory (missing, a file absent or unreadable, a config that is not LoRA, a tensor
missing, extra or of the wrong shape for this model) is one TiermoeError saying what is wrong and what is expected.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from tiermoe.errors import TiermoeError
from tiermoe.training.adapter_layout import AdapterLayout, adapter_layout

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
LEGACY_WEIGHTS_NAME = "adapter_model.bin"  # what PEFT wrote before safetensors


def read_adapter(adapter_dir: str | Path, model_config):
    """(peft.LoraConfig, AdapterLayout on the model of `model_config`, tensors in the layout's keys) of the adapter
    in `adapter_dir`, everything checked."""
    config = read_adapter_config(adapter_dir)
    layout = adapter_layout(model_config, config)
    return config, layout, checked_tensors(layout, read_adapter_tensors(adapter_dir), adapter_dir)


def read_adapter_config(adapter_dir: str | Path):
    """The peft.LoraConfig of `adapter_dir` (checked to be a LoRA config PEFT can build)."""
    from peft import LoraConfig  # the [train] extra

    path = _adapter_dir(adapter_dir) / CONFIG_NAME
    if not path.is_file():
        raise TiermoeError(f"{adapter_dir}: no {CONFIG_NAME}; expected a PEFT adapter directory ({CONFIG_NAME} and "
                           f"{WEIGHTS_NAME}, as save_pretrained writes them)")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TiermoeError(f"{path}: not readable JSON ({e}); expected PEFT's adapter config") from None
    if not isinstance(raw, dict):
        raise TiermoeError(f"{path}: holds a {type(raw).__name__}, expected a JSON object (PEFT's adapter config)")
    if raw.get("peft_type") != "LORA":
        raise TiermoeError(f"{path}: peft_type is {raw.get('peft_type')!r}; tiermoe reads LoRA adapters "
                           "(peft_type \"LORA\")")
    try:
        return LoraConfig.from_pretrained(str(path.parent))
    except (TypeError, ValueError, KeyError) as e:
        raise TiermoeError(f"{path}: PEFT cannot build a LoraConfig from it: {' '.join(str(e).split())}") from None


def read_adapter_tensors(adapter_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the adapter's weights file, on the host."""
    root = _adapter_dir(adapter_dir)
    path = root / WEIGHTS_NAME
    if path.is_file():
        try:
            return load_file(str(path), device="cpu")
        except (SafetensorError, OSError, ValueError) as e:
            raise TiermoeError(f"{path}: not a readable safetensors file ({' '.join(str(e).split())})") from None
    legacy = root / LEGACY_WEIGHTS_NAME
    if legacy.is_file():
        try:
            state = torch.load(legacy, map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises many kinds for a bad pickle: all mean the same here
            raise TiermoeError(f"{legacy}: not a readable torch state dict ({type(e).__name__})") from None
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise TiermoeError(f"{legacy}: expected a dict of tensors (PEFT's adapter weights)")
        return state
    raise TiermoeError(f"{adapter_dir}: no {WEIGHTS_NAME}; expected the adapter's weights next to {CONFIG_NAME}")


def checked_tensors(layout: AdapterLayout, tensors: dict[str, torch.Tensor], adapter_dir) -> dict[str, torch.Tensor]:
    """The adapter's tensors in the layout's keys (converted from transformers 4's layout when they are in it),
    checked: every tensor the layout expects is there, with its shape, and nothing else is."""
    tensors = layout.convert(tensors)
    expected = {}
    for target in layout.targets.values():
        key_a, key_b = target.tensor_keys()
        expected[key_a], expected[key_b] = (target, target.a_shape), (target, target.b_shape)
    missing = [k for k in expected if k not in tensors]
    if missing:
        raise TiermoeError(f"{adapter_dir}: {WEIGHTS_NAME} has no tensor '{missing[0]}' ({len(missing)} missing), "
                           f"which {CONFIG_NAME} makes PEFT expect for this model; is the adapter for this model?")
    extra = sorted(k for k in tensors if k not in expected)
    if extra:
        raise TiermoeError(f"{adapter_dir}: {WEIGHTS_NAME} holds '{extra[0]}' ({len(extra)} unexpected), which no "
                           f"LoRA target of {CONFIG_NAME} on this model explains; expected only LoRA factors "
                           "(lora_A / lora_B) of its targets")
    for key, (target, shape) in expected.items():
        got = tuple(tensors[key].shape)
        if got != shape:
            experts = f" x {target.num_experts} experts" if target.num_experts > 1 else ""
            raise TiermoeError(f"{adapter_dir}: '{key}' has shape {list(got)}, expected {list(shape)} (rank "
                               f"{target.rank}{experts} by {CONFIG_NAME}, this model's sizes)")
        if not tensors[key].is_floating_point():
            raise TiermoeError(f"{adapter_dir}: '{key}' is {tensors[key].dtype}, expected a floating-point tensor")
    return tensors


def _adapter_dir(adapter_dir: str | Path) -> Path:
    path = Path(adapter_dir)
    if not path.is_dir():
        what = "does not exist" if not path.exists() else "is not a directory"
        raise TiermoeError(f"adapter directory {adapter_dir} {what}; expected a PEFT adapter directory "
                           f"({CONFIG_NAME} and {WEIGHTS_NAME})")
    return path
