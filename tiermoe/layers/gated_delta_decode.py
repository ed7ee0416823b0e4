"""The decode rows of a gated DeltaNet layer (Qwen3-Next's linear attention) in one call over their pool slots.

transformers' forward, given a batch of one-token rows, spends its time where the arithmetic is not: its
depthwise conv runs as torch's CPU slow path, a loop over channel groups per row (768 calls a step on the tiny
Qwen3-Next of the KV-pool benchmark, a third of the step), every row's states are gathered out of the pool and
scattered back, and the recurrent update makes about a dozen elementwise passes over each state (2 MB a layer
and sequence on Qwen3-Next-80B). Here, for all the decode rows of a step at once:
- the projections and the head ordering are the module's own (transformers' Linear modules and
  `fix_query_key_value_ordering`), so the checkpoint's layout stays transformers' business;
- the conv is one multiply-sum over each row's window (its state's last K - 1 inputs and the new one), summed
  in fp32, rounded to the model dtype before the activation as transformers' conv output is; the window is the
  new conv state, written to the slot's other bank;
- the recurrent update runs where the state lies (tiermoe.layers.decode_attention's native gated delta rule:
  read once from the committed bank, written once to the other), or, without native kernels (a GPU, the torch
  ISA), through the function transformers' forward calls (its hub / FLA resolution included) on gathered states;
- the gated norm and output projection are the module's own.
Results equal transformers' within fp32 rounding (sums in another order). Legend: b rows, C conv channels
(q, k, v), K conv kernel, Hk / Hv key / value heads, dk / dv their dims, D hidden size.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from tiermoe.arch.code_form import CodeForms
from tiermoe.layers.decode_attention import DecodeAttention

# The linear-attention modules whose forward `decode_rows` computes for one-token rows: Qwen3-Next's gated DeltaNet,
# and any class with its code under another name (tiermoe.arch.code_form). A module laid out the same (the same
# projections and parameters) whose forward differs keeps its own.
DELTA_FORMS = CodeForms({("transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3NextGatedDeltaNet"): True})


def decodes_in_place(module: nn.Module) -> bool:
    """Whether `decode_rows` serves this module: its class (the one the engine's ragged-step subclass was made of,
    tiermoe.layers.linear_attention_slots) has the code of one of DELTA_FORMS."""
    cls = type(module)
    return DELTA_FORMS.of(getattr(cls, "original_class", cls)) is not None


def decode_rows(module: nn.Module, x_bD: torch.Tensor, conv_states: torch.Tensor, recurrent_states: torch.Tensor,
                read_b: torch.Tensor, write_b: torch.Tensor, native: DecodeAttention | None) -> torch.Tensor:
    """The layer's output [b, D] for one token per row; the rows' states are read from slots `read` and written
    to slots `write` ([b] int64 each) of the layer's conv states [slots, C, K] and recurrent states
    [slots, Hv, dk, dv] (tiermoe.layers.linear_attention_slots keeps them)."""
    b = x_bD.shape[0]
    x = x_bD[:, None]  # [b, 1, D]: the sequence axis transformers' methods expect
    query, key, value, z, beta_logit, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(x),
                                                                               module.in_proj_ba(x))
    Hk, dk = query.shape[-2:]
    Hv, dv = value.shape[-2:]
    mixed_bC = torch.cat([query.reshape(b, -1), key.reshape(b, -1), value.reshape(b, -1)], dim=-1)

    window = torch.cat([conv_states.index_select(0, read_b)[..., 1:], mixed_bC[..., None]], dim=-1)
    conv_states.index_copy_(0, write_b, window)
    summed = (window.float() * module.conv1d.weight[:, 0].float()).sum(dim=-1)
    if module.conv1d.bias is not None:
        summed = summed + module.conv1d.bias.float()
    qkv_bC = ACT2FN[module.activation](summed.to(mixed_bC.dtype))

    beta_bH = beta_logit.reshape(b, Hv).sigmoid()
    g_bH = -module.A_log.float().exp() * F.softplus(a.reshape(b, Hv).float() + module.dt_bias)
    if native is not None and native.takes_gated_delta(qkv_bC, recurrent_states):
        core = torch.empty((b, Hv, dv), dtype=qkv_bC.dtype, device=qkv_bC.device)
        native.gated_delta(qkv_bC, Hk, dk, g_bH, beta_bH, recurrent_states, read_b, write_b, core)
    else:
        q, k, v = torch.split(qkv_bC, [Hk * dk, Hk * dk, Hv * dv], dim=-1)
        rule = _transformers_recurrent_rule(module)
        core, state = rule(q.reshape(b, 1, Hk, dk), k.reshape(b, 1, Hk, dk), v.reshape(b, 1, Hv, dv),
                           g=g_bH[:, None], beta=beta_bH[:, None],
                           initial_state=recurrent_states.index_select(0, read_b), output_final_state=True,
                           use_qk_l2norm_in_kernel=True)
        recurrent_states.index_copy_(0, write_b, state.to(recurrent_states.dtype))
    core = module.norm(core.reshape(b * Hv, dv), z.reshape(b * Hv, dv))
    return module.out_proj(core.reshape(b, Hv * dv))


def _transformers_recurrent_rule(module: nn.Module):
    """The one-token recurrent rule transformers' forward of this module calls (looked up in the module that
    defines the class's methods, so a kernel it resolved at import, FLA's on a GPU, is the one used)."""
    defined_in = sys.modules[type(module).fix_query_key_value_ordering.__module__]
    return defined_in.torch_recurrent_gated_delta_rule
