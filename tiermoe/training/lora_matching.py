"""PEFT's rules for which names a LoraConfig reaches, and with which rank and alpha, applied to parameters too.

PEFT matches `target_modules` against module names (a full name, or its end after a dot; exclusions first; a name
end only within `layers_to_transform` / `layers_pattern`) and `target_parameters` against parameter names (a full
name or its end, nothing else). A hybrid model's routed experts are parameters PEFT never sees, so tiermoe matches
them here with the module rule, so the layer filters and exclusions reach them as they reach modules. Ranks and
alphas come from `rank_pattern` / `alpha_pattern`, the first pattern that ends the full name winning, as in PEFT.
"""

from __future__ import annotations

import copy
import re

from torch import nn

from tiermoe.errors import TiermoeError


def named_by(entry: str, key: str) -> bool:
    """PEFT's rule for a target_parameters entry: the full name, or its end after a dot."""
    return key == entry or key.endswith(f".{entry}")


def excluded(config, key: str) -> bool:
    """PEFT's exclude_modules rule (a regex matching the whole name, or names / name ends)."""
    exclude = config.exclude_modules
    if not exclude:
        return False
    if isinstance(exclude, str):
        return re.fullmatch(exclude, key) is not None
    return key in exclude or any(key.endswith(f".{e}") for e in exclude)


def targeted(config, entries: list[str], key: str, module: str) -> bool:
    """Whether the parameter `key` of `module` gets LoRA: PEFT's rule for target_modules (exclusions first, a full
    name always, a name end within layers_to_transform / layers_pattern), applied to a parameter."""
    if not entries or excluded(config, module) or excluded(config, key):
        return False
    from peft.tuners.tuners_utils import check_target_module_exists

    probe = copy.copy(config)
    probe.target_modules, probe.exclude_modules, probe.modules_to_save = set(entries), None, None
    return bool(check_target_module_exists(probe, key))


def pattern_value(patterns: dict | None, key: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup (the first key whose regex ends the full name wins)."""
    return next((v for p, v in (patterns or {}).items() if re.match(rf"(.*\.)?({p})$", key)), default)


def module_targets(config, model: nn.Module) -> list[str]:
    """Names of the modules and non-expert parameters PEFT may wrap for `config` on `model`."""
    from peft.tuners.tuners_utils import check_target_module_exists

    names = [n for n, _ in model.named_modules() if n and config.target_modules
             and check_target_module_exists(config, n)]
    return names + list(config.target_parameters or ())


def pin_patterns(config, keys: list[str]) -> None:
    """Make `config`'s rank_pattern / alpha_pattern give every target in `keys` the same value in any key order.

    PEFT takes the first pattern that matches a name, and writes adapter_config.json with its keys sorted, so a
    saved config can resolve differently from the one trained with (PEFT's own `.*\\.gate_up_proj`, added by its
    transformers-5 mapping, sorts before a layer's own pattern). Where the sorted order would change a value, the
    target's own name is added as a pattern that sorts first ("(" before "." and letters)."""
    for field, default in (("rank_pattern", config.r), ("alpha_pattern", config.lora_alpha)):
        patterns = dict(getattr(config, field) or {})
        want = {key: pattern_value(patterns, key, default) for key in keys}
        pins = {f"({re.escape(k)})": v for k, v in want.items()
                if pattern_value(dict(sorted(patterns.items())), k, default) != v}
        if not pins:
            continue
        patterns.update(pins)
        unsure = [k for k, v in want.items() if pattern_value(dict(sorted(patterns.items())), k, default) != v]
        if unsure:
            raise TiermoeError(f"LoraConfig {field}: '{unsure[0]}' gets another value once PEFT saves the patterns "
                               "sorted; give it a pattern of its own that no other pattern overlaps")
        setattr(config, field, patterns)


def filtered_parameters(config, model: nn.Module, entries: list[str]) -> list[str]:
    """Non-expert target_parameters (routers) with exclusions and layer filters applied as for modules: the entries
    as given when that changes nothing, else the chosen parameters by name."""
    if not entries or not (config.exclude_modules or config.layers_to_transform is not None):
        return entries
    reached, kept = [], []
    for module_name, module in model.named_modules():
        for name, _ in module.named_parameters(recurse=False):
            key = f"{module_name}.{name}"
            if any(named_by(e, key) for e in entries):
                reached.append(key)
                if targeted(config, entries, key, module_name):
                    kept.append(key)
    return entries if kept == reached else kept
