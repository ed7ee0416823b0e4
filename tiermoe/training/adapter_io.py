"""Loading a saved adapter onto a freshly loaded trainable hybrid model, and the adapter API in one place.

`load_adapter` takes an adapter directory saved by `save_adapter` or by PEFT for the transformers model (trained
there, or on transformers 4 with per-expert keys), builds the same LoRA on the hybrid model (tiermoe.training.lora)
and fills it; the model then computes what PEFT's model computes with that adapter, and trains on from it.
"""

from __future__ import annotations

import copy
from pathlib import Path

from torch import nn

from tiermoe.errors import TiermoeError
from tiermoe.model.hybrid_model import HybridModel
from tiermoe.training.adapter_files import read_adapter
from tiermoe.training.adapter_weights import attach_adapter_io, expert_loras, fill_adapter, save_adapter
from tiermoe.training.lora import build_lora, plan_lora

__all__ = ["attach_adapter_io", "expert_loras", "load_adapter", "save_adapter"]


def load_adapter(hybrid: HybridModel, adapter_dir: str | Path, trainable: bool = False) -> nn.Module:
    """Put the adapter saved in `adapter_dir` (by save_adapter, or by PEFT for the transformers model) on a
    trainable hybrid model; returns the model to train or evaluate, as `apply_lora` does. `trainable`: its
    adapter weights get gradients (to resume training); otherwise they are frozen and the model is in eval mode."""
    if not hybrid.trainable:
        raise TiermoeError("load_adapter needs a model loaded for training (load_hybrid_model(..., trainable=True)); "
                           "to serve an adapter, merge it: tiermoe serve/generate --lora DIR")
    if any("lora_" in name for name, _ in hybrid.model.named_parameters()):
        raise TiermoeError("this model already has LoRA adapters; load an adapter into a freshly loaded model")
    config, layout, tensors = read_adapter(adapter_dir, hybrid.config)
    run_config = copy.deepcopy(config)
    run_config.inference_mode = not trainable
    model = build_lora(hybrid, plan_lora(hybrid, run_config, layout=layout))
    fill_adapter(model, layout, tensors, adapter_dir)
    for name, p in model.named_parameters():
        p.requires_grad_(trainable and "lora_" in name)
    if not trainable:
        model.eval()  # as PEFT's from_pretrained leaves an adapter not loaded for training: no dropout
    attach_adapter_io(model)
    return model
