"""What one forward pass of a loaded model costs in work (tiermoe.placement.model_costs.ModelCosts), counted on the
model itself (no timing).

The cost model needs, per pass: framework ops the host dispatches and kernels a device runs (small models are
bound by these, not by bytes), weight bytes read and flops. They are counted once, structurally:
- ops: a TorchDispatchMode counts every aten op of a one-sequence decode step on the calling thread (views
  included: they cost the host a dispatch; `kernels` leaves them out: they launch nothing on a GPU). MoE block
  ops are told apart with forward hooks; the GPU tier's own ops from direct calls of the model's GPU tier with one
  and with two experts (a grouped GEMM dispatches the same ops for both), the expert-by-expert loop's from the
  tiers' feed-forward.
- bytes: every non-expert weight is read once per pass (a step is one forward over all its sequences; the
  embedding only by rows, so it counts only when it doubles as the tied LM head); KV cache per context token.
- flops: 2 per weight per token, the LM head once per sequence (logits of the last position only).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tiermoe.engine.sampling import SamplingParams
from tiermoe.experts.ffn import routed_experts_forward
from tiermoe.experts.weights import ExpertWeights
from tiermoe.placement.kv_layout import kv_layout
from tiermoe.placement.model_costs import NO_OPS, ModelCosts, OpCount


class _OpCounter(TorchDispatchMode):
    """Counts aten ops on this thread, split into 'block' (inside a HybridMoE) and the rest."""

    def __init__(self):
        super().__init__()
        self.inside = 0
        self.counts = {"block": [0, 0], "rest": [0, 0]}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        slot = self.counts["block" if self.inside else "rest"]
        slot[0] += 1
        slot[1] += 0 if func.is_view else 1
        return func(*args, **(kwargs or {}))


def count_expert_ops(act, hidden: int = 8, inter: int = 4) -> OpCount:
    """Ops per distinct expert of the tiers' feed-forward: 2 experts minus 1 (shapes do not change the count)."""
    experts = {e: ExpertWeights(torch.randn(2 * inter, hidden), torch.randn(hidden, inter)) for e in range(2)}
    x = torch.randn(2, hidden)
    weights = torch.ones(2, 1)
    counted = []
    for ids in (torch.tensor([[0], [0]]), torch.tensor([[0], [1]])):
        counter = _OpCounter()
        with torch.inference_mode(), counter:
            routed_experts_forward(experts, x, ids, weights, act)
        counted.append(counter.counts["rest"])
    return OpCount(counted[1][0] - counted[0][0], counted[1][1] - counted[0][1])


def count_gpu_tier_ops(tier, hidden: int, dtype: torch.dtype) -> tuple[OpCount, OpCount]:
    """(ops of one call, ops each distinct expert adds) of `tier`'s forward, which must hold at least two experts:
    a call routing two tokens to one expert against one routing them to two."""
    first, second = sorted(tier.experts)[:2]
    x = torch.zeros(2, hidden, dtype=dtype, device=tier.device)
    weights = torch.ones(2, 1, dtype=dtype, device=tier.device)
    counted = []
    with torch.inference_mode():
        tier.forward(x, torch.tensor([[first], [first]], device=tier.device), weights)  # once: probes, caches
        for ids in ([[first], [first]], [[first], [second]]):
            counter = _OpCounter()
            with counter:
                tier.forward(x, torch.tensor(ids, device=tier.device), weights)
            counted.append(OpCount(*counter.counts["rest"]))
    one, two = counted
    per_expert = OpCount(two.ops - one.ops, two.kernels - one.kernels)
    return OpCount(one.ops - per_expert.ops, one.kernels - per_expert.kernels), per_expert


def count_decode_step(llm, engine_factory, sequences: int = 1) -> tuple[list[int], list[int]]:
    """(block ops, other ops) of one decode step of `sequences` sequences at the current placement
    (engine_factory must run that many side by side)."""
    engine = engine_factory(llm)
    counter = _OpCounter()
    hooks = []
    for block in llm.hybrid.blocks.values():
        hooks.append(block.register_forward_pre_hook(lambda *a: setattr(counter, "inside", counter.inside + 1)))
        hooks.append(block.register_forward_hook(lambda *a: setattr(counter, "inside", counter.inside - 1)))
    try:
        for i in range(sequences):  # different prompts: different experts
            engine.add([1 + i, 2, 3 + 2 * i, 4], SamplingParams(max_tokens=3, ignore_eos=True))
        engine.step()  # prefill: builds the cache
        with counter:
            engine.step()  # one decode token
        engine.run_to_completion()
    finally:
        for h in hooks:
            h.remove()
        engine.close()
    return counter.counts["block"], counter.counts["rest"]


def measure_model_costs(llm, engine_factory) -> ModelCosts:
    """Count `llm`'s work per pass. Moves every expert to the GPU tier, then to the CPU tier, and back to the
    placement it had (the GPU tier must be able to hold all experts: a CPU gpu_device or a model that fits).
    The GPU tier is counted as this machine runs it: where its grouped GEMM runs here (as it does on a GPU with
    torch >= 2.10) its ops do not scale with its experts (`grouped_gemm`).
    The CPU call is counted as a layer with both tiers on a GPU dispatches it (its host copies packed, no
    all-CPU shortcut), whatever device this machine runs.

    engine_factory(llm) -> a fresh Engine on llm's model (one sequence at a time is enough).
    """
    hybrid = llm.hybrid
    spec = hybrid.spec
    m, k = spec.num_moe_layers, spec.top_k
    original = hybrid.mask
    saved = []
    expert = count_expert_ops(next(iter(hybrid.blocks.values())).gpu_tier.act)
    try:
        hybrid.apply_mask(spec.moe_row_mask()[:, None].expand(-1, spec.num_experts).clone())
        gpu_block, rest = count_decode_step(llm, engine_factory)  # one token: k distinct experts per layer
        block = next(iter(hybrid.blocks.values()))
        gpu_call, gpu_per_expert = count_gpu_tier_ops(block.gpu_tier, spec.hidden_size, hybrid.model.dtype)
        hybrid.apply_mask(torch.zeros(spec.num_layers, spec.num_experts, dtype=torch.bool))
        saved = [(b, b.cpu_only_shortcut, b.crosses_to_host) for b in hybrid.blocks.values()]
        for block, _, _ in saved:  # count the CPU call as a layer with both tiers on a GPU makes it
            block.cpu_only_shortcut, block.crosses_to_host = False, True
        cpu_block, _ = count_decode_step(llm, engine_factory)
    finally:
        for block, shortcut, crosses in saved:
            block.cpu_only_shortcut, block.crosses_to_host = shortcut, crosses
        hybrid.apply_mask(original)
    grouped = gpu_per_expert.ops == 0  # its ops do not grow with the experts it computes
    tier_in_block = gpu_call + (NO_OPS if grouped else expert.scaled(k))
    per_layer = OpCount(gpu_block[0] / m - tier_in_block.ops, gpu_block[1] / m - tier_in_block.kernels)
    per_cpu_call = OpCount(cpu_block[0] / m - per_layer.ops, cpu_block[1] / m - per_layer.kernels)
    return ModelCosts(
        per_forward=OpCount(*rest), per_layer=per_layer, per_cpu_call=per_cpu_call, per_expert=expert,
        gpu_call=gpu_call, grouped_gemm=grouped, **_bytes_and_flops(llm))


def _bytes_and_flops(llm) -> dict:
    hybrid = llm.hybrid
    model, spec, config = hybrid.model, hybrid.spec, hybrid.config
    params = {id(p): p for p in model.parameters()}
    head = model.get_output_embeddings()
    packed_head = [] if head is None else list(head.buffers())  # a packed head holds its weight as buffers
    total = sum(p.numel() * p.element_size() for p in [*params.values(), *packed_head])
    embed = model.get_input_embeddings().weight
    head_numel = head.in_features * head.out_features if head is not None else 0
    numel = sum(p.numel() for p in params.values()) + (head_numel if packed_head else 0)
    tied = head is not None and getattr(head, "weight", None) is embed
    # the embedding is read by rows only, unless it is also the LM head, which reads all of it
    forward_bytes = total if tied else total - embed.numel() * embed.element_size()
    layer_numel = numel - embed.numel() - (0 if tied else head_numel)
    text = getattr(config, "text_config", None) or config
    heads = getattr(text, "num_attention_heads", 0)
    head_dim = getattr(text, "head_dim", None) or (text.hidden_size // max(1, heads))
    itemsize = embed.element_size()
    kv = kv_layout(text, itemsize)
    return {
        "forward_bytes": int(forward_bytes), "sequence_flops": 2.0 * head_numel, "token_flops": 2.0 * layer_numel,
        "attention_flops_per_context": 4.0 * heads * head_dim * spec.num_layers,
        # the cost model reads every attention layer's K/V per context token (sliding windows not capped yet)
        "kv_bytes_per_token": kv.full_per_token + kv.sliding_per_token,
        "bytes_per_expert": spec.bytes_per_expert(hybrid.expert_dtype),
        "flops_per_pair": 2.0 * spec.params_per_expert, "hidden_bytes": spec.hidden_size * itemsize,
        "num_moe_layers": spec.num_moe_layers, "num_experts": spec.num_experts,
    }
