"""What a family's default config leaves to its releases, and the MoE path turned on where a default is dense.

transformers' default config of a family is not always one that builds its MoE model: DeepSeek-V2's and dots.llm1's
leave the routed top-k or the expert count None, Hunyuan-MoE's its head dim, and Gemma-4's text config is dense
unless `enable_moe_block` is set, as its MoE releases set it. To read such a family's structure (the
architectures page, tiermoe.model.catalogue; the zoo's tiny configs, tiermoe.testing.tiny_configs) those fields get
a stand-in value and the MoE switches are turned on; both name what they changed, so nothing passes for a
release's value.
"""

from __future__ import annotations

import re
from collections.abc import Callable

# Fields a default may leave None that the MoE path needs: expert counts, top-k, groups, shared experts, head dim.
UNSET_BY_DEFAULT = re.compile(r"experts|intermediate_size|^(n_group|topk_group|top_k_experts|head_dim)$")
MOE_SWITCH = re.compile(r"^(enable_moe|use_moe)\w*$")


def with_moe_path(fields: dict, stand_in: Callable[[str], int | None]) -> tuple[dict, list[str]]:
    """(`fields` with each UNSET_BY_DEFAULT field that is None set to `stand_in(name)` and each MOE_SWITCH that is
    False set True, the names changed). Nested dicts (sub-configs) are left as they are."""
    out, changed = dict(fields), []
    for key, value in fields.items():
        if value is None and UNSET_BY_DEFAULT.search(key) and stand_in(key) is not None:
            out[key] = stand_in(key)
            changed.append(key)
        elif value is False and MOE_SWITCH.match(key):
            out[key] = True
            changed.append(key)
    return out, changed
