"""The KV pool's memory: fixed-size pages of K/V slots per attention layer, reserved once.

Every attention layer of a page group (full attention, or one sliding window size) has a K and a V tensor of
(num_pages + 1) x page_size slots, [slots, H, d] (MLA layers: H = 1, the latent as K and the roped key part as
V). Attention reads whole pages and masks what a query must not see; a masked key must still be finite, or
0 x NaN would poison the sum. So every slot that can be read holds a number: page 0, never handed out, is zero
(the padded reads of a decode batch point there), and a page is zeroed in every layer the first time it is
handed out (`prepare`; on a follower rank, whose pool hands nothing out, before a step first writes there; later
owners find the finite K/V of earlier ones). A layer's tensors are reserved the
first time it stores K/V, with the shapes and dtype its projections produce (so they hold exactly what the model
computes, whatever its head layout), and never again; `torch.empty` leaves the host's pages unmapped until a
page is first used, so a CPU pool costs the memory its tokens use.
Legend: H KV heads, d head dim.
"""

from __future__ import annotations

import torch


class KVPages:
    def __init__(self, num_pages: dict[int | None, int], page_size: int, device: torch.device):
        """`num_pages[window]`: pages of each page group (window None: full attention)."""
        if page_size < 1 or any(n < 1 for n in num_pages.values()):
            raise ValueError(f"a KV pool needs a page size and page counts >= 1, got {page_size} and {num_pages}")
        self.num_pages = dict(num_pages)
        self.page_size = page_size
        self.device = torch.device(device)
        self._slots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._windows: dict[int, int | None] = {}
        self._prepared: dict[int | None, set[int]] = {w: {0} for w in num_pages}  # pages zeroed in every layer

    def prepare(self, window: int | None, page: int) -> None:
        """Before `page` of a group is handed out: zero it in every layer the first time."""
        prepared = self._prepared[window]
        if page not in prepared:
            prepared.add(page)
            with torch.inference_mode():  # the slots were made in a forward: inference tensors
                self._zero(window, page)

    def _zero(self, window: int | None, page: int) -> None:
        for layer, pair in self._slots.items():
            if self._windows[layer] == window:
                for t in pair:
                    t[page * self.page_size:(page + 1) * self.page_size].zero_()

    def slots(self, layer_idx: int, window: int | None, k_like_THd: torch.Tensor,
              v_like_THd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer_idx`'s K and V slots [slots, H, d], reserved on first use like the given new K/V."""
        held = self._slots.get(layer_idx)
        if held is None:
            count = (self.num_pages[window] + 1) * self.page_size
            held = tuple(torch.empty((count, *x.shape[1:]), dtype=x.dtype, device=self.device)
                         for x in (k_like_THd, v_like_THd))
            for t in held:
                for page in self._prepared[window]:
                    t[page * self.page_size:(page + 1) * self.page_size].zero_()
            self._slots[layer_idx], self._windows[layer_idx] = held, window
        return held

    def nbytes(self) -> int:
        """Bytes reserved so far (every layer's slots, page 0 included)."""
        return sum(t.nbytes for pair in self._slots.values() for t in pair)

    def bytes_per_token(self, window: int | None = None) -> int:
        """Bytes one token takes in every reserved layer of a page group."""
        count = (self.num_pages[window] + 1) * self.page_size
        return sum(t.nbytes for i, pair in self._slots.items() for t in pair if self._windows[i] == window) // count
