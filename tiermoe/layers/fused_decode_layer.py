"""A decoder layer's decode step in one native call, for CPU-only runs of Qwen3-MoE, Mixtral and GPT-OSS models in
bf16 (and of any decoder layer with the code of one of theirs, LAYER_FORMS).

After the per-op fusions (fused norms, routers and attention, packed linears) a decode step of a width-128 layer
still cost about 400 us of host time against llama.cpp's 75: some sixty dispatched torch ops and ten ctypes calls,
each a few microseconds, around a few microseconds of arithmetic. `FusedDecodeLayer` takes the decoder layer's
place (its children under their own names, as HybridMoE takes a MoE block's) and, in a step where every row is a
decode row attending the pool in place and the layer's experts are all on the CPU tier, makes one call:
csrc/decode_layer.cpp chains the library's own entry points exactly as the per-op path calls them, so the
output is bit for bit the per-op path's (tests/test_fused_decode_layer.py compares them). A step with prompt rows,
PROMPT_ROWS rows at most, takes the same call with every row attending in place (see PROMPT_ROWS). Every other
step (longer prompts, gradients, experts on a GPU tier, a trained adapter, deferred experts, more than NATIVE_MAX_ROWS
rows) runs the layer's original forward, which reaches the per-op modules. A step with rows of LoRA adapters served
per request takes the call too, with each row's updates (`lora`: the adapted modules' stacked factors and the step's
masks, tiermoe.layers.lora_stack), added where the per-op modules add them.

Swapped in where every piece is the fused one: DecodeFusedAttention with its q/k/v stacked into one packed product
(or q in one and k/v in another, where they are held in two formats) and a packed output projection (bf16 biases
and GPT-OSS's sinks allowed), FusedRMSNorm norms of one kind, a FusedTopKRouter with its packed bf16 weight (and
bias), and a HybridMoE without shared experts over a CPU tier computed by the kernels: that is, a CPU-only bf16 run
with packed non-expert linears (the default there, tiermoe.model.cpu_only). GPT-OSS's half-width rotary, sliding
windows and top-k-first router are the call's too (csrc/decode_layer.cpp). A step takes the call only while the MoE
block's router is still that FusedTopKRouter: a router put in its place (the trace's routing of `bench placement
--routing-trace`) is asked by the per-op path, which the native call would bypass.
Legend: T decode rows, D hidden, H query heads, Hkv KV heads, d head dim, K top-k.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from tiermoe.arch.code_form import CodeForms
from tiermoe.experts.kernels import (
    Kernels,
    TmAttnArgs,
    TmDecodeLayerArgs,
    TmDecodeLora,
    TmLinearArgs,
    TmLinearLora,
)
from tiermoe.experts.layer_ops import LayerOps
from tiermoe.layers.adapter_rows import AdapterRows
from tiermoe.layers.decode_attention import TEAM_MIN_KV_BYTES
from tiermoe.layers.fused_attention import DecodeFusedAttention
from tiermoe.layers.fused_norm import FusedRMSNorm
from tiermoe.layers.fused_router import NATIVE_MAX_ROWS, FusedTopKRouter
from tiermoe.layers.hybrid_moe import HybridMoE
from tiermoe.layers.lora_stack import LoRAStack
from tiermoe.layers.module_swap import swap_modules
from tiermoe.layers.paged_attention import STEP_KWARG, PagedStepCache
from tiermoe.layers.quantized_linear import QuantizedLinear, bf16_product_args
from tiermoe.layers.row_lora_linear import RowLoRALinear

_MODELS = "transformers.models"
# The decoder layers whose forward the native call computes (the residual adds around the attention and the MoE
# block); a class with the same code as one of these is taken too (tiermoe.arch.code_form).
LAYER_FORMS = CodeForms({(f"{_MODELS}.{arch}.modeling_{arch}", name): True for arch, name in (
    ("qwen3_moe", "Qwen3MoeDecoderLayer"), ("mixtral", "MixtralDecoderLayer"), ("gpt_oss", "GptOssDecoderLayer"))})
# Rows of a step with prompt rows that still takes the whole-layer call: every row attends in place in one call
# (RaggedStep.rows_in_place), where the per-op path attends the decode rows and the chunks' rows in two (the same
# products, attention summed in another order where the team splits a row's keys differently; the per-op path's
# decode steps stay bit for bit the same). Longer steps are worth torch's threads in the norms and routers.
PROMPT_ROWS = NATIVE_MAX_ROWS


class StepWorkspace:
    """What every fused layer of one model shares, one layer at a time (the engine runs one step at a time): the
    intermediates' memory, grown to the largest step seen and never shrunk, and the current step's StepPlan."""

    def __init__(self):
        self.bytes = torch.empty(0, dtype=torch.uint8)
        self.err = ctypes.create_string_buffer(256)
        self.step, self.plan = None, None  # the step last planned (held: `is` compares it) and its plan

    def at_least(self, nbytes: int) -> int:
        if self.bytes.numel() < nbytes:
            self.bytes = torch.empty(nbytes, dtype=torch.uint8)
        return self.bytes.data_ptr()

    def plan_for(self, step, x_1TD: torch.Tensor, kwargs: dict) -> StepPlan | None:
        """The step's plan, made by its first fused layer; None when the step takes the per-op path."""
        if step is not self.step:
            self.step, self.plan = step, StepPlan.of(step, x_1TD, kwargs)
        return self.plan


class StepPlan:
    """What a step's fused layers share: its rows' attention index per page group and its rotary tables. Made
    only for a step the whole-layer call takes (`of`)."""

    def __init__(self, step, in_place: bool, cos: torch.Tensor, sin: torch.Tensor):
        self.step, self.in_place, self.cos, self.sin = step, in_place, cos, sin
        self.groups: dict = {}  # window -> (write_index, DecodeIndex, pos)

    @staticmethod
    def of(step, x_1TD: torch.Tensor, kwargs: dict) -> StepPlan | None:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if step is None or not isinstance(cache, PagedStepCache) or torch.is_grad_enabled():
            return None
        in_place = step.decode_only  # every row a decode row, its index built: else the rows are planned here
        if (x_1TD.dtype != torch.bfloat16 or x_1TD.device.type != "cpu" or x_1TD.dim() != 3 or x_1TD.shape[0] != 1
                or x_1TD.shape[1] > (NATIVE_MAX_ROWS if in_place else PROMPT_ROWS)):
            return None
        cos, sin = kwargs["position_embeddings"]
        if cos.dtype != torch.bfloat16 or cos.stride(-1) != 1:
            return None
        return StepPlan(step, in_place, cos, sin)

    def group(self, window):
        """(write_index [T], DecodeIndex, pos [T]) of the step's rows in the page group of `window`."""
        found = self.groups.get(window)
        if found is None:
            group = self.step.groups[window]
            index, pos = (group.decode, self.step.decode_pos) if self.in_place else self.step.rows_in_place(window)
            found = self.groups[window] = (group.write_index, index, pos)
        return found


class FusedDecodeLayer(nn.Module):
    """`original`'s place in the model (see the module docstring); `fusable(original)` must hold."""

    def __init__(self, original: nn.Module, kernels: Kernels, ops: LayerOps, workspace: StepWorkspace):
        super().__init__()
        for name, child in original.named_children():
            self.add_module(name, child)
        for name, value in vars(original).items():  # what its own __init__ and its class's decorators set
            if name not in vars(self):
                setattr(self, name, value)
        self.training = original.training
        self.gradient_checkpointing = False  # read by transformers' wrapper of the original forward (inference only)
        self.original_class = type(original)
        self.kernels, self.workspace = kernels, workspace
        self._work_bytes: dict[int, int] = {}  # rows -> tm_decode_layer_work_bytes
        self.kv_like = torch.empty(0, self.self_attn.heads[1], self.self_attn.head_dim, dtype=torch.bfloat16)
        # plain attributes, not submodules (these are children already): read per call without nn.Module's lookup
        self.__dict__["moe"] = self.mlp
        self.layer = self.self_attn.layer_idx
        self.team = None  # the kernel thread team, taken on the first call
        # the rows of adapters served per request (tiermoe.model.served_adapters sets it): a step with an adapter
        # row passes the adapted modules' factors and the step's masks to the call (`_lora`)
        self.adapter_rows: AdapterRows | None = None
        self._lora_cache = None  # (what the last step's LoRA args were made of, (args, tensors they point into))
        attn, router = self.self_attn, self.mlp._router()
        self.__dict__["fused_router"] = router  # the router the native call computes (see the module docstring)
        H, Hkv = attn.heads
        norm = self.input_layernorm
        qk_norm = attn.qk_norm
        qkv, kv = _qkv_products(attn)
        # what the call reads besides the products: q/k/v's biases side by side, the sinks in fp32 (as the per-op
        # path passes them to the attention kernel); held here, the args point into them
        products = (qkv,) if kv is None else (qkv, kv)
        self.qkv_bias = None if qkv.bias is None else torch.cat([p.bias.detach() for p in products])
        self.sinks = attn.sinks.detach().float().contiguous() if attn.form.sinks else None
        self.args = TmDecodeLayerArgs(
            D=norm.weight.shape[0], H=H, Hkv=Hkv, d=attn.head_dim, E=router.num_experts, K=router.top_k,
            norm_kind=norm.kind, sum_lanes=ops.sum_lanes, exp_lanes=ops.exp_lanes, qk_norm=int(qk_norm),
            renormalize=int(router.renormalize), weights_bf16=int(router.cast), eps=norm.eps,
            qk_eps=attn.q_norm.eps if qk_norm else 0.0, input_norm=norm.weight.data_ptr(),
            post_norm=self.post_attention_layernorm.weight.data_ptr(),
            q_norm=attn.q_norm.weight.data_ptr() if qk_norm else None,
            k_norm=attn.k_norm.weight.data_ptr() if qk_norm else None,
            qkv=bf16_product_args(qkv, kernels), o=bf16_product_args(attn.o_proj, kernels),
            router=bf16_product_args(router.packed, kernels),
            kv=TmLinearArgs() if kv is None else bf16_product_args(kv, kernels),
            attn=TmAttnArgs(isa=kernels.isa, scale=attn.scaling, sinks=_pointer(self.sinks)),
            half_rotary=int(attn.form.half_rotary), topk_first=int(router.topk_first),
            qkv_bias=_pointer(self.qkv_bias), o_bias=_pointer(attn.o_proj.bias), router_bias=_pointer(router.bias))

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        moe = self.moe
        plan = None if args else self.workspace.plan_for(kwargs.get(STEP_KWARG), hidden_states, kwargs)
        if (plan is None or plan.cos.shape[-1] != self.self_attn.rotary_width
                or not hidden_states.is_contiguous()
                or len(moe.gpu_tier) > 0 or len(moe.cpu_tier) == 0 or moe.reduce is not None
                or moe._router() is not self.fused_router
                or not moe.cpu_only_shortcut or moe.crosses_to_host or not moe._plain_inference()):
            return self.original_class.forward(self, hidden_states, *args, **kwargs)
        experts = moe.cpu_tier.layer_args()
        if experts is None:
            return self.original_class.forward(self, hidden_states, *args, **kwargs)
        lora = None
        if self.adapter_rows is not None and self.adapter_rows.active:
            lora = self._lora()
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        window = plan.step.layer_windows[self.layer]
        slots = cache.pages.slots(self.layer, window, self.kv_like, self.kv_like)  # reserved by a first step
        return self._decode(hidden_states, plan, window, slots, experts, lora)

    def _lora(self) -> tuple[TmDecodeLora, list[torch.Tensor]]:
        """The step's LoRA of this layer (adapters served per request) as the native call reads it, and the
        tensors it points into: made again only when those change (an adapter loaded or unloaded, a step whose
        rows use other adapters, or more rows than the masks' buffers held)."""
        rows = self.adapter_rows
        if self._lora_cache is not None and self._lora_cache[0] == (rows.epoch, rows.present):
            return self._lora_cache[1]  # the same factors and mask buffers (their values are this step's)
        attn = self.self_attn
        parts = [(name, attn._modules[f"{name}_proj"].lora) for name in ("q", "k", "v", "o")
                 if isinstance(attn._modules[f"{name}_proj"], RowLoRALinear)]
        if self.fused_router.lora is not None:
            parts.append(("router", self.fused_router.lora))
        lora, held = TmDecodeLora(), []
        for name, stack in parts:
            _fill(getattr(lora, name), stack, None if stack.empty else rows.mask(stack.columns), held)
        if self.moe.row_lora is not None:
            lora.moe, moe_held = self.moe.row_lora._native_args()
            held += moe_held
        self._lora_cache = ((rows.epoch, rows.present), (lora, held))  # after the masks: making one moves epoch
        return lora, held

    def _decode(self, x_1TD: torch.Tensor, plan: StepPlan, window, slots, experts, lora=None) -> torch.Tensor:
        T = x_1TD.shape[1]
        a, moe = self.args, self.moe
        write_index, index, pos = plan.group(window)
        out = torch.empty_like(x_1TD)
        ids = torch.empty(T, a.K, dtype=torch.int64)
        a.T, a.x, a.out, a.ids = T, x_1TD.data_ptr(), out.data_ptr(), ids.data_ptr()
        a.cos, a.sin, a.cs_row_stride = plan.cos.data_ptr(), plan.sin.data_ptr(), plan.cos.stride(-2)
        a.k_slots, a.v_slots, a.write_slots = slots[0].data_ptr(), slots[1].data_ptr(), write_index.data_ptr()
        a.attn.page_size, a.attn.max_pages = plan.step.page_size, index.tables.shape[1]
        a.attn.tables, a.attn.pos, a.attn.lo = index.tables.data_ptr(), pos.data_ptr(), index.lo.data_ptr()
        a.attend_on_team = int(index.keys * a.Hkv * 2 * a.d * 2 >= TEAM_MIN_KV_BYTES)
        a.moe = experts
        work = self._work_bytes.get(T)
        if work is None:
            work = self._work_bytes[T] = self.kernels.lib.tm_decode_layer_work_bytes(ctypes.byref(a))
        a.work = self.workspace.at_least(work)
        if self.team is None:  # the model's kernel team: one lookup, then held as long as this layer
            self.team = moe.cpu_tier.thread_team()
        err = self.workspace.err
        a.lora = None if lora is None else ctypes.pointer(lora[0])  # lora[1]: what it points into, alive meanwhile
        if self.kernels.lib.tm_decode_layer(self.team.handle, ctypes.byref(a), err, len(err)) != 0:
            raise RuntimeError(err.value.decode())
        if moe.recorder.enabled:
            moe.recorder.record(moe.layer, ids, moe.assignment_E >= 0)
        return out


def _fill(args: TmLinearLora, stack: LoRAStack, mask_TR: torch.Tensor | None, held: list[torch.Tensor]) -> None:
    """A product's LoRA (R left 0 when no row of the step has one of the stack's slots: mask None)."""
    if mask_TR is None:
        return
    held += [stack.A, stack.Bt, mask_TR]
    args.R, args.in_, args.out = stack.A.shape[0], stack.A.shape[1], stack.Bt.shape[1]
    args.factors_bf16 = int(stack.A.dtype == torch.bfloat16)
    args.A, args.Bt, args.mask = stack.A.data_ptr(), stack.Bt.data_ptr(), mask_TR.data_ptr()


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _qkv_products(attn: DecodeFusedAttention) -> tuple[QuantizedLinear, QuantizedLinear | None] | None:
    """The packed products the native call computes q, k and v with: (q, k and v's) where k and v are stacked in
    a format of their own (an int4 model's int8 k / v: tiermoe.model.non_expert_quant.linear_format), else (all
    three's, None); None when the attention's projections are not packed so, or some have biases and some not."""
    products = attn.stacked_qkv
    H, Hkv = attn.heads
    if (len(products) not in (1, 2) or any(p.kernels is None or not _bf16_or_none(p.bias) for p in products)
            or len({p.bias is None for p in products}) > 1
            or products[0].out_features != (H if len(products) == 2 else H + 2 * Hkv) * attn.head_dim):
        return None
    return products[0], products[1] if len(products) == 2 else None


def fusable(layer: nn.Module) -> bool:
    """Whether `layer` is a decoder layer FusedDecodeLayer computes (see the module docstring)."""
    if LAYER_FORMS.of(type(layer)) is None:
        return False
    attn, moe = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if not isinstance(attn, DecodeFusedAttention) or not isinstance(moe, HybridMoE):
        return False
    router = moe._router()
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    if attn.qk_norm:
        norms += [attn.q_norm, attn.k_norm]
    return (_qkv_products(attn) is not None and type(attn.o_proj) is QuantizedLinear
            and _bf16_or_none(attn.o_proj.bias) and attn.o_proj.kernels is not None
            and all(type(n) is FusedRMSNorm and n.weight.dtype == torch.bfloat16 for n in norms)
            and len({n.kind for n in norms}) == 1 and len({n.eps for n in norms[:2]}) == 1
            and isinstance(router, FusedTopKRouter) and router.packed is not None and _bf16_or_none(router.bias)
            and router.ops.exp_lanes is not None and moe.spec.shared_kind == "none"
            and hasattr(moe.cpu_tier, "layer_args"))


def _bf16_or_none(bias: torch.Tensor | None) -> bool:
    """A bias the native call adds: none, or a contiguous bf16 one on the CPU."""
    return bias is None or (bias.dtype == torch.bfloat16 and bias.device.type == "cpu" and bias.is_contiguous())


def fuse_decode_layers(model: nn.Module, kernels: Kernels | None) -> int:
    """Put a FusedDecodeLayer in place of every decoder layer that is `fusable`; returns how many."""
    if kernels is None:
        return 0
    workspace = StepWorkspace()
    return swap_modules(model, fusable, lambda m: FusedDecodeLayer(m, kernels, m.mlp._router().ops, workspace))
