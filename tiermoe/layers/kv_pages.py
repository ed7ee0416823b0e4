"""The KV pool's memory: fixed-size pages of K/V slots per attention layer, reserved once.

Every attention layer of a page group (full attention, or one sliding window size) has a K and a V tensor of
(num_pages + 1) x page_size slots, [slots, H, d] (MLA layers: H = 1, the latent as K and the roped key part as
V). Page 0 is never handed out: its slots stay zero, and the padded reads of a decode batch point there (a
masked key must still be finite, or 0 x NaN would poison the sum). A layer's tensors are reserved the first time
it stores K/V, with the shapes and dtype its projections produce (so they hold exactly what the model computes,
whatever its head layout), and never again; `torch.empty` leaves the host's pages unmapped until a token is
written there, so a CPU pool costs the memory its tokens use.
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

    def slots(self, layer_idx: int, window: int | None, k_like_THd: torch.Tensor,
              v_like_THd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer_idx`'s K and V slots [slots, H, d], reserved on first use like the given new K/V."""
        held = self._slots.get(layer_idx)
        if held is None:
            count = (self.num_pages[window] + 1) * self.page_size
            held = tuple(torch.empty((count, *x.shape[1:]), dtype=x.dtype, device=self.device)
                         for x in (k_like_THd, v_like_THd))
            for t in held:
                t[:self.page_size].zero_()
            self._slots[layer_idx], self._windows[layer_idx] = held, window
        return held

    def nbytes(self) -> int:
        """Bytes reserved so far (every layer's slots, page 0 included)."""
        return sum(t.nbytes for pair in self._slots.values() for t in pair)

    def bytes_per_token(self, window: int | None = None) -> int:
        """Bytes one token takes in every reserved layer of a page group."""
        count = (self.num_pages[window] + 1) * self.page_size
        return sum(t.nbytes for i, pair in self._slots.items() for t in pair if self._windows[i] == window) // count
