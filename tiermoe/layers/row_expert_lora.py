"""LoRA on one MoE layer's routed experts, per row of the step: adapters served per request, on either tier.

A slot's expert LoRA changes expert e's gate_up and down projections by scaling * B_e @ A_e (PEFT's per-expert
factors, tiermoe.layers.expert_lora). The gate_up update lands before the activation, so a row with an adapter
cannot take the tier's fused layer computation and add something after: its (token, expert) pairs are computed
expert by expert with the tier's own products (tiermoe.experts.expert_matmuls: the native CPU tier's packed kernels,
torch elsewhere), each plus the two thin LoRA products of the stacked factors (tiermoe.layers.lora_stack), as
training computes them (tiermoe.layers.routed_autograd); on the native CPU tier the whole layer is one call that
adds the updates inside the kernels' phases (csrc/moe_layer.cpp, tm_moe_lora_forward). The step's other rows (no adapter, or one with no expert
LoRA in this layer) keep the layer's usual path; HybridMoE adds the two.
Legend: T tokens, K top-k, D hidden, I intermediate, N pairs routed to one expert, R rank columns.
"""

from __future__ import annotations

import torch

from tiermoe.experts.expert_matmuls import matmuls_of
from tiermoe.experts.ffn import ExpertActivation
from tiermoe.experts.kernels import TmLoraArgs
from tiermoe.layers.adapter_rows import AdapterRows
from tiermoe.layers.lora_stack import LoRAStack

PROJECTIONS = ("gate_up", "down")


class RowExpertLoRA:
    """The expert LoRA of every slot that adapts one MoE layer: a LoRAStack per projection, factors [E, R, in] /
    [E, R, out] on `device`."""

    def __init__(self, rows: AdapterRows, layer: int, device: torch.device, dtype: torch.dtype = torch.float32):
        self.rows = rows
        self.stacks = {p: LoRAStack(rows, f"layer {layer}'s routed experts ({p})", device, dtype)
                       for p in PROJECTIONS}

    @property
    def slots(self) -> frozenset[int]:
        return self.stacks["gate_up"].slots | self.stacks["down"].slots

    @property
    def empty(self) -> bool:
        return not self.slots

    def split(self, ids_TK: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(the pairs the layer's usual path computes, the pairs computed here): ids_TK with the other part's
        pairs -1; None for a part that has no row in this step."""
        slots = self.slots
        if not self.rows.uses_any(slots):
            return ids_TK, None
        if self.rows.uses_only(slots):
            return None, ids_TK
        adapted_TK = self.rows.rows_with(slots)[:, None].expand_as(ids_TK)
        return ids_TK.masked_fill(adapted_TK, -1), ids_TK.masked_fill(~adapted_TK, -1)

    def routed(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, tier,
               act: ExpertActivation) -> torch.Tensor:
        """y [T, D]: for each token, the weighted sum of its routed experts held by `tier` (ids >= 0), each with
        its row's adapter. A native CPU tier computes it in one call (csrc/moe_layer.cpp, tm_moe_lora_forward);
        elsewhere `by_expert`."""
        native = getattr(tier, "lora_forward", None)
        if native is not None and all(s.empty or s.A.device.type == "cpu" for s in self.stacks.values()):
            args, held = self._native_args()
            y_TD = native(x_TD, ids_TK, weights_TK, args)
            del held  # the factors and masks the call read (kept alive until it returned)
            if y_TD is not None:
                return y_TD
        return self.by_expert(x_TD, ids_TK, weights_TK, tier, act)

    def _native_args(self) -> tuple[TmLoraArgs, list[torch.Tensor]]:
        """The kernels' view of the stacks and this step's masks (a projection no row of the step adapts: R 0),
        and the tensors it points into."""
        args, held = TmLoraArgs(), []
        for prefix, stack in zip(("gate_up", "down"), (self.stacks["gate_up"], self.stacks["down"])):
            mask_TR = None if stack.empty else self.rows.mask(stack.columns)
            if mask_TR is None:
                continue
            held += [stack.A, stack.Bt, mask_TR]
            args.factors_bf16 = int(stack.A.dtype == torch.bfloat16)
            setattr(args, "R_gu" if prefix == "gate_up" else "R_d", stack.A.shape[-2])
            setattr(args, f"{prefix}_A", stack.A.data_ptr())
            setattr(args, f"{prefix}_Bt", stack.Bt.data_ptr())
            setattr(args, f"{prefix}_mask", mask_TR.data_ptr())
        return args, held

    def by_expert(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, tier,
                  act: ExpertActivation) -> torch.Tensor:
        """`routed` expert by expert with the tier's own products (tiermoe.experts.expert_matmuls) plus the LoRA
        products in torch; the rows go to the tier's device and the result comes back. The pairs are sorted by
        expert once, and their rows, masks and weights gathered once: each expert then works on slices."""
        dev = tier.device
        T, K = ids_TK.shape
        flat = ids_TK.to(dev).reshape(-1)
        order = torch.argsort(flat, stable=True)
        experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
        skip = int(counts[0]) if len(experts) and int(experts[0]) < 0 else 0  # pairs of another tier (id -1)
        pairs_P = order[skip:]
        tok_P = pairs_P // K
        x = x_TD.to(dev)
        x_PD = x[tok_P]
        gate_up, down = self.stacks["gate_up"], self.stacks["down"]
        masks = [None if s.empty else self.rows.mask(s.columns) for s in (gate_up, down)]
        mask_gu_PR, mask_d_PR = (None if m is None else m.to(dev)[tok_P] for m in masks)
        z_PD = torch.empty_like(x_PD)
        start = 0
        for e, n in zip(experts.tolist()[1 if skip else 0:], counts.tolist()[1 if skip else 0:]):
            end = start + n
            mm = matmuls_of(tier, e, x.dtype)
            x_ND = x_PD[start:end]
            h_N2I = mm.gate_up(x_ND)
            if mask_gu_PR is not None:
                h_N2I += gate_up.expert_delta(e, x_ND, mask_gu_PR[start:end])
            a_NI = act(h_N2I)
            z_ND = mm.down(a_NI)
            if mask_d_PR is not None:
                z_ND += down.expert_delta(e, a_NI, mask_d_PR[start:end])
            z_PD[start:end] = z_ND
            start = end
        w_P = weights_TK.to(dev).reshape(-1)[pairs_P]
        rows_PD = x.new_zeros(T * K, x.shape[1])
        rows_PD[pairs_P] = (z_PD * w_P[:, None]).to(x.dtype)
        return rows_PD.view(T, K, -1).sum(1).to(x_TD.device)
