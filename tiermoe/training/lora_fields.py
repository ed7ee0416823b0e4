"""Every field of PEFT's LoraConfig, and what a hybrid model does with it: honoured for attention, dense and
routed-expert LoRA alike, or refused in one line naming the field.

Module LoRA (attention, dense projections, shared experts, the router) is PEFT's own `get_peft_model` on the hybrid
model's module tree, so PEFT honours its fields there; the routed experts live in the tiers, where tiermoe's
ExpertLoRA (tiermoe.training.lora) takes over from PEFT's `ParamWrapper`. A field is honoured when both do what
PEFT does with it on the unmodified transformers model; a field one of them cannot honour (an initialisation that
reads the frozen weight, DoRA, dropout on a fused expert parameter, which PEFT refuses too) is refused, whatever
it would have touched, so an adapter trained here always loads in PEFT and computes the same there. The table
names every field of the PEFT this was written against; a field it does not name (a newer PEFT) is refused when
set to anything but its default, rather than silently ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from tiermoe.errors import TiermoeError

# initialisations tiermoe gives every LoRA factor as PEFT does (True: Kaiming-uniform A, zero B; False: both as
# nn.Linear's default; "gaussian": normal A with std 1/r, zero B); the others read the frozen weight or data
INITS = (True, False, "gaussian")
# initialisations that change the frozen weights too (the adapter alone no longer reproduces the model)
WEIGHT_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga", "astra")


@dataclass(frozen=True)
class Use:
    """How a config is used: whether LoRA goes on parameters (routed experts, routers: PEFT's target_parameters)
    rather than modules only, and whether it is a saved adapter's (read, not initialised)."""

    adapts_parameters: bool
    reading: bool = False


@dataclass(frozen=True)
class FieldRule:
    """`refuses(value, use)` says why a value cannot be honoured (None: it is)."""

    how: str  # what tiermoe does with the field, in words
    refuses: Callable[[object, Use], str | None] = (lambda value, use: None)


def _set(what: str) -> Callable[[object, Use], str | None]:
    return lambda value, use: what if value not in (None, False, {}, [], ()) else None


def _init(value, use: Use) -> str | None:
    if value in INITS:
        return None
    if use.reading and not str(value).startswith(WEIGHT_CHANGING_INITS):
        return None  # a saved adapter's factors are read, not initialised
    return (f"initialisation {value!r} reads or changes the frozen weights, which the routed experts keep in their "
            f"tiers; expected one of {', '.join(repr(v) for v in INITS)}")


def _peft_type(value, use: Use) -> str | None:
    kind = str(getattr(value, "value", value))
    return None if kind == "LORA" else f"a PEFT {kind} config; tiermoe handles LoRA (peft_type LORA)"


def _dropout(value, use: Use) -> str | None:
    if value and use.adapts_parameters:
        return ("PEFT adapts parameters (routed experts, routers: target_parameters) without dropout and refuses "
                "such a config, so the adapter could not load in PEFT; set lora_dropout=0, or adapt only modules "
                "(target_modules without expert projections, experts=False)")
    return None


def _bias(value, use: Use) -> str | None:
    if value != "none":
        return ("it trains the frozen biases, which adapter files and merging do not carry (and the routed "
                "experts' stay in their tiers); expected 'none'")
    return None


_METADATA = "metadata, saved with the adapter as PEFT saves it"

FIELDS: dict[str, FieldRule] = {
    # what the adapter is and where it came from
    "task_type": FieldRule(_METADATA),
    "peft_type": FieldRule("LORA only", _peft_type),
    "auto_mapping": FieldRule(_METADATA),
    "peft_version": FieldRule(_METADATA),
    "base_model_name_or_path": FieldRule(_METADATA),
    "revision": FieldRule(_METADATA),
    "inference_mode": FieldRule("True freezes every adapter weight, expert LoRA included"),
    "runtime_config": FieldRule("runtime only, never saved (PEFT's ephemeral GPU offload is for DoRA)"),
    # which weights get LoRA
    "target_modules": FieldRule("PEFT's matching, with its transformers-5 mapping of v4 expert names onto the fused "
                                "expert parameters"),
    "target_parameters": FieldRule("fused routed-expert parameters get tiermoe's ExpertLoRA, any other parameter "
                                   "(the router) PEFT's ParamWrapper"),
    "exclude_modules": FieldRule("excludes modules and, by the module that holds them, parameters: expert LoRA too"),
    "layers_to_transform": FieldRule("restricts modules and parameters alike, expert LoRA too (saved with the "
                                     "layers' parameter names, which PEFT honours)"),
    "layers_pattern": FieldRule("the layer list layers_to_transform counts in, for modules and parameters alike"),
    # the factors
    "r": FieldRule("rank of every target"),
    "lora_alpha": FieldRule("alpha of every target"),
    "rank_pattern": FieldRule("per-target ranks, matched on the full name (per layer for expert LoRA)"),
    "alpha_pattern": FieldRule("per-target alphas, matched on the full name (per layer for expert LoRA)"),
    "use_rslora": FieldRule("scaling alpha / sqrt(r) everywhere"),
    "init_lora_weights": FieldRule("True, False and 'gaussian' as PEFT initialises them, expert LoRA too", _init),
    "lora_dropout": FieldRule("PEFT's dropout on module LoRA; refused with LoRA on parameters", _dropout),
    "fan_in_fan_out": FieldRule("refused: no tiermoe model has Conv1D layers",
                                _set("fan_in_fan_out is for Conv1D layers (GPT-2), which no MoE model here has")),
    "bias": FieldRule("'none' only", _bias),
    # beyond plain LoRA
    "use_dora": FieldRule("refused", _set("DoRA needs the frozen weight's norm, which the routed experts keep in "
                                          "their tiers; expected plain LoRA")),
    "lora_bias": FieldRule("refused", _set("LoRA biases are not carried by expert LoRA or merging")),
    "modules_to_save": FieldRule("refused", _set("fully trained modules are not LoRA: adapter files and merging "
                                                 "carry LoRA factors only")),
    "trainable_token_indices": FieldRule("refused", _set("trainable tokens are not LoRA factors")),
    "layer_replication": FieldRule("refused", _set("layer replication changes the model's layer list, which the "
                                                   "tiers are built for")),
    "megatron_config": FieldRule("refused", _set("Megatron parallel layers are not tiermoe's")),
    "megatron_core": FieldRule("read by PEFT with megatron_config only (refused)"),
    "loftq_config": FieldRule("read by PEFT with init_lora_weights='loftq' only (refused)"),
    "eva_config": FieldRule("read by PEFT with init_lora_weights='eva' only (refused)"),
    "corda_config": FieldRule("read by PEFT with init_lora_weights='corda' only (refused)"),
    "lora_ga_config": FieldRule("read by PEFT with init_lora_weights='lora_ga' only (refused)"),
    "astra_config": FieldRule("read by PEFT with init_lora_weights='astra' only (refused)"),
    "velora_config": FieldRule("refused", _set("VeLoRA is a LoRA variant expert LoRA does not implement")),
    "alora_invocation_tokens": FieldRule("refused", _set("activated LoRA switches the adapter per token, which "
                                                         "expert LoRA and merging do not")),
    "use_qalora": FieldRule("refused", _set("QA-LoRA is for GPTQ-quantised layers")),
    "qalora_group_size": FieldRule("read by PEFT with use_qalora only (refused)"),
    "monteclora_config": FieldRule("refused", _set("MonteCLoRA is a LoRA variant expert LoRA does not implement")),
    "use_bdlora": FieldRule("refused", _set("block-diagonal LoRA is a variant expert LoRA does not implement")),
    "arrow_config": FieldRule("refused", _set("Arrow routing between adapters is not supported")),
    "kasa_config": FieldRule("refused", _set("KaSA reads the frozen weight's singular values")),
    "ensure_weight_tying": FieldRule("PEFT's, for tied modules (routed experts are never tied)"),
}


def check_lora_config(config, adapts_parameters: bool, reading: bool = False) -> None:
    """A one-line TiermoeError for the first field of `config` (a peft.LoraConfig) a hybrid model cannot honour.

    adapts_parameters: whether LoRA goes on parameters (routed experts, routers) rather than modules only; reading:
    the config of a saved adapter (its initialisation is not run again)."""
    use = Use(adapts_parameters, reading)
    for f in dataclasses.fields(config):
        value = getattr(config, f.name, None)
        rule = FIELDS.get(f.name)
        if rule is None:
            if value != _default(f):
                raise TiermoeError(f"LoraConfig field {f.name}={value!r} is one tiermoe does not know (a newer PEFT?);"
                                   " leave it at its default")
            continue
        why = rule.refuses(value, use)
        if why:
            raise TiermoeError(f"LoraConfig {f.name}={_short(value)}: {why}")


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
