"""Linear-attention layers in the ragged step: per-sequence state slots in the pool.

The modules served are those whose multi-token forward continues from the state it is handed
(tiermoe.arch.layer_caches.CONTINUING_STATE_MODULES: Qwen3-Next's gated DeltaNet and its kin, Bailing's and Kimi's
delta attention, Nemotron-H's Mamba-2). Such a layer keeps, per sequence, a conv state [C, K] and a recurrent state
(gated DeltaNet's [H, dk, dv]; Mamba-2's [H, d_head, d_state]) instead of
K/V per token. The pool reserves them once per layer for every sequence slot, twice (two banks): a step reads a
sequence's committed bank and writes the other, and `commit` flips the bank of the sequences whose step
succeeded. So a failed step leaves every state as it was (the engine re-runs parts of it), with no copy of the
state per step beyond what the layer reads and writes anyway.

Speculative decoding rolls states back the way SGLang and vLLM do for Mamba and gated-delta layers: a verify
segment (SeqFeed.verify: the last token and k drafts) asks the module for its state after each position
(transformers' `get_recurrent_states_to_keep`: the segment's recurrence then runs token by token, as plain decoding
does, and hands every intermediate state to `update_recurrent_state`; the conv state after each position is a
window of the conv's input). The banks get the state after the whole segment, and the others are kept beside them
until the sequence's next step: its feed's `past` says how many positions were kept (every rank sees the same
feeds, so followers roll back alike), and `rewind` copies the state after the last kept position into the
committed bank before that step reads it. The kept states are the module's own tensors: k states per layer and
verifying sequence, held for one step.

The layer itself stays transformers' module, its class swapped for a subclass (`use_ragged_linear_attention`,
weights and names untouched) whose forward runs all decode rows of the step at once, their states updated where
they lie (tiermoe.layers.gated_delta_decode, for modules laid out as Qwen3-Next's), and the original forward once
per longer segment (and for decode rows of any other layout), with a `SlotStates` as its cache: the cache methods
the original calls, on those slots.
Legend: b sequences of one call, C conv channels, K conv kernel, H value heads, dk/dv head dims.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tiermoe.arch.layer_caches import CONTINUING_STATE_MODULES
from tiermoe.layers.gated_delta_decode import decode_rows, decodes_in_place
from tiermoe.layers.paged_attention import STEP_KWARG, PagedStepCache
from tiermoe.layers.ragged_step import RowPart

BANKS = 2  # tiermoe.placement.kv_layout counts them (LINEAR_STATE_BANKS)


@dataclass
class VerifiedPositions:
    """A verify segment's states after each of its positions but the last (the banks hold that one), per layer."""

    start: int  # the segment's first position (its feed's past)
    length: int  # its positions (n)
    conv: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [n - 1, C, K]
    recurrent: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # layer -> n - 1 states [H, dk, dv]

    def state_after(self, kept: int) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """Each layer's conv and recurrent state once `kept` (1 .. n - 1) of the segment's positions are kept."""
        return ({layer: c[kept - 1] for layer, c in self.conv.items()},
                {layer: r[kept - 1] for layer, r in self.recurrent.items()})


class LinearStateSlots:
    """Every linear-attention layer's states for `num_slots` sequences, in two banks (index 2 * slot + bank)."""

    def __init__(self, num_slots: int, device: torch.device):
        self.num_slots = num_slots
        self.device = torch.device(device)
        self.conv: dict[int, torch.Tensor] = {}  # layer -> [2 * slots, C, K]
        self.recurrent: dict[int, torch.Tensor] = {}  # layer -> [2 * slots, H, dk, dv]
        self.bank = [0] * num_slots  # the committed bank of each slot
        self.has_state = [False] * num_slots  # a slot's sequence has run at least one step
        self.verified: dict[int, VerifiedPositions] = {}  # slot -> its last step's verify segment, if it had one
        self.staged: dict[int, VerifiedPositions] = {}  # the same, written by the forward under way

    def reset(self, slot: int) -> None:
        """A new sequence takes `slot` (or its sequence ended): it starts with no state."""
        self.has_state[slot] = False
        self.verified.pop(slot, None)
        self.staged.pop(slot, None)

    def rewind(self, feeds) -> None:
        """Before a step of `feeds` (tiermoe.layers.ragged_step.SeqFeed): a sequence whose last step verified drafts
        and kept fewer positions than it fed (its `past` ends inside that segment) continues from the state after
        its last kept position, copied into its committed bank. Clears what a failed forward staged."""
        self.staged.clear()
        for feed in feeds:
            verified = self.verified.pop(feed.slot, None)
            if verified is None:
                continue
            kept = feed.past - verified.start
            if not 0 < kept < verified.length:
                continue  # every position kept: the banks already hold its state
            if set(verified.conv) != set(self.conv) or set(verified.recurrent) != set(self.recurrent):
                raise RuntimeError("a linear-attention layer did not hand its state after each verified position "
                                   "(transformers >= 5.25 does); its drafts cannot be rolled back")
            conv, recurrent = verified.state_after(kept)
            index = 2 * feed.slot + self.bank[feed.slot]
            with torch.inference_mode():  # the stores are the forward's (inference) tensors
                for layer, state in conv.items():
                    self.conv[layer][index].copy_(state)
                for layer, state in recurrent.items():
                    self.recurrent[layer][index].copy_(state)

    def indices(self, slots: list[int]) -> tuple[list[int], list[int]]:
        """The states sequences in `slots` read (their committed banks) and write (the other banks) in a step."""
        read = [2 * s + self.bank[s] for s in slots]
        return read, [i ^ 1 for i in read]

    def commit(self, slots: list[int]) -> None:
        """The step that wrote these slots' other banks succeeded: those banks are now theirs (and the states a
        verify segment kept per position, until the next step)."""
        for s in slots:
            self.bank[s] ^= 1
            self.has_state[s] = True
            staged = self.staged.pop(s, None)
            if staged is not None:
                self.verified[s] = staged

    def nbytes(self) -> int:
        return sum(t.nbytes for store in (self.conv, self.recurrent) for t in store.values())

    def continues(self, layer: int, slots: list[int]) -> bool:
        """Whether every sequence in `slots` has states of `layer` to continue from."""
        return layer in self.conv and layer in self.recurrent and all(self.has_state[s] for s in slots)

    def conv_store(self, layer: int, like: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s conv states [2 * slots, C, K], reserved on first use like `like` [b, C, K]."""
        return self._reserve(self.conv, layer, like)

    def recurrent_store(self, layer: int, like: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s recurrent states [2 * slots, H, dk, dv], reserved on first use like `like`."""
        return self._reserve(self.recurrent, layer, like)

    def _reserve(self, stores: dict[int, torch.Tensor], layer: int, like: torch.Tensor) -> torch.Tensor:
        store = stores.get(layer)
        if store is None:
            store = stores[layer] = torch.zeros((BANKS * self.num_slots, *like.shape[1:]), dtype=like.dtype,
                                                device=self.device)
        return store


class SlotStates:
    """The cache a linear-attention forward of sequences in `slots` sees (the methods transformers' gated DeltaNet
    calls): their committed states, gathered; new states written to their other banks. `read` / `write` [b]: the
    states' indices (LinearStateSlots.indices), on the device, from the step (tiermoe.layers.ragged_step)."""

    def __init__(self, slots_store: LinearStateSlots, slots: list[int], read: torch.Tensor, write: torch.Tensor,
                 verify: tuple[int, int] | None = None):
        """`verify`: (first position, length) of a verify segment (one sequence) whose states after each position
        are kept (LinearStateSlots.staged); None for any other call."""
        self.store = slots_store
        self.fresh = not slots_store.has_state[slots[0]]
        if any(slots_store.has_state[s] == self.fresh for s in slots):
            raise ValueError("one linear-attention call mixes sequences with and without a state")
        if verify is not None and len(slots) != 1:
            raise ValueError(f"a verify segment is one sequence's, got {len(slots)} in one call")
        self.read, self.write = read, write
        self._handed_conv: dict[int, torch.Tensor] = {}
        self._verified, self._positions = None, 0
        if verify is not None:
            # one record per segment, filled layer by layer (`rewind` clears them before each step)
            self._verified = slots_store.staged.setdefault(slots[0], VerifiedPositions(*verify))
            self._positions = verify[1]

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        """A verify segment's state after every position (transformers >= 5.25 hands them as a list); else only
        the last."""
        return self._positions if self._verified is not None else 0

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        """transformers (>= 5.25) counts here the token a decode's in-place conv update saw; the engine counts each
        sequence's tokens itself."""

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        if self.fresh or layer_idx not in self.store.conv:
            return None
        # a one-token decode updates the state it is handed in place: hand a gathered copy, written back after
        conv = self._handed_conv[layer_idx] = self.store.conv[layer_idx].index_select(0, self.read)
        return conv

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        if self.fresh or layer_idx not in self.store.recurrent:
            return None
        return self.store.recurrent[layer_idx].index_select(0, self.read)

    def update_conv_state(self, conv_bCn: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs) -> torch.Tensor:
        """New inputs [b, C, n] -> the conv's input with its left context [b, C, K' + n]; keeps the last K."""
        self._handed_conv.pop(layer_idx, None)  # this call writes the new state itself
        store = self.store.conv.get(layer_idx)
        kernel = conv_kernel_size or store.shape[-1]
        if self.fresh or store is None:
            full = conv_bCn
            if full.shape[-1] < kernel:
                full = F.pad(full, (kernel - full.shape[-1], 0))
        else:
            full = torch.cat([store.index_select(0, self.read), conv_bCn], dim=-1)
        self.store.conv_store(layer_idx, full[..., -kernel:]).index_copy_(0, self.write, full[..., -kernel:])
        if self._verified is not None:
            n = self._positions
            padded = F.pad(full, (max(0, kernel + n - full.shape[-1]), 0))[0, :, -(kernel + n):]  # [C, K + n]
            # window j: the state after j of the new inputs; the segment keeps those after its positions 0..n-2
            self._verified.conv[layer_idx] = padded.unfold(-1, kernel, 1)[:, 1:n].transpose(0, 1).clone()
        return full

    def update_recurrent_state(self, state_bHkv: torch.Tensor | list[torch.Tensor], layer_idx: int,
                               state_idx: int = 0, **kwargs) -> torch.Tensor:
        """The state after the call's last token [b, H, dk, dv], or (a verify segment) after each of its tokens."""
        if not isinstance(state_bHkv, torch.Tensor):
            if self._verified is None:
                raise ValueError("a linear-attention layer handed intermediate states no verify segment asked for")
            self._verified.recurrent[layer_idx] = [s[0] for s in state_bHkv[:-1]]
            state_bHkv = state_bHkv[-1]
        self.store.recurrent_store(layer_idx, state_bHkv).index_copy_(0, self.write, state_bHkv)
        return state_bHkv

    def finish(self, layer_idx: int) -> None:
        """After the layer's forward: a conv state updated in place goes to the other banks."""
        conv = self._handed_conv.pop(layer_idx, None)
        if conv is not None:
            self.store.conv[layer_idx].index_copy_(0, self.write, conv)


class RaggedLinearAttention:
    """Mixin put in front of a transformers linear-attention class (see use_ragged_linear_attention)."""

    def forward(self, hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs):
        step = kwargs.pop(STEP_KWARG, None)
        if step is None or not isinstance(cache, PagedStepCache):
            return super().forward(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
        outputs, parts = [], step.row_parts
        decode = RowPart(first_feed=0, b=step.num_decode, q=1, rows=slice(0, step.num_decode))
        linear, layer = cache.linear, self.layer_idx
        if decode.b and decodes_in_place(self) and linear.continues(layer, [f.slot for f in step.feeds[:decode.b]]):
            # every decode row at once, states updated in place (the decode runs split by past length matter
            # to softmax attention only)
            outputs.append(decode_rows(self, hidden_states[0, decode.rows], linear.conv[layer], linear.recurrent[layer],
                                       *step.state_rows(decode), step.decode_attention))
            parts = [p for p in parts if p.first_feed >= decode.b]
        for part in parts:
            feeds = step.feeds[part.first_feed:part.first_feed + part.b]
            verify = (feeds[0].past, part.q) if part.b == 1 and feeds[0].verify else None
            states = SlotStates(cache.linear, [f.slot for f in feeds], *step.state_rows(part), verify)
            x = hidden_states[0, part.rows].unflatten(0, (part.b, part.q))  # [b, q, D]
            outputs.append(super().forward(x, cache=states, attention_mask=None, **kwargs).flatten(0, 1))
            states.finish(self.layer_idx)
        return torch.cat(outputs)[None]


def use_ragged_linear_attention(model) -> int:
    """Swap the class of every linear-attention module of `model` for its ragged-step subclass; returns how many."""
    swapped = 0
    for module in model.modules():
        cls = type(module)
        if cls.__name__.endswith(CONTINUING_STATE_MODULES) and not isinstance(module, RaggedLinearAttention):
            module.__class__ = _ragged_class(cls)
            swapped += 1
    return swapped


@functools.cache  # one subclass per original class, so every swapped module shares it
def _ragged_class(cls: type) -> type:
    return type(f"Ragged{cls.__name__}", (RaggedLinearAttention, cls), {"original_class": cls})
