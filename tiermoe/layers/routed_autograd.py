"""Routed experts with a backward pass, on either tier: what makes a hybrid model trainable.

Forward: the tier computes as it does for inference (the CPU tier's fused kernels, the GPU tier's loop), or, when
the layer has expert LoRA, expert by expert through its products plus the two thin LoRA products. Backward keeps
only the layer's inputs (x, routing ids, routing weights): it recomputes each hit expert on its rows and
differentiates that small graph, so the activations held between forward and backward are the layer's input, not
its [N, 2I] intermediates (the recompute is the bounded-memory option, always on). The frozen expert weights never
get a gradient: each product's backward is its transposed product on the stored weights (`ExpertMatmuls`), which
the tier computes its own way (packed kernels on the native CPU tier, dequantised torch elsewhere).

Legend: T tokens, D hidden, K top-k, N rows routed to one expert, I intermediate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tiermoe.experts.expert_matmuls import ExpertMatmuls, matmuls_of
from tiermoe.experts.ffn import ExpertActivation


class _FrozenProduct(torch.autograd.Function):
    """x -> forward(x) for a frozen expert weight: the input gradient is `transposed(g)`, the weight gets none."""

    @staticmethod
    def forward(ctx, x, forward, transposed):
        ctx.transposed = transposed
        return forward(x)

    @staticmethod
    def backward(ctx, g):
        return ctx.transposed(g.contiguous()), None, None


def expert_rows(mm: ExpertMatmuls, x_ND: torch.Tensor, act: ExpertActivation, lora: list[torch.Tensor],
                scalings: tuple[float, float]) -> torch.Tensor:
    """One expert on its rows [N, D] -> [N, D]; `lora` is (A_gu, B_gu, A_d, B_d) of this expert, or empty;
    `scalings` those of gate_up and down."""
    h_N2I = _FrozenProduct.apply(x_ND, mm.gate_up, mm.gate_up_t)
    if lora:
        a_gu, b_gu, a_d, b_d = (f.to(x_ND.dtype) for f in lora)
        h_N2I = h_N2I + scalings[0] * F.linear(F.linear(x_ND, a_gu), b_gu)
    a_NI = act(h_N2I)
    z_ND = _FrozenProduct.apply(a_NI, mm.down, mm.down_t)
    if lora:
        z_ND = z_ND + scalings[1] * F.linear(F.linear(a_NI, a_d), b_d)
    return z_ND


def _pairs(ids_TK: torch.Tensor):
    """(expert, token rows, top-k slots) for every expert id >= 0 in ids_TK."""
    for e in torch.unique(ids_TK[ids_TK >= 0]).tolist():
        tok_N, slot_N = torch.where(ids_TK == e)
        yield e, tok_N, slot_N


class RoutedExperts(torch.autograd.Function):
    """y_TD = sum over each token's routed experts held by `tier` (ids >= 0) of weight x expert(x).

    apply(x_TD, weights_TK, ids_TK, tier, act, scalings, *factors): factors are the layer's ExpertLoRA tensors
    (gate_up_A, gate_up_B, down_A, down_B) or none, scalings
    their (gate_up, down) scalings. Inputs may live on another device than the tier (the CPU tier
    of a CUDA model): rows go to the tier's device and results come back.
    """

    @staticmethod
    def forward(ctx, x_TD, weights_TK, ids_TK, tier, act, scalings, *factors):
        ctx.tier, ctx.act, ctx.scalings = tier, act, scalings
        ctx.save_for_backward(x_TD, weights_TK, ids_TK, *factors)
        dev = tier.device
        x, w, ids = x_TD.to(dev), weights_TK.to(dev), ids_TK.to(dev)
        if not factors:
            return _fused_forward(tier, x, ids, w).to(x_TD.device)
        out_TD = torch.zeros_like(x)
        for e, tok_N, slot_N in _pairs(ids):
            lora = [f[e].to(dev) for f in factors]
            z_ND = expert_rows(matmuls_of(tier, e, x.dtype), x[tok_N], act, lora, scalings)
            out_TD.index_add_(0, tok_N, (z_ND * w[tok_N, slot_N, None]).to(out_TD.dtype))
        return out_TD.to(x_TD.device)

    @staticmethod
    def backward(ctx, gy_TD):
        x_TD, weights_TK, ids_TK, *factors = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_f = any(ctx.needs_input_grad[6:])
        if not (need_x or need_w or need_f):
            return (None,) * (6 + len(factors))
        tier, dev = ctx.tier, ctx.tier.device
        x, w, ids, gy = x_TD.to(dev), weights_TK.to(dev), ids_TK.to(dev), gy_TD.to(dev)
        gx = torch.zeros_like(x) if need_x else None
        gw = torch.zeros_like(w) if need_w else None
        gf = [torch.zeros_like(f) for f in factors] if need_f else []
        for e, tok_N, slot_N in _pairs(ids):
            with torch.enable_grad():
                x_ND = x[tok_N].detach().requires_grad_(need_x)
                w_N = w[tok_N, slot_N].detach().requires_grad_(need_w)
                lora = [f[e].detach().to(dev).requires_grad_(need_f) for f in factors]
                z_ND = expert_rows(matmuls_of(tier, e, x.dtype), x_ND, ctx.act, lora, ctx.scalings)
                y_ND = (z_ND * w_N[:, None]).to(x.dtype)
                leaves = [t for t in (x_ND, w_N, *lora) if t.requires_grad]
                grads = iter(torch.autograd.grad(y_ND, leaves, gy[tok_N].to(y_ND.dtype)))
            if need_x:
                gx.index_add_(0, tok_N, next(grads))
            if need_w:
                gw[tok_N, slot_N] = next(grads).to(gw.dtype)
            for total, g in zip(gf, grads):
                total[e] += g.to(total.device)
        back = (lambda g, like: None if g is None else g.to(like.device))
        return (back(gx, x_TD), back(gw, weights_TK), None, None, None, None, *(gf or [None] * len(factors)))


def _fused_forward(tier, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
    """The tier's own inference computation of the layer (kernels on the CPU tier): no LoRA to add."""
    if hasattr(tier, "submit"):  # a CPU backend: its worker thread computes (in inference mode)
        tier.submit(x_TD, ids_TK, weights_TK)
        return tier.sync().clone()  # a normal tensor, not an inference one, so autograd may use it
    return tier.forward(x_TD, ids_TK, weights_TK)
