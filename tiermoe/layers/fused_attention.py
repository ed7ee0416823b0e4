"""Decode steps through transformers' standard attention modules in a handful of ops.

transformers' attention forward dispatches about 35 ops per layer for one decode token: three projections, views
and transposes, rotary embedding as eight elementwise ops per tensor, the cache update and the attention call.
On the CPU at batch 1 their dispatch is the cost, not their arithmetic. `DecodeFusedAttention` takes an attention
module's place (its children and parameters under their own names, as HybridMoE takes a MoE block's) and, in a
step whose rows all attend in place (decode rows, and prompt chunks' rows where the kernel reads them:
tiermoe.layers.decode_attention), computes:
- q, k and v with ONE linear: their weights are concatenated once, and the three projections' parameters
  become row views of the concatenation (no second copy held; the original forward still reads them); packed
  projections (--non-expert-dtype) likewise become one packed product (quantized_linear.stack_rows);
- the model's own q/k norms (Qwen3), as modules;
- rotary embedding in place, in one native call (csrc/rotary.cpp: the same products, sum and roundings; GPT-OSS's
  half-width form too);
- the new K/V written into the pool, the attention read in place, the output projection.
Every other step (gathered prompt chunks, gradients, a GPU device) runs the module's original forward.
Families: Qwen3-MoE, Qwen2-MoE, Mixtral and GPT-OSS attention (full rotary, no gate; GPT-OSS's sinks go to the
attention kernel), GLM-4.5's (its q/k norms where `use_qk_norm`, rotary over each head's first part), Qwen3-Next's
(its output gated, partial rotary), and every class whose code is one of theirs under another name
(tiermoe.arch.code_form: Mellum's and Dots1's are Qwen3-MoE's, PhiMoE's, Granite-MoE's and Solar-Open's Qwen2-MoE's,
MiniMax's Mixtral's). OLMoE (norms over all heads, clipping) and the rest keep transformers' forward.
Legend: T rows, H query heads, Hkv KV heads, d head dim.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tiermoe.arch.code_form import CodeForms
from tiermoe.layers.decode_attention import DecodeAttention
from tiermoe.layers.module_swap import swap_modules
from tiermoe.layers.paged_attention import STEP_KWARG
from tiermoe.layers.quantized_linear import QuantizedLinear, stack_rows
from tiermoe.layers.row_lora_linear import RowLoRALinear

_PROJECTIONS = ("q_proj", "k_proj", "v_proj")


@dataclass(frozen=True)
class AttentionForm:
    """What an attention class computes around its q/k/v/o projections and the attention itself."""

    qk_norm: bool = False  # q and k normed per head by its q_norm / k_norm modules before rotary (Qwen3-MoE's)
    qk_norm_switch: str | None = None  # the instance attribute that turns those norms on (GLM-4.5's use_qk_norm)
    half_rotary: bool = False  # rotary tables of half the head dim, each half of a head turned by them (GPT-OSS's)
    partial_rotary: bool = False  # rotary over each head's first r values, r the tables' width (GLM-4.5's)
    sinks: bool = False  # a learned sink logit per head in the softmax (GPT-OSS's `sinks` parameter)
    output_gate: bool = False  # q_proj gives each head its query and a gate side by side; the output is times the
    # gate's sigmoid (Qwen3-Next's)


_MODELS = "transformers.models"
# (module, class) -> its form; a class with the same code as one of these is taken too (tiermoe.arch.code_form)
ATTENTION_FORMS = CodeForms({
    (f"{_MODELS}.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeAttention"): AttentionForm(qk_norm=True),
    (f"{_MODELS}.qwen2_moe.modeling_qwen2_moe", "Qwen2MoeAttention"): AttentionForm(),
    (f"{_MODELS}.mixtral.modeling_mixtral", "MixtralAttention"): AttentionForm(),
    (f"{_MODELS}.gpt_oss.modeling_gpt_oss", "GptOssAttention"): AttentionForm(half_rotary=True, sinks=True),
    (f"{_MODELS}.glm4_moe.modeling_glm4_moe", "Glm4MoeAttention"): AttentionForm(
        qk_norm=True, qk_norm_switch="use_qk_norm", partial_rotary=True),
    (f"{_MODELS}.qwen3_next.modeling_qwen3_next", "Qwen3NextAttention"): AttentionForm(
        qk_norm=True, partial_rotary=True, output_gate=True),
})


class DecodeFusedAttention(nn.Module):
    """`original`'s place in its decoder layer (see the module docstring); `native` computes rotary and attention."""

    def __init__(self, original: nn.Module, native: DecodeAttention):
        super().__init__()
        for name, child in original.named_children():
            self.add_module(name, child)
        for name, param in original.named_parameters(recurse=False):  # GPT-OSS's sinks
            self.register_parameter(name, param)
        # Every attribute the original's own __init__ set beyond nn.Module's: config, layer_idx, head_dim, scaling,
        # sliding_window... and what decorators of its class add (transformers >= 5.25 wraps attention classes with
        # kernels' `use_kernelized_func`, whose forward reads the instance's `_kernel_funcs`).
        for name, value in vars(original).items():
            if name not in vars(self):
                setattr(self, name, value)
        self.training = original.training
        self.original_class = type(original)  # its forward runs every other step; its file has the eager attention
        self.form: AttentionForm = ATTENTION_FORMS.of(type(original))
        switch = self.form.qk_norm_switch
        self.qk_norm = self.form.qk_norm and (switch is None or bool(getattr(original, switch)))
        self.rotary_width = self.head_dim // 2 if self.form.half_rotary else self.head_dim  # the tables' width (the
        # widest a partial rotary's may be)
        self.native = native
        self.heads = (original.config.num_attention_heads, original.config.num_key_value_heads)
        projections = [getattr(self, n) for n in _PROJECTIONS]
        self.qkv_weight, self.qkv_bias = _concatenated(*projections)
        # Packed projections (--non-expert-dtype) stacked into as few products as their formats allow. Held in a
        # tuple, not as child modules: their tensors are the projections' own (their buffers are views of them),
        # which the model counts once.
        self.stacked_qkv = _stacked_runs(projections) if all(type(p) is QuantizedLinear for p in projections) else ()

    def forward(self, *args, **kwargs):
        step = kwargs.get(STEP_KWARG)
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if (args or step is None or step.first_gathered < len(step.row_parts)  # a part to gather: SDPA's path
                or (step.decode_attention is None and step.chunk_attention is None)
                or cache is None or torch.is_grad_enabled()
                or not self.rotary_fits(kwargs["position_embeddings"][0].shape[-1])):
            return self.original_class.forward(self, *args, **kwargs)
        return self._decode(kwargs["hidden_states"], kwargs["position_embeddings"], cache, step), None

    def rotary_fits(self, width: int) -> bool:
        """Whether rotary tables `width` wide are the form's: the head's (or its half, GPT-OSS), or for a partial
        rotary any even width up to the head's (a step of other tables takes the original forward)."""
        if self.form.partial_rotary:
            return 0 < width <= self.head_dim and width % 2 == 0
        return width == self.rotary_width

    def _decode(self, x_1TD: torch.Tensor, position_embeddings, cache, step) -> torch.Tensor:
        H, Hkv = self.heads
        T, d = x_1TD.shape[1], self.head_dim
        Hq = 2 * H if self.form.output_gate else H  # (each head's query, then its gate)
        q_THd, k_THd, v_THd = self._qkv(x_1TD[0]).view(T, Hq + 2 * Hkv, d).split([Hq, Hkv, Hkv], dim=1)
        gate_1TO = None
        if self.form.output_gate:
            q_THd, gate_THd = q_THd.view(T, H, 2 * d).chunk(2, dim=-1)
            gate_1TO = gate_THd.reshape(1, T, H * d)
        if self.qk_norm:
            q_THd, k_THd = self.q_norm(q_THd), self.k_norm(k_THd)
        cos, sin = position_embeddings
        self.native.rotate(q_THd, cos[0], sin[0], self.form.half_rotary)
        self.native.rotate(k_THd, cos[0], sin[0], self.form.half_rotary)
        k_slots, v_slots = cache.write(self.layer_idx, k_THd, v_THd)
        out_THd = q_THd.new_empty((T, H, v_THd.shape[-1]))
        step.attend_in_place(step.layer_windows[self.layer_idx], q_THd, k_slots, v_slots, self.scaling,
                             self.sinks if self.form.sinks else None, out_THd)
        out_1TO = out_THd.view(1, T, -1)
        if gate_1TO is not None:
            out_1TO = out_1TO * torch.sigmoid(gate_1TO)
        return self.o_proj(out_1TO)

    def _qkv(self, x_TD: torch.Tensor) -> torch.Tensor:
        if self.qkv_weight is None and not self.stacked_qkv:  # projections that are not plain linears
            return torch.cat([getattr(self, n)(x_TD) for n in _PROJECTIONS], dim=-1)
        if len(self.stacked_qkv) == 1:
            qkv_TO = self.stacked_qkv[0](x_TD)
        elif self.stacked_qkv:
            qkv_TO = torch.cat([product(x_TD) for product in self.stacked_qkv], dim=-1)
        else:
            qkv_TO = F.linear(x_TD, self.qkv_weight, self.qkv_bias)
        return self._with_adapters(x_TD, qkv_TO)

    def _with_adapters(self, x_TD: torch.Tensor, qkv_TO: torch.Tensor) -> torch.Tensor:
        """The one product of q, k and v plus each row's adapter's update of the projections it adapts (adapters
        served per request: a projection is then a RowLoRALinear, whose base weight is the product's rows)."""
        start = 0
        for name in _PROJECTIONS:
            proj = self._modules[name]
            if isinstance(proj, RowLoRALinear) and proj.lora.rows.active:
                delta = proj.lora.delta(x_TD)
                if delta is not None:
                    qkv_TO[:, start:start + proj.out_features] += delta
            start += proj.out_features
        return qkv_TO


def _stacked_runs(projections: list[QuantizedLinear]) -> tuple[QuantizedLinear, ...]:
    """Products giving the projections' outputs side by side in their order: each run of consecutive projections
    held in one format stacked into one (stack_rows), so an int4 model's int8 k and v (non_expert_quant.linear_format)
    take one product beside q's; a run that does not stack stays its projections."""
    runs: list[QuantizedLinear] = []
    for _, same_format in itertools.groupby(projections, key=lambda p: p.fmt):
        run = list(same_format)
        stacked = stack_rows(run) if len(run) > 1 else None
        runs.extend(run if stacked is None else [stacked])
    return tuple(runs)


def _concatenated(*linears: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The projections' weights (and biases) as one tensor each, the projections' own parameters re-pointed at
    its rows; (None, None) when any is not a plain nn.Linear."""
    has_bias = {lin.bias is not None for lin in linears if type(lin) is nn.Linear}
    if any(type(lin) is not nn.Linear for lin in linears) or len(has_bias) > 1:
        return None, None
    with torch.no_grad():
        weight = torch.cat([lin.weight for lin in linears])
        bias = torch.cat([lin.bias for lin in linears]) if has_bias == {True} else None
        start = 0
        for lin in linears:
            rows = lin.weight.shape[0]
            lin.weight = nn.Parameter(weight[start:start + rows], requires_grad=lin.weight.requires_grad)
            if bias is not None:
                lin.bias = nn.Parameter(bias[start:start + rows], requires_grad=lin.bias.requires_grad)
            start += rows
    return weight, bias


def fuse_decode_attention(model: nn.Module, native: DecodeAttention) -> int:
    """Put a DecodeFusedAttention in place of every attention module of one of ATTENTION_FORMS; returns how many."""
    return swap_modules(model, lambda m: ATTENTION_FORMS.of(type(m)) is not None,
                        lambda m: DecodeFusedAttention(m, native))

