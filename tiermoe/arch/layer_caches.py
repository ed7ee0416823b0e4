"""What each decoder layer's cache holds, read from its modules built on the meta device (tiermoe.arch.discover).

An attention layer adds per token what its key and value projections produce (per-layer head counts and value head
dims count as built), or for MLA the latent and the roped key (tiermoe caches the latent). A linear-attention layer
keeps per sequence a conv state and a recurrent state: their shapes are what the module hands its cache, seen by
running its own forward once on meta tensors (no memory, no arithmetic) with a cache that records them.
Linear-attention modules whose multi-token forward continues from the state it is handed (CONTINUING_STATE_MODULES,
each checked against transformers in the zoo) keep their states in the engine's pool. Not Jamba's Mamba: its decoder
layer calls the mixer without the step's arguments (the ragged step cannot reach it), and its multi-token scan
does not start from a past state (transformers' own note); nor MiniMax's lightning attention, whose state goes
through another cache interface (get_linear_cache / set_linear_cache).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

# Attention-like children of a decoder layer, whose class names the layer's kind (first found wins).
MIXER_NAMES = ("self_attn", "linear_attn", "attention", "attn", "mixer", "mamba", "conv", "short_conv")
# Class-name suffixes of the linear-attention modules the engine's pool keeps states for (tiermoe.layers
# .linear_attention_slots): the gated DeltaNets (Qwen3-Next, Qwen3.5, Lara), Bailing's and Kimi's delta attention,
# Nemotron-H's Mamba-2.
CONTINUING_STATE_MODULES = ("GatedDeltaNet", "BailingHybridDeltaAttention", "KimiLinearDeltaAttention",
                            "NemotronHMamba2Mixer")


@dataclass(frozen=True)
class StateSize:
    """One linear-attention layer's state per sequence: conv elements (in the compute dtype) and recurrent
    elements, in fp32 (`recurrent_fp32`) or in the compute dtype."""

    conv: int
    recurrent: int
    recurrent_fp32: bool

    def nbytes(self, dtype_bytes: int) -> int:
        return self.conv * dtype_bytes + self.recurrent * (4 if self.recurrent_fp32 else dtype_bytes)


def kv_widths(layers: nn.ModuleList) -> tuple[tuple[int | None, ...], ...]:
    """Per decoder layer, per attention module in it (one, or each of a list: LongCat-Flash's two), the elements one
    token adds to its cache as the engine's KV pool keeps them: key and value widths (`k_proj` + `v_proj` out
    features), or for MLA the latent and the roped key (`kv_a_proj_with_mqa`'s out features). None where the module
    does not show them (a fused qkv projection)."""
    widths = []
    for layer in layers:
        attn = mixer(layer)
        widths.append(tuple(_kv_width(a) for a in (attn if isinstance(attn, nn.ModuleList) else [attn])))
    return tuple(widths)


def linear_states(layers: nn.ModuleList, kinds: tuple[str, ...], hidden_size: int) -> tuple[StateSize | None, ...]:
    """Per decoder layer, the state its linear-attention module (`kinds`: tiermoe.arch.discover.layer_kinds) hands a
    cache for a hidden state [1, n, hidden_size]; None for other layers and for a module whose forward does not run
    on a hidden state and a cache alone. One probe per module class and shape."""
    sizes, seen = [], {}
    for layer, kind in zip(layers, kinds):
        module = mixer(layer) if kind.startswith("linear_attention") else None
        key = (type(module), tuple((n, tuple(p.shape)) for n, p in module.named_parameters())) if module else None
        if key is not None and key not in seen:
            seen[key] = _probe(module, hidden_size)
        sizes.append(seen.get(key))
    return tuple(sizes)


def mixer(layer: nn.Module) -> nn.Module | None:
    """The decoder layer's attention-like child (attention, linear attention, Mamba, conv), if any."""
    return next((c for n, c in layer.named_children() if n in MIXER_NAMES), None)


def _kv_width(attn: nn.Module | None) -> int | None:
    mla, k, v = (getattr(attn, name, None) for name in ("kv_a_proj_with_mqa", "k_proj", "v_proj"))
    if isinstance(mla, nn.Linear):
        return mla.out_features
    if isinstance(k, nn.Linear) and isinstance(v, nn.Linear):
        return k.out_features + v.out_features
    return None


class _RecordingCache:
    """The cache methods a linear-attention forward calls (those tiermoe.layers.linear_attention_slots.SlotStates
    answers), for a first chunk: no state yet; the conv's last kernel columns and the recurrent state recorded."""

    def __init__(self):
        self.conv: torch.Tensor | None = None
        self.recurrent: torch.Tensor | None = None

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        return 0

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        pass

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> None:
        return None

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> None:
        return None

    def update_conv_state(self, conv_bCn: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs) -> torch.Tensor:
        self.conv = conv_bCn[..., -(conv_kernel_size or conv_bCn.shape[-1]):]
        return conv_bCn

    def update_recurrent_state(self, state: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        self.recurrent = state
        return state


_PROBE_TOKENS = 4  # a chunk at least as long as any conv kernel tiermoe has met (4)


def _probe(module: nn.Module, hidden_size: int) -> StateSize | None:
    """The state `module`'s forward hands a cache for one sequence, run on meta tensors in bf16 (so a recurrent state
    kept in fp32 shows as fp32)."""
    twin = copy.deepcopy(module).to(device="meta", dtype=torch.bfloat16)
    cache = _RecordingCache()
    x = torch.empty(1, _PROBE_TOKENS, hidden_size, device="meta", dtype=torch.bfloat16)
    try:
        with torch.no_grad():
            twin(x, cache=cache)
    except (TypeError, RuntimeError, ValueError, AttributeError, IndexError, NotImplementedError):
        return None
    if cache.recurrent is None:
        return None
    conv = cache.conv.shape[1:].numel() if cache.conv is not None else 0
    return StateSize(conv, cache.recurrent.shape[1:].numel(), cache.recurrent.dtype == torch.float32)
