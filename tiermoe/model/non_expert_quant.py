"""Quantised non-expert weights for CPU-only runs (--non-expert-dtype; tiermoe.layers.quantized_linear).

Which linears: every plain nn.Linear of the decoder layers (attention projections, linear-attention projections,
dense layers' MLPs, shared experts) and the LM head. Kept as loaded:
  - the router (the MoE block's `gate` / `router`): a few rows that decide which experts run, and tiny (a bf16
    one is held packed in bf16, the same values, by `pack_routers`);
  - Qwen2-MoE / Qwen3-Next's `shared_expert_gate`: one row, a sigmoid scale on the shared expert;
  - norms and embeddings (not linears), and FP8-stored linears (FP8Linear, kept as stored).
Each is packed in --non-expert-dtype's format, except that an int4 model keeps more bits where error hurts most,
as llama.cpp's Q4_K_M does (`linear_format`, matched on the projection's leaf name):
  - attention's keys and values (`k_proj`, `v_proj`, MLA's latent `kv_a_proj_with_mqa` and its expansion
    `kv_b_proj`, whose W_UK / W_UV halves MLAAttention folds into every head's query and output) in int8, as
    Q4_K_M keeps a MoE model's attn_k / attn_v at Q8_0: every query head of a group reads the same keys and
    values, so their error reaches several heads, and they are a small share of a MoE model's bytes (on Qwen3-30B-A3B,
    2 x 512 x 2048 per layer against 4096 x 2048 for q and for o: +46 MB, about 3 % of what a 4-bit token reads).
    On the bundled model they bring the 4-bit model's KL from the unquantised model from 0.00195 to 0.00111 nats
    per token (int8 head) for 3.5 % more bytes read (benchmarks/bench_non_expert_quant.py);
  - attention's output (`o_proj`) in int6, as Q4_K_M keeps attn_output at Q5_K on this kind of model;
  - everything else keeps the format asked: fused projections (Qwen3-Next's `in_proj_qkvz`, a `qkv_proj`) hold
    queries with the keys and values and stay int4, as do q, dense MLPs and shared experts (none in the bundled
    model to measure): a name the rule does not know costs no more bytes than asked.
The LM head takes the format of the rest, but int6 where the rest is int4 (`head_format`), unless --head-dtype
says otherwise (CPUConfig.head_dtype). It is the largest matrix a decode token reads on a Qwen3-30B-A3B-class
model (151,936 x 2048), so its format decides much of a 4-bit model's step: int4 reads 166 MB of it, int6 253 MB,
int8 311 MB, and llama.cpp's Q4_K_M keeps it at Q6_K (255 MB) because logits are the one place where weight error is
not averaged away by later layers. On the bundled model an int4 head triples the 4-bit model's KL. With the
experts' down projections int6 too (tiermoe.config.DOWN_FORMAT_UNDER) the 4-bit model's KL is 0.00071 nats per
token at 3.34 MiB read per token, against Q4_K_M's 0.00083 at 3.35 (int4 o, int8 head and int4 downs: 0.00111 at
3.36; BENCHMARKS.md, "int6 where 4 bits cost most"). `--head-dtype int4` is the faster, coarser choice, int8 the
finer one at 23 % more head bytes. A head tied to the embeddings gets a packed copy of its own; the embeddings keep
the loaded table (one row is read per token).
"""

from __future__ import annotations

import torch
from torch import nn

from tiermoe.checkpoint.fp8 import is_fp8_quantised
from tiermoe.config import NON_EXPERT_AS_LOADED, CPUConfig
from tiermoe.errors import TiermoeError
from tiermoe.experts.kernels import load_kernels
from tiermoe.experts.native import model_team
from tiermoe.experts.quant import block, blocked_nbytes, quantize
from tiermoe.experts.tiers import CPUWorker
from tiermoe.layers.fused_router import ROUTER_FORMS, FusedTopKRouter
from tiermoe.layers.quantized_linear import QuantizedLinear
from tiermoe.model.skeleton import decoder_layers

KEPT_LINEARS = ("shared_expert_gate",)  # see the module's docstring
# Projections an int4 model holds in int8 (module docstring): attention's keys and values, and MLA's latent key /
# value projection and its expansion
INT8_IN_INT4 = ("k_proj", "v_proj", "kv_a_proj_with_mqa", "kv_b_proj")
# ... and in int6: attention's output projection
INT6_IN_INT4 = ("o_proj",)


def linear_format(name: str, fmt: str) -> str:
    """The format --non-expert-dtype `fmt` packs the decoder linear `name` (qualified or its leaf) in: for an int4
    model, int8 for the key / value projections (INT8_IN_INT4) and int6 for attention's output (INT6_IN_INT4; module
    docstring); else `fmt`."""
    leaf = name.rpartition(".")[2]
    if fmt == "int4" and leaf in INT8_IN_INT4:
        return "int8"
    return "int6" if fmt == "int4" and leaf in INT6_IN_INT4 else fmt


def head_format(non_expert_dtype: str, head_dtype: str | None = None) -> str:
    """The packed LM head's format: --head-dtype if given, else the non-expert linears', int6 for int4 (module
    docstring)."""
    return head_dtype or ("int6" if non_expert_dtype == "int4" else non_expert_dtype)


def check_non_expert_dtype(cpu: CPUConfig, gpu_device: torch.device, trainable: bool) -> None:
    """Before anything loads: the options are for CPU-only inference."""
    if cpu.head_dtype is not None and cpu.non_expert_dtype == NON_EXPERT_AS_LOADED:
        raise TiermoeError(f"--head-dtype {cpu.head_dtype} packs the LM head with the other non-expert linears; "
                           "--non-expert-dtype none keeps torch's linears: drop one of the two")
    chosen = cpu.non_expert_dtype if cpu.packs_non_experts else cpu.head_dtype
    if chosen is None:
        return
    flag = "--non-expert-dtype" if cpu.packs_non_experts else "--head-dtype"
    if gpu_device.type != "cpu":
        raise TiermoeError(f"{flag} {chosen} is for CPU-only runs (--gpu-device cpu); "
                           f"on {gpu_device} the non-expert weights stay in the model's dtype")
    if trainable:
        raise TiermoeError(f"{flag} {chosen} quantises weights for inference; a model to "
                           "fine-tune keeps its non-expert weights as loaded")


def check_head_dtype(cpu: CPUConfig) -> None:
    """Once the CPU-only defaults are filled in (tiermoe.model.cpu_only): a head format needs a packed head."""
    if cpu.head_dtype is not None and not cpu.packs_non_experts:
        raise TiermoeError(f"--head-dtype {cpu.head_dtype} applies where the non-expert linears are packed, and "
                           "this run keeps them as loaded: give --non-expert-dtype too")


def quantizable_linears(model: nn.Module, router_attr: str) -> list[tuple[str, nn.Linear]]:
    """(qualified name, module) of the decoder layers' linears that --non-expert-dtype quantises (not the head)."""
    found = []
    for i, layer in enumerate(decoder_layers(model)):
        for name, module in layer.named_modules():
            leaf = name.rpartition(".")[2]
            # a router is kept as loaded, with the linears inside it (a discovered family's router module may hold one)
            if type(module) is nn.Linear and router_attr not in name.split(".") and leaf not in KEPT_LINEARS:
                found.append((f"model.layers.{i}.{name}", module))
    return found


def quantize_non_experts(model: nn.Module, router_attr: str, cpu: CPUConfig, worker: CPUWorker) -> int:
    """Swap the linears `quantizable_linears` names, and the LM head, for QuantizedLinear modules in
    `cpu.non_expert_dtype` computed on the model's kernel thread team; returns how many were swapped."""
    fmt = cpu.non_expert_dtype
    kernels = load_kernels()
    team = model_team(worker, kernels, cpu)
    swapped = 0
    for name, linear in quantizable_linears(model, router_attr):
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, QuantizedLinear(linear, linear_format(name, fmt), kernels, team))
        swapped += 1
    head = model.get_output_embeddings()
    if type(head) is nn.Linear:
        model.set_output_embeddings(QuantizedLinear(head, head_format(fmt, cpu.head_dtype), kernels, team))
        swapped += 1
    return swapped


def pack_routers(model: nn.Module, cpu: CPUConfig, worker: CPUWorker) -> int:
    """Hold every fused softmax top-k router's (tiermoe.layers.fused_router) bf16 weight packed in bf16, computed on
    the model's kernel thread team, as the other linears are: the same values, so routing stays unquantised, and
    one kernel call where torch's bf16 product of one row costs 20-50 us. The packed matrix replaces the loaded
    weight (the router's `weight` becomes None), so memory is what the packed layout holds (the same bytes where
    the experts are a multiple of 16). Call after tiermoe.model.fused_layers swapped the routers in; returns how
    many were packed."""
    kernels = load_kernels()
    if kernels is None:
        return 0
    team = model_team(worker, kernels, cpu)
    packed = 0
    for module in model.modules():
        if (isinstance(module, FusedTopKRouter) and module.weight is not None
                and module.weight.dtype == torch.bfloat16 and module.weight.device.type == "cpu"):
            module.packed = QuantizedLinear.holding(block(quantize(module.weight.detach(), "bf16")), None, kernels,
                                                    team)
            module.weight = None
            packed += 1
    return packed


def quantized_bytes_change(skeleton: nn.Module, router_attr: str, fmt: str, tied_head: bool,
                           fp8: bool = False, head_dtype: str | None = None) -> int:
    """Bytes that quantising to `fmt` (each linear to `linear_format(name, fmt)`, the head to `head_format(fmt,
    head_dtype)`) adds to the non-expert weights of `skeleton` (a meta model: shapes only; negative: saved), bf16
    routers packed included. `tiermoe fit` adds it to what the checkpoint's headers say. fp8: the checkpoint stores
    its decoder linears in FP8, which a load keeps as stored (not packed)."""
    change = 0
    for name, linear in quantizable_linears(skeleton, router_attr):
        weight = linear.weight
        if not (fp8 and is_fp8_quantised(f"{name}.weight", tuple(weight.shape))):
            change += blocked_nbytes(linear_format(name, fmt), *weight.shape) - weight.numel() * weight.element_size()
    head = skeleton.get_output_embeddings()
    if type(head) is nn.Linear:
        packed = blocked_nbytes(head_format(fmt, head_dtype), *head.weight.shape)
        change += packed if tied_head else packed - head.weight.numel() * head.weight.element_size()
    for module in skeleton.modules():  # pack_routers
        if ROUTER_FORMS.of(type(module)) is not None and module.weight.dtype == torch.bfloat16:
            change += blocked_nbytes("bf16", *module.weight.shape) - module.weight.numel() * 2
    return change
