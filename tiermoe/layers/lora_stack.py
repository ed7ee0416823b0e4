"""One weight's LoRA for every adapter slot that adapts it, side by side: the factors per-row serving multiplies.

A slot's update of a weight W [out, in] is scaling * B @ A (A [r, in], B [out, r]; per routed expert, a leading
[E] dimension). A LoRAStack holds the factors of all slots that adapt W concatenated along the rank: A [..., R, in]
and B transposed, Bt [..., R, out] (each slot's scaling folded in; rows of it are what the native MoE kernels add
up, contiguous), and the layout `columns` ((slot, rank), ...). A step's rows then take their own slot's columns
through the mask of tiermoe.layers.adapter_rows: delta = ((x A^T) * mask) Bt, two products for all rows of all
adapters. A row whose slot is not here (another adapter, or none) gets exactly zero. The factors are held in
`dtype`: fp32, or a bf16 model's bf16 (as SGLang and vLLM hold adapters in the model's dtype: a decode step reads
them beside the weights, and fp32 factors of a few adapters weigh as much as a good share of a small model's
weights); the products run in fp32 either way, and the delta is cast to the activations' dtype.

Loading an adapter concatenates its columns; unloading keeps the other slots' columns (a copy of the stack, made
between steps). No per-slot copy is kept beside the stack.
Legend: T rows, N rows routed to one expert, R rank columns, E experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tiermoe.layers.adapter_rows import AdapterRows, Columns


class LoRAStack:
    """The stacked factors of one weight (`name`, for messages), read per step through `rows`."""

    def __init__(self, rows: AdapterRows, name: str, device: torch.device, dtype: torch.dtype = torch.float32):
        self.rows, self.name, self.device, self.dtype = rows, name, torch.device(device), dtype
        self.columns: Columns = ()
        self.A: torch.Tensor | None = None  # [..., R, in]
        self.Bt: torch.Tensor | None = None  # [..., R, out], scalings folded in

    @property
    def slots(self) -> frozenset[int]:
        return frozenset(slot for slot, _ in self.columns)

    @property
    def empty(self) -> bool:
        return not self.columns

    def put(self, slot: int, A: torch.Tensor, B: torch.Tensor, scaling: float) -> None:
        """Add `slot`'s factors A [..., r, in], B [..., out, r] (the same leading shape as the stack's)."""
        A = A.to(self.device, torch.float32).to(self.dtype)
        Bt = (B.to(self.device, torch.float32) * scaling).transpose(-1, -2).to(self.dtype)
        if self.A is not None and (A.shape[:-2] != self.A.shape[:-2] or A.shape[-1] != self.A.shape[-1]
                                   or Bt.shape[-1] != self.Bt.shape[-1]):
            raise ValueError(f"{self.name}: factors of shape {list(A.shape)} / {list(B.shape)} do not stack with "
                             f"{list(self.A.shape)} / {list(self.Bt.transpose(-1, -2).shape)}")
        stacked_A = A.contiguous() if self.A is None else torch.cat([self.A, A], dim=-2)
        stacked_Bt = Bt.contiguous() if self.Bt is None else torch.cat([self.Bt, Bt], dim=-2)
        self.A, self.Bt, self.columns = stacked_A, stacked_Bt, (*self.columns, (slot, A.shape[-2]))

    def drop(self, slot: int) -> None:
        """Remove `slot`'s columns (nothing when it has none here)."""
        keep, kept, start = [], [], 0
        for owner, rank in self.columns:
            if owner != slot:
                keep += range(start, start + rank)
                kept.append((owner, rank))
            start += rank
        if len(kept) == len(self.columns):
            return
        if not kept:
            self.A = self.Bt = None
        else:
            index = torch.tensor(keep, dtype=torch.int64, device=self.device)
            self.A = self.A.index_select(-2, index)
            self.Bt = self.Bt.index_select(-2, index)
        self.columns = tuple(kept)

    def delta(self, x: torch.Tensor) -> torch.Tensor | None:
        """The update of a step's rows x [..., in] (their leading dims flattening to the step's T rows), in x's
        dtype; None when no row of the step has a slot of this stack."""
        mask_TR = self.rows.mask(self.columns)
        if mask_TR is None:
            return None
        x_TI = x.reshape(-1, x.shape[-1])
        if x_TI.shape[0] != mask_TR.shape[0]:
            raise RuntimeError(f"per-request LoRA on {self.name} got {x_TI.shape[0]} rows in a step of "
                               f"{mask_TR.shape[0]}; this module cannot take an adapter per request")
        d = (F.linear(x_TI.float(), self.A.float()) * mask_TR) @ self.Bt.float()
        return d.view(*x.shape[:-1], d.shape[-1]).to(x.dtype)

    def expert_delta(self, expert: int, x_NI: torch.Tensor, mask_NR: torch.Tensor) -> torch.Tensor:
        """Expert `expert`'s update of its rows x [N, in] whose masks are mask_NR (per-expert stacks), in x's
        dtype and device."""
        A, Bt = self.A[expert], self.Bt[expert]
        if A.device != x_NI.device:  # a CPU tier's rows of a model on a GPU: the factors go to the rows
            A, Bt = A.to(x_NI.device), Bt.to(x_NI.device)
        return ((F.linear(x_NI.float(), A.float()) * mask_NR) @ Bt.float()).to(x_NI.dtype)
