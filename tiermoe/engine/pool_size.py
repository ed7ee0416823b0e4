"""How many tokens the KV pool holds when no --max-total-tokens is given: what the device's free memory allows.

The pool is reserved once, so its size is decided once, after the weights are in place: a share of the memory
still free on the pool's device (the GPU's free memory; on CPU-only runs the RAM the kernel says is available,
of which the pool takes less, since the CPU experts' working memory and the rest of the machine live there too),
and never more than every running sequence at the model's full context could use.
"""

from __future__ import annotations

import torch

from tiermoe.errors import TiermoeError
from tiermoe.layers.paged_attention import LINEAR
from tiermoe.placement.free_memory import device_free_bytes
from tiermoe.placement.kv_layout import kv_layout

GPU_SHARE = 0.85  # of the GPU memory free after loading (activations and the CUDA context take the rest)
HOST_SHARE = 0.5  # of the available RAM on a CPU-only run
UNKNOWN_CONTEXT = 32768  # tokens per sequence when the config states no context length
MIN_TOKENS = 256


def auto_pool_tokens(config, dtype: torch.dtype, layer_windows: dict, max_running: int, max_context: int | None,
                     device: torch.device) -> int:
    """Tokens of full-attention KV the pool holds (see the module docstring)."""
    layout = kv_layout(config, dtype.itemsize)
    per_token = layout.full_per_token + layout.sliding_per_token  # sliding groups are at most as large
    wanted = max_running * (max_context or UNKNOWN_CONTEXT)
    free = device_free_bytes(device)
    if free is None or per_token == 0:
        return wanted
    share = GPU_SHARE if torch.device(device).type == "cuda" else HOST_SHARE
    budget = int(free * share) - max_running * layout.linear_state * 2  # linear states: two banks per slot
    tokens = min(wanted, budget // per_token)
    if tokens < MIN_TOKENS:
        kinds = "" if LINEAR not in layer_windows.values() else " and linear-attention states"
        raise TiermoeError(f"{device} has {free / 2**30:.2f} GiB free: too little for a KV pool of "
                           f"{MIN_TOKENS} tokens ({per_token:,} bytes each{kinds}); free memory or lower "
                           f"--max-running-requests")
    return tokens
