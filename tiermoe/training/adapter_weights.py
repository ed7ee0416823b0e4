"""A model's adapter weights in PEFT's own on-disk layout: written out (save_adapter), read back into the adapter a
model already has (fill_adapter), and the two hooks transformers' Trainer saves and resumes through.

`save_adapter` writes what `PeftModel.save_pretrained` writes for the unmodified transformers model with the same
LoRA: the module adapters as PEFT saves them, and the routed-expert LoRA as the ParamWrappers PEFT puts on
`mlp.experts.gate_up_proj` / `mlp.experts.down_proj` (`target_parameters`, ranks and alphas in rank_pattern /
alpha_pattern where they differ from r / lora_alpha), so `PeftModel.from_pretrained(plain_model, dir)` rebuilds the
same wrappers and computes what the hybrid model computes. Key names and shapes come from PEFT itself
(tiermoe.training.adapter_layout). Nothing here builds adapters (tiermoe.training.lora does; adapter_io loads an
adapter into a fresh model), so lora may use this module.
"""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from tiermoe.errors import TiermoeError
from tiermoe.layers.expert_lora import ExpertLoRA
from tiermoe.training.adapter_files import CONFIG_NAME, WEIGHTS_NAME, checked_tensors, read_adapter
from tiermoe.training.adapter_layout import ADAPTER, EXPERT_PARAMS, AdapterLayout, LoraTarget, adapter_layout
from tiermoe.training.peft_layout import from_peft, to_peft

SCALING_TOLERANCE = 1e-9  # relative: the same alpha / r computed twice
SAVED_CONFIG_ATTR = "tiermoe_adapter_config"  # the model attribute attach_adapter_io keeps the saved config in


def save_adapter(model: nn.Module, out_dir: str | Path) -> Path:
    """Write `model`'s adapter (the model `apply_lora` or `load_adapter` returned) to `out_dir` as PEFT would:
    adapter_config.json and adapter_model.safetensors. Returns the directory."""
    out = Path(out_dir)
    experts = expert_loras(model)
    config = adapter_config(model, experts)
    layout = adapter_layout(_model_config(model), config)
    tensors = _module_tensors(model)
    for target in layout.targets.values():
        if target.is_experts:
            lora = _expert_lora_for(experts, target)
            _check_scaling(lora, target, "the saved config")
            proj = target.param.removesuffix("_proj")
            a, b = to_peft(getattr(lora, f"{proj}_A").detach(), getattr(lora, f"{proj}_B").detach())
            key_a, key_b = target.tensor_keys()
            tensors[key_a], tensors[key_b] = a.cpu(), b.cpu()
    checked_tensors(layout, tensors, out)  # what PEFT will look for is exactly what is written
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out), auto_mapping_dict=_auto_mapping(model, config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    return out


def attach_adapter_io(model: nn.Module, saved_config=None) -> nn.Module:
    """Make `model.save_pretrained(dir)` write the whole adapter in PEFT's layout (save_adapter: expert LoRA
    included, which PEFT's own save would leave out) and, on a PeftModel, `model.load_adapter(dir, ...)` read one
    back into the adapters it has: what transformers' Trainer calls for checkpoints and resume_from_checkpoint.
    saved_config: the LoraConfig PEFT applies to the transformers model to rebuild this adapter (what
    tiermoe.training.lora planned); kept on the model for every later save."""
    if saved_config is not None:
        setattr(model, SAVED_CONFIG_ATTR, saved_config)

    def save_pretrained(save_directory, *args, is_main_process: bool = True, **kwargs):
        if is_main_process:
            save_adapter(model, save_directory)

    def load_adapter_values(model_id, adapter_name: str = ADAPTER, *args, **kwargs):
        if adapter_name != ADAPTER:
            raise TiermoeError(f"a hybrid model holds one adapter ('{ADAPTER}'), not '{adapter_name}'")
        _, layout, tensors = read_adapter(model_id, _model_config(model))
        fill_adapter(model, layout, tensors, model_id)

    model.save_pretrained = save_pretrained
    if hasattr(model, "peft_config"):
        model.load_adapter = load_adapter_values
    return model


def expert_loras(model: nn.Module) -> dict[int, ExpertLoRA]:
    """{MoE layer: its ExpertLoRA} of a model (empty when the routed experts are not adapted)."""
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, ExpertLoRA):
            found[int(re.search(r"layers\.(\d+)\.", name).group(1))] = module
    return found


def adapter_config(model: nn.Module, experts: dict[int, ExpertLoRA]):
    """The LoraConfig PEFT needs to rebuild `model`'s adapter on the transformers model: the one planned with the
    adapter (kept by attach_adapter_io), else the module config PEFT was given plus the fused expert parameters with
    the ExpertLoRA's ranks and alphas."""
    from peft import LoraConfig  # the [train] extra

    planned = getattr(model, SAVED_CONFIG_ATTR, None)
    if planned is not None:
        return _finished(model, copy.deepcopy(planned))
    peft_config = getattr(model, "peft_config", None)
    if peft_config:
        config = copy.deepcopy(peft_config[ADAPTER])
    elif experts:
        lora = next(iter(experts.values()))
        config = LoraConfig(r=lora.ranks[1], lora_alpha=lora.alphas[1], target_modules=None,
                            target_parameters=list(EXPERT_PARAMS), use_rslora=_rslora(lora))
    else:
        raise TiermoeError("the model has no LoRA adapter to save (apply tiermoe.training.apply_lora first)")
    if experts:
        lora = next(iter(experts.values()))
        config.target_parameters = sorted(set(config.target_parameters or ()) | set(EXPERT_PARAMS))
        for name, rank, alpha in zip(EXPERT_PARAMS, lora.ranks, lora.alphas, strict=True):
            config.rank_pattern = _with_pattern(config.rank_pattern, name, rank, config.r)
            config.alpha_pattern = _with_pattern(config.alpha_pattern, name, alpha, config.lora_alpha)
    return _finished(model, config)


def _finished(model: nn.Module, config):
    """`config` as PEFT saves it: for inference, naming the base model when it is known."""
    config.inference_mode = True
    if config.base_model_name_or_path is None:
        config.base_model_name_or_path = getattr(_base_model(model), "name_or_path", None) or None
    return config


def _with_pattern(patterns: dict | None, name: str, value, default) -> dict:
    """`patterns` (PEFT's rank_pattern or alpha_pattern: the first matching key wins) such that the fused expert
    parameter `name` gets `value`: unchanged when it already does, else with its own key first."""
    patterns = dict(patterns or {})
    key = f"model.layers.0.mlp.experts.{name}"
    current = next((v for p, v in patterns.items() if re.match(rf"(.*\.)?({p})$", key)), default)
    if current == value:
        return patterns
    own = rf".*\.{name}"
    return {own: value, **{p: v for p, v in patterns.items() if p != own}}


def _rslora(lora: ExpertLoRA) -> bool:
    """Whether the ExpertLoRA scales by alpha / sqrt(r) (rsLoRA) rather than alpha / r."""
    return not math.isclose(lora.scalings[1], lora.alphas[1] / lora.ranks[1], rel_tol=SCALING_TOLERANCE)


def fill_adapter(model: nn.Module, layout: AdapterLayout, tensors: dict[str, torch.Tensor], source) -> None:
    """Copy the adapter's tensors into the model's adapter weights (every one of them, each shape checked)."""
    params = dict(model.named_parameters())
    experts = expert_loras(model)
    written = set()
    with torch.no_grad():
        for key, target in layout.targets.items():
            a, b = (tensors[k] for k in target.tensor_keys())
            if target.is_experts:
                lora = _expert_lora_for(experts, target)
                _check_scaling(lora, target, f"{source}/{CONFIG_NAME}")
                proj = target.param.removesuffix("_proj")
                for factor, value in zip("AB", from_peft(a, b, target.num_experts), strict=True):
                    dest = getattr(lora, f"{proj}_{factor}")
                    _copy(dest, value, f"{key} ({proj}_{factor})")
                    written.add(id(dest))
                continue
            for factor, value in zip("AB", (a, b), strict=True):
                name = f"{key}.lora_{factor}.{ADAPTER}.weight"
                if name not in params:
                    raise TiermoeError(f"{source}: the model has no adapter weight '{name}' for '{key}'; the adapter "
                                       "config targets modules this model's adapter does not")
                _copy(params[name], value, name)
                written.add(id(params[name]))
    left = [n for n, p in params.items() if "lora_" in n and id(p) not in written]
    if left:
        raise TiermoeError(f"{source}: nothing in the adapter for the model's '{left[0]}' ({len(left)} adapter "
                           "weights left out); was it saved from a model with other LoRA targets?")


def _copy(dest: torch.Tensor, value: torch.Tensor, name: str) -> None:
    if tuple(dest.shape) != tuple(value.shape):
        raise TiermoeError(f"adapter tensor for '{name}' has shape {list(value.shape)}, the model's is "
                           f"{list(dest.shape)}")
    dest.copy_(value.to(dest.device, dest.dtype))


def _expert_lora_for(experts: dict[int, ExpertLoRA], target: LoraTarget) -> ExpertLoRA:
    lora = experts.get(target.layer)
    if lora is None:
        raise TiermoeError(f"the adapter has LoRA on the routed experts of layer {target.layer}, which the model's "
                           "adapter does not cover")
    return lora


def _check_scaling(lora: ExpertLoRA, target: LoraTarget, where: str) -> None:
    """PEFT's scaling for a fused expert parameter (from the config's r / alpha / patterns) is the ExpertLoRA's."""
    mine = lora.scalings[EXPERT_PARAMS.index(target.param)]
    if abs(mine - target.scaling) > SCALING_TOLERANCE * max(abs(mine), 1.0):
        raise TiermoeError(f"{where}: PEFT gives layer {target.layer}'s {target.param} LoRA scaling "
                           f"{target.scaling:g}, tiermoe's expert LoRA has {mine:g} (rank_pattern / alpha_pattern "
                           "that tiermoe resolves differently)")


def _module_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The module adapters' tensors under the keys PEFT saves them with (none when only experts are adapted)."""
    if not hasattr(model, "peft_config"):
        return {}
    from peft import get_peft_model_state_dict  # the [train] extra

    state = get_peft_model_state_dict(model, adapter_name=ADAPTER)
    return {k: v.detach().cpu() for k, v in state.items() if ".lora_experts." not in k}


def _base_model(model: nn.Module) -> nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _model_config(model: nn.Module):
    return _base_model(model).config


def _auto_mapping(model: nn.Module, config) -> dict | None:
    """What PEFT records when the config has no task_type: the transformers class the adapter is for."""
    if config.task_type is not None:
        return None
    cls = type(_base_model(model))
    return {"base_model_class": cls.__name__, "parent_library": cls.__module__}
