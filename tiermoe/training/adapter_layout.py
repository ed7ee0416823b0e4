"""Where every tensor of a PEFT LoRA adapter goes, as PEFT itself decides it for the unmodified transformers model.

PEFT resolves an adapter config against a model: which modules and parameters it wraps (after its transformers-5
name mapping), each wrapper's rank and scaling (rank_pattern / alpha_pattern / rslora), and the names its tensors
are saved under. Fused expert parameters are wrapped one inside the other (a ParamWrapper per parameter), so their
keys depend on the nesting: `mlp.experts.base_layer.lora_A.weight` is gate_up_proj, `mlp.experts.lora_A.weight`
down_proj. Rather than re-derive those rules, `adapter_layout` lets PEFT build the wrappers on a skeleton of the
model whose tensors are all on the meta device (about a second for a full-size model) and reads them off, so saving,
loading and merging all follow the PEFT installed; adapters trained on transformers 4 (per-expert keys) are
converted by PEFT's own conversion, as PEFT's loading does.
"""

from __future__ import annotations

import copy
import re
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from tiermoe.errors import TiermoeError
from tiermoe.model.skeleton import build_skeleton
from tiermoe.training.lora_fields import check_lora_config

EXPERT_PARAMS = ("gate_up_proj", "down_proj")  # transformers' fused routed-expert parameters
PEFT_PREFIX = "base_model.model."  # what PeftModel puts before the transformers model's own names
ADAPTER = "default"  # the adapter name PEFT uses in memory (never on disk)


@dataclass(frozen=True)
class LoraTarget:
    """One LoRA wrapper: `module`'s parameter `param` (transformers names) gets scaling * B @ A (per expert when
    `num_experts` > 1: A [r*E, in], B [out, r*E], PEFT's ParamWrapper layout)."""

    key: str  # saved tensors are f"{key}.lora_A.weight" and f"{key}.lora_B.weight"
    module: str  # e.g. "model.layers.0.self_attn.q_proj" or "model.layers.0.mlp.experts"
    param: str  # "weight" for a Linear; the wrapped parameter's name for a ParamWrapper
    rank: int
    scaling: float
    num_experts: int
    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]

    @property
    def is_experts(self) -> bool:
        return self.num_experts > 1 and self.param in EXPERT_PARAMS

    @property
    def layer(self) -> int | None:
        found = re.search(r"\.layers\.(\d+)\.", f".{self.module}.")
        return int(found.group(1)) if found else None

    def tensor_keys(self) -> tuple[str, str]:
        return f"{self.key}.lora_A.weight", f"{self.key}.lora_B.weight"


@dataclass
class AdapterLayout:
    """PEFT's wrappers for one adapter config on one model: `targets` {key: LoraTarget}, and `convert`, which
    brings an adapter's tensors into them the way PEFT's loading does."""

    targets: dict[str, LoraTarget]
    peft_model: nn.Module  # PEFT's model of the meta skeleton (no memory behind it)

    def convert(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`tensors` as PEFT loads them on transformers 5: an adapter trained on transformers 4 (per-expert keys,
        experts.{e}.gate_proj / up_proj / down_proj) has them concatenated and stacked into the fused layout; one
        already in it is returned as it is."""
        try:
            from peft.utils.transformers_weight_conversion import convert_peft_adapter_state_dict_for_transformers
        except ImportError:  # a PEFT without transformers 5 conversions loads the tensors as they are
            return tensors
        config = self.peft_model.peft_config[ADAPTER]
        try:
            return convert_peft_adapter_state_dict_for_transformers(self.peft_model, config, tensors, ADAPTER)
        except (ValueError, RuntimeError, KeyError) as e:
            raise TiermoeError(f"PEFT cannot convert the adapter's tensors to this model's layout: {_one_line(e)}") \
                from None


def adapter_layout(model_config, lora_config) -> AdapterLayout:
    """PEFT's wrappers for `lora_config` (a peft.LoraConfig) applied to the transformers model of `model_config`,
    as PEFT applies it. A config PEFT refuses, or one with parts tiermoe cannot handle, is a TiermoeError."""
    from peft import get_peft_model  # the [train] extra
    from peft.tuners.lora import LoraLayer

    check_supported(lora_config)
    config = copy.deepcopy(lora_config)
    config.inference_mode = True
    skeleton = build_skeleton(model_config, torch.float32)
    try:
        with warnings.catch_warnings():
            # PEFT's own note on its own fused-expert patterns: the gate_up_proj wrapper is the inner one, so its
            # check finds no module named like the pattern, after applying the pattern's rank all the same
            warnings.filterwarnings("ignore", message=r"The following (rank|alpha)_pattern keys did not match")
            # low_cpu_mem_usage: the wrappers' factors are created on the meta device too (seconds, not minutes)
            peft_model = get_peft_model(skeleton, config, low_cpu_mem_usage=True)
    except (ValueError, TypeError, KeyError) as e:
        raise TiermoeError(f"PEFT cannot apply the adapter config to this {model_config.model_type} model: "
                           f"{_one_line(e)}") from None
    targets = {}
    for name, module in peft_model.named_modules():
        if not isinstance(module, LoraLayer) or ADAPTER not in getattr(module, "lora_A", {}):
            continue
        if ADAPTER in getattr(module, "lora_embedding_A", {}):
            raise TiermoeError(f"the adapter puts LoRA on the embedding '{name.removeprefix(PEFT_PREFIX)}'; "
                               "tiermoe handles LoRA on linear layers and parameters only")
        param = getattr(module, "parameter_name", "weight")
        base = re.sub(r"(\.base_layer)+$", "", name.removeprefix(PEFT_PREFIX))
        a, b = module.lora_A[ADAPTER].weight, module.lora_B[ADAPTER].weight
        targets[name] = LoraTarget(name, base, param, int(module.r[ADAPTER]), float(module.scaling[ADAPTER]),
                                   int(getattr(module, "num_experts", 1)), tuple(a.shape), tuple(b.shape))
    if not targets:
        raise TiermoeError(f"the adapter config targets nothing in this {model_config.model_type} model")
    return AdapterLayout(targets, peft_model)


def check_supported(lora_config) -> None:
    """A one-line error for a PEFT config that is not plain LoRA (or uses a LoRA option tiermoe does not handle)."""
    kind = str(getattr(getattr(lora_config, "peft_type", None), "value", getattr(lora_config, "peft_type", None)))
    if kind != "LORA":
        raise TiermoeError(f"the adapter is a PEFT {kind} adapter; tiermoe handles LoRA adapters (peft_type LORA)")
    # every other field as tiermoe.training.lora_fields' table says (a saved adapter's initialisation is not rerun)
    check_lora_config(lora_config, adapts_parameters=bool(getattr(lora_config, "target_parameters", None)),
                      reading=True)


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())
