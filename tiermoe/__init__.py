"""tiermoe: run Mixture-of-Experts models with hot experts on the GPU tier and cold experts on the CPU tier.

Importing the package is cheap; the heavy parts (torch models, transformers) load on first use.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "LLM": "tiermoe.engine.llm",
    "SamplingParams": "tiermoe.engine.sampling",
    "RequestOutput": "tiermoe.engine.llm",
    "load_hybrid_model": "tiermoe.model.loader",
    "HybridModel": "tiermoe.model.hybrid_model",
    "TiermoeError": "tiermoe.errors",
    "apply_lora": "tiermoe.training.lora",
    "save_adapter": "tiermoe.training.adapter_io",
    "load_adapter": "tiermoe.training.adapter_io",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tiermoe' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = sorted(_LAZY)
