"""MTP drafting (`--speculative-algorithm nextn`): drafts from the checkpoint's multi-token-prediction layer
(tiermoe.layers.mtp_module), verified by the engine like any draft.

The MTP layer's entry at position i reads the target's hidden state at i and the token at i + 1, so it can be
computed once the token after a position is known. Every step therefore ends with an "extend" (SGLang's draft
extend): for each sequence of the step, the MTP layer runs over the positions the step kept (a prompt chunk's, a
plain decode's one, a verify step's accepted ones and the last), with the target's final hidden states of those
rows (taken from the model's last norm as the forward ran) and the tokens one ahead. Its K/V go to the pool's
layer N at those positions, in the sequence's own pages: after every step the MTP layer holds exactly the
positions the target holds, so rejected drafts are undone for it as for every layer (the fed count goes back,
the next extend writes there first). The extend's last row gives the first draft token of the next step (greedy).

A draft of k > 1 chains the layer k - 1 more times in the next step's scheduling, one row per sequence and
round: the previous round's token and output hidden state at the next position. Those rounds write MTP K/V past
the kept positions, into pages taken for the rounds and handed back right after (the next extend overwrites those
positions with the real entries before anything reads them), so drafting never holds pages a scheduled feed
needs. Draft tokens are greedy: a deterministic draft is verified by the same rejection rule as an n-gram's, so
sampled sequences keep their distribution.

A failure of the layer (its forward raised) stops drafting for the engine's life, with one warning: the sequences
decode on, their output unchanged. A sequence drafts only while its MTP entries are whole: after a preemption its
prompt and output are recomputed as chunks, each extended in turn, before it drafts again. Entries can be stale
without harm to the output (drafts are verified; only acceptance suffers): a prefix reused from another sequence
holds that sequence's entry at its last position (computed with the token that followed there), and a forward that
failed for some sequences leaves theirs unwritten.
Legend: T rows of a step, D hidden, V vocabulary.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from tiermoe.engine.sequence import Sequence
from tiermoe.engine.speculative_config import SpeculativeConfig
from tiermoe.engine.speculative_drafting import Drafter
from tiermoe.engine.speculative_length import StepCost
from tiermoe.engine.speculative_timing import MeasuredStepCost
from tiermoe.experts.threads import torch_threads
from tiermoe.layers.mtp_module import MTPModule
from tiermoe.layers.paged_attention import PagedStepCache
from tiermoe.model.mtp_loader import load_mtp_module

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftStart:
    """Where a sequence's next draft starts: its fed count when the extend ran, the first drafted token and the
    MTP output hidden state [D] that chains to the second."""

    fed: int
    token: int
    hidden_D: torch.Tensor


def make_drafter(config: SpeculativeConfig, cost: StepCost | MeasuredStepCost, max_context: int | None,
                 hybrid) -> Drafter:
    """The drafter `config.algorithm` names: n-gram lookup, or the checkpoint's MTP layer (loaded here)."""
    if config.algorithm == "nextn":
        return MTPDrafter(config, cost, max_context, hybrid, load_mtp_module(hybrid))
    return Drafter(config, cost, max_context)


class MTPDrafter(Drafter):
    def __init__(self, config: SpeculativeConfig, cost: StepCost | MeasuredStepCost, max_context: int | None,
                 hybrid, module: MTPModule):
        super().__init__(config, cost, max_context)
        self.hybrid, self.module = hybrid, module
        self.pool = None  # the engine's KV pool (attach)
        self.starts: dict[int, DraftStart] = {}  # seq_id -> its next draft's start
        self._rows: dict[int, tuple[int, torch.Tensor]] = {}  # seq_id -> (first position, target hidden [n, D])
        self._hidden_1TD: torch.Tensor | None = None  # the last forward's final hidden states
        self.failed: str | None = None  # why the layer failed to run, once it did: no drafts after that
        self._hook = hybrid.model.model.norm.register_forward_hook(self._keep_hidden)

    def _keep_hidden(self, module, args, output) -> None:
        self._hidden_1TD = output

    def pool_layers(self, windows: dict) -> dict:
        return {**windows, self.module.layer_idx: None}  # the MTP layer's K/V: full attention, one more layer

    def attach(self, pool) -> None:
        self.pool = pool

    def close(self) -> None:
        self._hook.remove()

    def room(self, seq: Sequence) -> int:
        if self.failed is not None:
            return 0
        start = self.starts.get(seq.seq_id)
        return super().room(seq) if start is not None and start.fed == seq.num_fed else 0

    def lookup_limits(self, rooms: list[int], chosen: list[int]) -> list[int]:
        return chosen  # every drafted token costs an MTP round: draft only what the cost model chose

    def forwarded(self, seqs: list[Sequence], inputs: list[list[int]]) -> None:
        """A forward of the target ran for `seqs` (in its row order) feeding `inputs`: keep their hidden rows."""
        hidden, self._hidden_1TD = self._hidden_1TD, None
        if hidden is None:  # a forward that never reached the model's last norm: nothing to extend from
            return
        row = 0
        for seq, fed in zip(seqs, inputs, strict=True):
            self._rows[seq.seq_id] = (seq.num_fed, hidden[0, row:row + len(fed)])
            row += len(fed)

    def stepped(self, batch: list[Sequence]) -> None:
        """The step's tokens are taken: extend the MTP layer over every kept position of the step's running
        sequences, and note where each decoding one's next draft starts."""
        rows, self._rows = self._rows, {}
        if self.failed is not None:
            return
        work = []
        for seq in batch:
            self.starts.pop(seq.seq_id, None)
            if seq.seq_id in rows and not seq.finished:
                start, hidden_nD = rows[seq.seq_id]
                if seq.num_fed > start:
                    work.append((seq, start, seq.known_ids[start + 1:seq.num_fed + 1], hidden_nD[:seq.num_fed - start]))
        if not work:
            return
        work.sort(key=lambda w: (len(w[2]) > 1 or w[1] == 0, -w[1]))  # decode rows first, longest past first
        try:
            out_TD = self._run([(seq, start, len(ids)) for seq, start, ids, _ in work],
                               [t for _, _, ids, _ in work for t in ids], torch.cat([h for *_, h in work]))
        except Exception as err:  # noqa: BLE001 - drafts are optional: the sequences decode on without them
            self.failed = f"{type(err).__name__}: {err}"
            log.warning("MTP drafting stopped (%s); the sequences decode on without drafts", self.failed)
            return
        ends = torch.tensor([len(ids) for _, _, ids, _ in work]).cumsum(0) - 1
        decoding = [i for i, (seq, *_) in enumerate(work) if seq.num_fed == seq.num_tokens - 1]
        if decoding:
            last_ND = out_TD[ends[decoding]]
            tokens = self.module.logits(last_ND).argmax(dim=-1).tolist()
            for i, token, hidden_D in zip(decoding, tokens, last_ND, strict=True):
                seq = work[i][0]
                self.starts[seq.seq_id] = DraftStart(seq.num_fed, token, hidden_D)

    def propose(self, decoding: list[Sequence], rooms: list[int], budget: int) -> list[list[int]]:
        """Drafts of up to rooms[i] tokens (budget tokens in all): the first from the last extend, each next one
        from one more round of the MTP layer."""
        live = {seq.seq_id for seq in decoding}
        self.starts = {k: v for k, v in self.starts.items() if k in live}  # preempted or ended: rebuilt later
        wanted, drafts, hidden = [], [], []
        for seq, room in zip(decoding, rooms, strict=True):
            most = min(room, budget)
            budget -= most
            wanted.append(most)
            start = self.starts.get(seq.seq_id)
            drafts.append([start.token] if most else [])
            hidden.append(start.hidden_D if most else None)
        held = {i: _pages_held(decoding[i]) for i, most in enumerate(wanted) if most > 1}
        try:
            for j in range(1, max(wanted, default=0)):
                chain = sorted((i for i in held if wanted[i] > j and self._take_page(decoding[i], j)),
                               key=lambda i: -decoding[i].num_fed)  # longest past first: decode runs pad less
                for i in held:
                    if wanted[i] > j and i not in chain:
                        wanted[i] = j  # no page for this round: the draft ends here
                if not chain:
                    break
                out_TD = self._run([(decoding[i], decoding[i].num_fed + j - 1, 1) for i in chain],
                                   [drafts[i][-1] for i in chain], torch.stack([hidden[i] for i in chain]))
                for i, token, hidden_D in zip(chain, self.module.logits(out_TD).argmax(dim=-1).tolist(), out_TD,
                                              strict=True):
                    drafts[i].append(token)
                    hidden[i] = hidden_D
        except Exception as err:  # noqa: BLE001 - drafts are optional: what was drafted so far is verified
            self.failed = f"{type(err).__name__}: {err}"
            log.warning("MTP drafting stopped (%s); the sequences decode on without drafts", self.failed)
        finally:
            for i, pages in held.items():  # the rounds' positions are rewritten by the next extend: give them back
                self.pool.shrink(decoding[i].pages, pages * self.pool.page_size)
        return drafts

    def _take_page(self, seq: Sequence, j: int) -> bool:
        """Pages for round j's position (num_fed + j - 1), from the free ones only."""
        return self.pool.reserve(seq.pages, seq.num_fed, seq.num_fed + j)

    def _run(self, feeds: list[tuple[Sequence, int, int]], ids: list[int], hidden_TD: torch.Tensor) -> torch.Tensor:
        """One ragged step of the MTP layer: feeds (sequence, first position, rows) in row order, decode rows
        first; ids the tokens one ahead of those positions, hidden_TD the hidden states at them. Returns [T, D]."""
        pool, device = self.pool, self.hybrid.gpu_device
        step_feeds = [pool.feed(seq.pages, start, n) for seq, start, n in feeds]
        num_decode = next((i for i, (_, start, n) in enumerate(feeds) if not (n == 1 and start > 0)), len(feeds))
        with torch_threads(self.hybrid.torch_threads), torch.inference_mode(), _on_device(device):
            step = pool.step(step_feeds, self.hybrid.model.dtype, num_decode)
            cache = PagedStepCache(pool.pages, step, pool.linear)
            ids_1T = torch.tensor([ids], dtype=torch.long, device=device)
            return self.module(ids_1T, hidden_TD[None].to(device), step, cache)[0]


def _pages_held(seq: Sequence) -> int:
    return max(len(table) for table in seq.pages.tables.values())


def _on_device(device: torch.device):
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()
