"""An adapter directory as a MergedLoRA: what `tiermoe generate/serve --lora DIR` merge into the model at load.

PEFT decides where each tensor goes (tiermoe.training.adapter_layout): a LoRA on a Linear or on a 2-D parameter
(the router's `gate.weight`) updates that parameter; a ParamWrapper on a fused expert parameter becomes per-expert
factors in tiermoe's layout (tiermoe.training.peft_layout), merged into each expert as it is read.
"""

from __future__ import annotations

from pathlib import Path

from tiermoe.arch import detect, load_config
from tiermoe.errors import TiermoeError
from tiermoe.model.lora_merge import LoraDelta, MergedLoRA
from tiermoe.training.adapter_files import read_adapter
from tiermoe.training.peft_layout import from_peft


def merged_lora(adapter_dir: str | Path, model_dir: str | Path) -> MergedLoRA:
    """The adapter in `adapter_dir` (PEFT's layout, for the transformers model of `model_dir`), ready to merge."""
    model_config = load_config(model_dir)
    spec = detect(model_config)
    _, layout, tensors = read_adapter(adapter_dir, model_config)
    merged = MergedLoRA(source=f"adapter {adapter_dir}")
    for target in layout.targets.values():
        a, b = (tensors[k] for k in target.tensor_keys())
        if target.is_experts:
            if spec.disk.fused_kind != "transformers":
                raise TiermoeError(f"adapter {adapter_dir} has LoRA on the routed experts of a {spec.model_type} "
                                   "model, whose fused experts tiermoe does not merge LoRA into yet")
            A, B = from_peft(a, b, target.num_experts)
            merged.experts.setdefault(target.layer, {})[target.param.removesuffix("_proj")] = \
                LoraDelta(A, B, target.scaling)
        elif target.num_experts == 1:
            merged.weights[f"{target.module}.{target.param}"] = LoraDelta(a, b, target.scaling)
        else:
            raise TiermoeError(f"adapter {adapter_dir} adapts the 3-D parameter '{target.module}.{target.param}', "
                               "which is not a routed-expert projection tiermoe can merge")
    return merged
