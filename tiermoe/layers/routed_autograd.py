"""Routed experts with a backward pass, on either tier: what makes a hybrid model trainable.

Forward: the tier computes as it does for inference (the CPU tier's fused kernels, the GPU tier's loop), or, when
the layer has expert LoRA, expert by expert through its products plus the two thin LoRA products. Backward keeps
only the layer's inputs (x, routing ids, routing weights): it recomputes each hit expert on its rows and
differentiates that small graph, so the activations held between forward and backward are the layer's input, not
its [N, 2I] intermediates (the recompute is the bounded-memory option, always on). The frozen expert weights never
get a gradient: each product's backward is its transposed product on the stored weights (`ExpertMatmuls`), which
the tier computes its own way (packed kernels on the native CPU tier, dequantised torch elsewhere).

Long contexts: both passes run over the tokens in chunks of `chunk` tokens (0: all at once), so what a pass holds
beyond its inputs and outputs (the [C*K, D] per-pair rows, each expert's recomputed graph on at most C rows, the
tier's copies of the rows when they cross to it) is proportional to C, not to the context; the gradients of a chunk
are added into the layer's. Only the inputs saved for backward and the outputs ([T, D], [T, K], the factors' shapes)
grow with T, as any layer's do.

DEFAULT_CHUNK sets the chunk of a trainable model's CPU tier (tiermoe.training.set_expert_chunk changes it): contexts
up to it compute as one span, as before, and beyond it each span's products still have enough rows per expert
(4096 tokens x top-8 over 128 experts: 256 rows on average) for the kernels' many-row paths.

Legend: T tokens, C tokens of a chunk, D hidden, K top-k, N rows routed to one expert, I intermediate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tiermoe.experts.expert_matmuls import ExpertMatmuls, matmuls_of
from tiermoe.experts.ffn import ExpertActivation

DEFAULT_CHUNK = 4096  # tokens


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
    `scalings` those of gate_up and down. The LoRA products run in the factors' dtype (fp32, as PEFT runs its
    adapters on a bf16 model), the frozen products in the activations'."""
    h_N2I = _FrozenProduct.apply(x_ND, mm.gate_up, mm.gate_up_t)
    if lora:
        a_gu, b_gu, a_d, b_d = lora
        h_N2I = h_N2I + (scalings[0] * F.linear(F.linear(x_ND.to(a_gu.dtype), a_gu), b_gu)).to(h_N2I.dtype)
    a_NI = act(h_N2I)
    z_ND = _FrozenProduct.apply(a_NI, mm.down, mm.down_t)
    if lora:
        z_ND = z_ND + (scalings[1] * F.linear(F.linear(a_NI.to(a_d.dtype), a_d), b_d)).to(z_ND.dtype)
    return z_ND


def _groups(ids_TK: torch.Tensor):
    """(expert, pair indices into the flattened [T*K], token rows, top-k slots) for every expert id >= 0 in
    ids_TK: one sort for the layer rather than a search per expert."""
    K = ids_TK.shape[1]
    flat = ids_TK.reshape(-1)
    order = torch.argsort(flat, stable=True)
    sorted_ids = flat[order]
    start = int((sorted_ids < 0).sum())
    experts, counts = torch.unique_consecutive(sorted_ids[start:], return_counts=True)
    for e, pairs_N in zip(experts.tolist(), order[start:].split(counts.tolist())):
        yield e, pairs_N, pairs_N // K, pairs_N % K


class RoutedExperts(torch.autograd.Function):
    """y_TD = sum over each token's routed experts held by `tier` (ids >= 0) of weight x expert(x).

    apply(x_TD, weights_TK, ids_TK, tier, act, scalings, chunk, *factors): factors are the layer's ExpertLoRA
    tensors (gate_up_A, gate_up_B, down_A, down_B) or none, scalings their (gate_up, down) scalings, chunk the
    tokens computed at a time (0: all). Inputs may live on another device than the tier (the CPU tier of a CUDA
    model): rows go to the tier's device and results come back. Each (token, slot) pair's result lands in its own
    row of a [C*K, D] buffer, summed over K at the end: no scatter-add per expert.
    """

    @staticmethod
    def forward(ctx, x_TD, weights_TK, ids_TK, tier, act, scalings, chunk, *factors):
        ctx.tier, ctx.act, ctx.scalings, ctx.chunk = tier, act, scalings, chunk
        ctx.save_for_backward(x_TD, weights_TK, ids_TK, *factors)
        on_tier = [f.to(tier.device) for f in factors]
        spans = token_chunks(x_TD.shape[0], chunk)
        if len(spans) == 1:
            return _forward_rows(tier, act, scalings, on_tier, x_TD, weights_TK, ids_TK).to(x_TD.device)
        y_TD = torch.empty_like(x_TD)
        for c0, c1 in spans:
            y_TD[c0:c1] = _forward_rows(tier, act, scalings, on_tier, x_TD[c0:c1], weights_TK[c0:c1], ids_TK[c0:c1])
        return y_TD

    @staticmethod
    def backward(ctx, gy_TD):
        x_TD, weights_TK, ids_TK, *factors = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_f = any(ctx.needs_input_grad[7:])
        if not (need_x or need_w or need_f):
            return (None,) * (7 + len(factors))
        spans = token_chunks(x_TD.shape[0], ctx.chunk)
        whole = len(spans) == 1  # the span's gradients are the layer's: no second buffer
        gx_TD = torch.empty_like(x_TD) if need_x and not whole else None
        gw_TK = torch.empty_like(weights_TK) if need_w and not whole else None
        gf = [torch.zeros_like(f) for f in factors] if need_f else [None] * len(factors)
        on_tier = [f.detach().to(ctx.tier.device) for f in factors]
        for c0, c1 in spans:
            gx, gw, hit, per_factor = _backward_rows(ctx, on_tier, (need_x, need_w, need_f), x_TD[c0:c1],
                                                     weights_TK[c0:c1], ids_TK[c0:c1], gy_TD[c0:c1])
            if whole:
                gx_TD, gw_TK = gx, gw
            else:
                if need_x:
                    gx_TD[c0:c1] = gx
                if need_w:
                    gw_TK[c0:c1] = gw
            if need_f and hit:  # experts no row of the chunk was routed to add nothing
                index = torch.tensor(hit, device=factors[0].device)
                for total, g in zip(gf, per_factor):
                    total.index_add_(0, index, torch.stack(g).to(total.device, total.dtype))
        return (gx_TD, gw_TK, None, None, None, None, None, *gf)


def token_chunks(tokens: int, chunk: int) -> list[tuple[int, int]]:
    """[(start, end)] of consecutive spans of `chunk` tokens covering `tokens` (0: one span of all)."""
    step = chunk if 0 < chunk < tokens else max(tokens, 1)
    return [(c0, min(c0 + step, tokens)) for c0 in range(0, max(tokens, 1), step)]


def _forward_rows(tier, act, scalings, on_tier, x_CD, weights_CK, ids_CK) -> torch.Tensor:
    """The tier's output for a span of tokens [C, D], on the tier's device."""
    dev = tier.device
    x, w, ids = x_CD.to(dev), weights_CK.to(dev), ids_CK.to(dev)
    if not on_tier:
        return _fused_forward(tier, x, ids, w)
    C, K = ids.shape
    rows_PD = x.new_zeros(C * K, x.shape[1])
    for e, pairs_N, tok_N, slot_N in _groups(ids):
        z_ND = expert_rows(matmuls_of(tier, e, x.dtype), x[tok_N], act, [f[e] for f in on_tier], scalings)
        rows_PD[pairs_N] = (z_ND * w[tok_N, slot_N, None]).to(x.dtype)
    return rows_PD.view(C, K, -1).sum(1)


def _backward_rows(ctx, on_tier, needs, x_CD, weights_CK, ids_CK, gy_CD):
    """(input gradient [C, D] on x's device, routing-weight gradient [C, K] on theirs, hit experts, each factor's
    gradients of the hit experts in order) of a span of tokens: each hit expert recomputed on the span's rows."""
    need_x, need_w, need_f = needs
    tier, dev = ctx.tier, ctx.tier.device
    x, w, ids, gy = x_CD.to(dev), weights_CK.to(dev), ids_CK.to(dev), gy_CD.to(dev)
    C, K = ids.shape
    gx_PD = x.new_zeros(C * K, x.shape[1]) if need_x else None
    gw = torch.zeros_like(w) if need_w else None
    hit, per_factor = [], [[] for _ in on_tier]
    for e, pairs_N, tok_N, slot_N in _groups(ids):
        with torch.enable_grad():
            x_ND = x[tok_N].detach().requires_grad_(need_x)
            w_N = w[tok_N, slot_N].detach().requires_grad_(need_w)
            lora = [f[e].detach().requires_grad_(need_f) for f in on_tier]
            z_ND = expert_rows(matmuls_of(tier, e, x.dtype), x_ND, ctx.act, lora, ctx.scalings)
            y_ND = (z_ND * w_N[:, None]).to(x.dtype)
            leaves = [t for t in (x_ND, w_N, *lora) if t.requires_grad]
            grads = iter(torch.autograd.grad(y_ND, leaves, gy[tok_N]))
        if need_x:
            gx_PD[pairs_N] = next(grads)
        if need_w:
            gw[tok_N, slot_N] = next(grads).to(gw.dtype)
        hit.append(e)
        for collected, g in zip(per_factor, grads):
            collected.append(g)
    gx = None if gx_PD is None else gx_PD.view(C, K, -1).sum(1).to(x_CD.device)
    gw = None if gw is None else gw.to(weights_CK.device)
    return gx, gw, hit, per_factor


def _fused_forward(tier, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
    """The tier's own inference computation of the layer (kernels on the CPU tier): no LoRA to add."""
    if hasattr(tier, "submit"):  # a CPU backend: its worker thread computes (in inference mode)
        tier.submit(x_TD, ids_TK, weights_TK)
        return tier.sync().clone()  # a normal tensor, not an inference one, so autograd may use it
    return tier.forward(x_TD, ids_TK, weights_TK)
