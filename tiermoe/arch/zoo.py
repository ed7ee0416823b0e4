"""The MoE causal LMs of the installed transformers: every model type whose causal-LM modeling file defines a fused
experts module, found in transformers itself (its causal-LM mapping and modeling sources), never listed by hand.

A composite config (a vision-language wrapper) whose text part is a model type of its own is listed once, as that
text type; model types that share a modeling class but not a config (GLM-4-MoE's and Param2-MoE's) are each listed.
transformers is imported by the functions that ask it, so that importing tiermoe.arch does not load it.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

# A fused experts module: the ExpertsInterface decorator, or 3-D expert parameters named as transformers fuses them.
_EXPERTS_SOURCE = re.compile(r"@use_experts_implementation|self\.(gate_up_proj|up_proj)\s*=\s*nn\.Parameter\(\s*"
                             r"torch\.\w+\(\s*self\.num_experts")


def causal_lm_types() -> dict[str, str]:
    """The installed transformers' causal-LM model types -> class names (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def moe_causal_lm_types() -> tuple[str, ...]:
    """Sorted model types of the installed transformers' causal LMs with fused experts."""
    types = (t for t in causal_lm_types() if defines_experts(t) and not _text_part_listed(t))
    return tuple(sorted(types))


def defines_experts(model_type: str) -> bool:
    """Whether `model_type`'s causal-LM modeling file defines a fused experts module (read, not imported)."""
    class_name = causal_lm_types().get(model_type)
    source = _modeling_source(class_name) if class_name else None
    return source is not None and _EXPERTS_SOURCE.search(source) is not None


def _modeling_source(class_name: str) -> str | None:
    """The text of the modeling file defining `class_name`, read without importing it (importing all of them
    takes seconds)."""
    import transformers

    module = getattr(transformers, "_class_to_module", {}).get(class_name)
    if module is None:
        return None
    spec = importlib.util.find_spec(f"transformers.{module}")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).read_text()


def _text_part_listed(model_type: str) -> bool:
    """A composite config whose text config is another listed causal-LM type (qwen3_5_moe -> qwen3_5_moe_text)."""
    from transformers import AutoConfig

    try:
        text = AutoConfig.for_model(model_type).get_text_config(decoder=True)
    except (ValueError, TypeError, KeyError):
        return False
    return text.model_type != model_type and text.model_type in causal_lm_types()
