"""Load a DeepSeek-V3/R1 or GLM-4.5 checkpoint's MTP layer, which transformers drops when it loads the model.

The checkpoint stores it as decoder layer N = num_hidden_layers (`model.layers.{N}.*`; the families'
`_keys_to_ignore_on_load_unexpected` skip it, and the engine's skeleton, built from config.json, has N layers): a
normal decoder layer's attention and MoE weights, plus `enorm`, `hnorm`, `eh_proj`, `shared_head.norm` and, in
some checkpoints, `shared_head.head` (else the model's LM head is the MTP's; its embedding is always the model's).
It is built here beside the loaded model as the family's own transformers decoder layer (DeepSeek's attention an
MLAAttention: the latent cached in the pool like every layer's; GLM's attends through the pool's attention
function like the model's) and its MoE block a HybridMoE. Its experts are placed like the
last MoE layer's (no statistics record the MTP layer yet: the last layer's is the nearest evidence), GPU-tier ones
in a slot pool of their own, CPU-tier ones in a CPU tier of `cpu`'s backend. Non-expert weights load onto the main
device in the dtype of the model's same-named weights (the router's fp32 kept), FP8-stored ones dequantised into
the model's dtype (the layer's share of the model is small).
"""

from __future__ import annotations

import copy
import importlib
from pathlib import Path

import torch
from torch import nn

from tiermoe.checkpoint.fp8 import fp8_block_size
from tiermoe.config import CPUConfig
from tiermoe.errors import TiermoeError
from tiermoe.experts.ffn import ExpertActivation
from tiermoe.experts.host_slab import pins_host_memory
from tiermoe.experts.registry import make_cpu_tier
from tiermoe.experts.slot_pool import ExpertSlotPool
from tiermoe.experts.slotted_tier import SlottedExpertSet
from tiermoe.layers.hybrid_moe import HybridMoE
from tiermoe.layers.mla_attention import group_kv_b_rows_of, replace_mla_attention
from tiermoe.layers.mtp_module import MTPModule
from tiermoe.model.expert_source import LAYERS_PREFIX, find_expert_source, read_expert
from tiermoe.model.gguf_checkpoint import open_checkpoint
from tiermoe.model.skeleton import decoder_layers, meta_tensors

# Families whose MTP layer tiermoe runs -> their transformers decoder-layer and RMSNorm classes (the MTP layer is one
# of the family's decoder layers; SGLang's GLM-4.5 NextN is DeepSeek-V3's with GLM's layer).
MTP_CLASSES = {"deepseek_v3": ("DeepseekV3DecoderLayer", "DeepseekV3RMSNorm"),
               "glm4_moe": ("Glm4MoeDecoderLayer", "Glm4MoeRMSNorm")}
MTP_MODEL_TYPES = tuple(MTP_CLASSES)
# The MTP module's own tensors: the module's name -> the checkpoint's, under model.layers.{N}.
_OWN_NAMES = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "norm": "shared_head.norm",
              "head": "shared_head.head"}


def mtp_layer_index(config) -> int:
    """N: the decoder-layer index the checkpoint stores its (first) MTP layer under."""
    return int(config.num_hidden_layers)


def check_mtp_checkpoint(model_dir: str | Path, config, model_type: str) -> None:
    """Refuse, in one line, a model whose MTP layer tiermoe cannot run: another family, or no MTP weights."""
    if model_type not in MTP_MODEL_TYPES:
        raise TiermoeError(f"--speculative-algorithm nextn runs the MTP layers of {', '.join(MTP_MODEL_TYPES)} "
                           f"checkpoints; this is a {model_type} model (use --speculative-algorithm ngram)")
    n = mtp_layer_index(config)
    with open_checkpoint(model_dir, config, fp8_block_size(config)) as ckpt:
        found = f"{LAYERS_PREFIX}.{n}.eh_proj.weight" in ckpt
    if not found:
        raise TiermoeError(f"--speculative-algorithm nextn needs the checkpoint's MTP layer, but "
                           f"{Path(model_dir).name} has no '{LAYERS_PREFIX}.{n}.eh_proj.weight' "
                           "(use --speculative-algorithm ngram)")


def load_mtp_module(hybrid, cpu: CPUConfig | None = None) -> MTPModule:
    """The MTP layer of `hybrid`'s checkpoint, ready to run on the engine's pool (layer index N); `cpu`: its CPU
    tier's backend (None: the default one)."""
    config, spec, model = hybrid.config, hybrid.spec, hybrid.model
    check_mtp_checkpoint(hybrid.model_dir, config, spec.model_type)
    if hybrid.share is not None:
        raise TiermoeError("--speculative-algorithm nextn runs in one process; several ranks do not load the MTP layer")
    n, device, dtype = mtp_layer_index(config), hybrid.gpu_device, model.dtype
    prefix = f"{LAYERS_PREFIX}.{n}."
    # the model's live config: its attention implementation is the pool's (tiermoe.layers.paged_attention)
    layer_config = copy.deepcopy(model.config)
    layer_config.num_hidden_layers = n + 1  # index n exists (and, past first_k_dense_replace, is a MoE layer)
    hidden, eps = config.hidden_size, config.rms_norm_eps
    modeling = importlib.import_module(f"transformers.models.{spec.model_type}.modeling_{spec.model_type}")
    layer_class, norm_class = (getattr(modeling, name) for name in MTP_CLASSES[spec.model_type])
    with torch.device("meta"):
        layer = layer_class(layer_config, n)
        own = {"enorm": norm_class(hidden, eps), "hnorm": norm_class(hidden, eps),
               "eh_proj": nn.Linear(2 * hidden, hidden, bias=False), "norm": norm_class(hidden, eps)}
    replace_mla_attention([layer])
    reference = decoder_layers(model)[spec.moe_layers[-1]]  # the dtypes of the model's own weights
    with open_checkpoint(hybrid.model_dir, config, fp8_block_size(config)) as ckpt:
        if f"{prefix}shared_head.head.weight" in ckpt:
            with torch.device("meta"):
                own["head"] = nn.Linear(hidden, config.vocab_size, bias=False)
        layer.mlp = _hybrid_block(layer.mlp, hybrid, n, cpu or CPUConfig())
        _load_weights(layer, prefix, ckpt, device, dtype, dict(reference.named_parameters()))
        for name, module in own.items():
            _load_weights(module, f"{prefix}{_OWN_NAMES[name]}.", ckpt, device, dtype, {})
        _load_experts(layer.mlp, hybrid, ckpt, n)
    group_kv_b_rows_of([layer])
    layer.eval()
    head = own.pop("head", None) or model.get_output_embeddings()
    return MTPModule(own["enorm"], own["hnorm"], own["eh_proj"], layer, own["norm"], head,
                     model.get_input_embeddings(), model.model.rotary_emb, n)


def _hybrid_block(block: nn.Module, hybrid, layer: int, cpu: CPUConfig) -> HybridMoE:
    """The MTP layer's MoE block with a GPU tier (slots of its own pool, sized for the experts placed there) and
    a CPU tier, its experts not yet read."""
    spec = hybrid.spec
    act = ExpertActivation.from_config(spec.activation, hybrid.config)
    pool = ExpertSlotPool(hybrid.gpu_device)
    pool.reserve(int(_placement(hybrid).ge(0).sum()))
    cpu_tier = make_cpu_tier(cpu, hybrid.cpu_worker, act, pins_host_memory(hybrid.gpu_device), hybrid.expert_dtype)
    return HybridMoE(block, spec, layer, SlottedExpertSet(act, spec.num_experts, pool), cpu_tier)


def _placement(hybrid) -> torch.Tensor:
    """[E]: the MTP layer's experts' places (-1 the CPU tier, 0 the GPU tier): those of the last MoE layer."""
    return hybrid.assignment[hybrid.spec.moe_layers[-1]].clone()


def _load_weights(module: nn.Module, prefix: str, ckpt, device: torch.device, dtype: torch.dtype,
                  like: dict[str, torch.Tensor]) -> None:
    """Every meta parameter and buffer of `module` from the checkpoint tensor `prefix + its name`, on `device`, in
    the dtype of `like[name]` (the model's same-named weight) or `dtype`."""
    for name, sub, leaf, t, is_param in list(meta_tensors(module)):
        disk = prefix + name
        if disk not in ckpt:
            raise TiermoeError(f"checkpoint is missing tensor '{disk}' of the MTP layer")
        same = like.get(name)  # the model's: its dtype where it holds floats (not FP8 codes nor packed ones)
        kept = same.dtype if same is not None and same.dtype.is_floating_point and same.element_size() > 1 else None
        want = kept or (dtype if t.dtype.is_floating_point else t.dtype)
        value = ckpt.read(disk, torch.empty(t.shape, dtype=want)).to(device)
        if is_param:
            sub._parameters[leaf] = nn.Parameter(value, requires_grad=False)
        else:
            sub._buffers[leaf] = value


def _load_experts(block: HybridMoE, hybrid, ckpt, layer: int) -> None:
    spec = hybrid.spec
    source = find_expert_source(ckpt, spec, LAYERS_PREFIX, layer)
    for e, owner in enumerate(_placement(hybrid).tolist()):
        on_gpu = owner >= 0
        block.assign(e, 0 if on_gpu else -1)
        (block.gpu_tier if on_gpu else block.cpu_tier).add(e, read_expert(ckpt, source, e, spec, hybrid.expert_dtype))
