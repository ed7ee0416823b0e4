"""Will a model fit, before a single weight is read: byte counts from headers (or config.json alone).

Where the bytes go (what the loader really allocates):
  GPU (main device): non-expert weights (as the skeleton types them; FP8 Linear weights stay FP8: 1 byte per
    parameter plus one fp32 scale per 128x128 block; everything else in the compute dtype), GPU-tier experts (FP8
    as stored in FP8 checkpoints, else the compute dtype), the KV cache at the token budget (full-attention
    layers per token; sliding-window layers up to their window and linear-attention layers a fixed state, per
    running sequence: tiermoe.placement.kv_layout), the layerwise-prefill buffer, the cuBLAS workspaces of the
    threads that run forwards (the engine's and one per running sequence,
    tiermoe.placement.budget.cublas_workspace_bytes) and the transient copies FP8 weights are dequantised into
    (tiermoe.placement.budget.fp8_transient_bytes).
  Host: CPU-tier experts in the --cpu-expert-dtype format (bf16 2 bytes/param, int8 1 byte + 4 per row, int4
    0.547 bytes + 4 per row, see tiermoe.experts.quant), plus one expert of streaming buffer while loading. An int4
    tier also keeps the stored form of each expert it promoted (tiermoe.experts.native): up to the GPU tier's
    expert count more, reported beside the total.
A checkpoint on disk may be larger (fp32) or smaller (FP8, GGUF) than what it becomes in memory; these counts
are of memory. Shapes: E experts per layer, H hidden, I expert intermediate size.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import AutoConfig

from tiermoe.arch import ArchSpec, detect, load_gguf_config, text_config
from tiermoe.bundled import resolve_model
from tiermoe.checkpoint.expert_cache import find_cache
from tiermoe.checkpoint.fp8 import fp8_block_size, is_fp8_quantised
from tiermoe.checkpoint.gguf_reader import gguf_files
from tiermoe.config import (
    MIN_KV_TOKENS_PER_REQUEST,
    NON_EXPERT_DTYPES,
    expert_down_format,
)
from tiermoe.errors import TiermoeError
from tiermoe.experts.fp8_blocks import DEFAULT_BLOCK, dequant_bytes, scale_shape
from tiermoe.experts.fp8_tier import fp8_expert_bytes
from tiermoe.experts.quant import GROUPED, k_align, round_up
from tiermoe.model.held_bytes import (
    ROUTED_EXPERT_NAME,
    HeldBytes,
    fp8_expert_dequant_bytes,
    held_from_headers,
)
from tiermoe.model.non_expert_quant import quantized_bytes_change
from tiermoe.model.skeleton import build_skeleton
from tiermoe.placement.budget import (
    GIB,
    cublas_workspace_bytes,
    forward_threads,
    fp8_transient_bytes,
)
from tiermoe.placement.free_memory import available_ram, device_free_bytes
from tiermoe.placement.kv_layout import KVLayout, kv_layout
from tiermoe.placement.plan import PlacementPlan

# What config.json alone may be told the weights are (`tiermoe fit --dtype`): compute dtype, and whether the
# decoder's Linear weights are FP8 (the released FP8 layout: routers, norms, embeddings and lm_head stay bf16).
CONFIG_DTYPES = {"bf16": (torch.bfloat16, False), "fp16": (torch.float16, False), "fp32": (torch.float32, False),
                 "fp8": (torch.bfloat16, True)}


KERNEL_FORMATS = ("bf16", "int8", "int4", "int6")  # the CPU tier's formats the native kernels compute


def matrix_bytes(n: int, k: int, fmt: str) -> int:
    """Bytes of one W [N, K] stored in a CPU-tier format (tiermoe.experts.quant, "rows" layout)."""
    if fmt == "bf16":
        return 2 * n * k
    if fmt == "int8":
        return n * k + 4 * n
    kp = -(-k // 64) * 64
    if fmt == "int4":
        return n * kp // 2 + 4 * n + n * kp // 32 + n * kp // 64
    if fmt == "int6":
        return n * kp * 3 // 4 + 4 * n + 2 * n * kp // 32
    if fmt in ("fp32", "fp16"):  # kept in the checkpoint's dtype by the torch path
        return n * k * (4 if fmt == "fp32" else 2)
    raise TiermoeError(f"unknown CPU expert format '{fmt}'; choose one of: {', '.join(KERNEL_FORMATS)}")


def cpu_expert_bytes(spec: ArchSpec, fmt: str, dtype: torch.dtype, down_fmt: str | None = None) -> int:
    """One expert on the CPU tier: gate_up [2I, H] (up [I, H] without a gate) in `fmt` and down [H, I] in
    `down_fmt` (None: as a load holds it, int6 under int4: tiermoe.config.expert_down_format), biases in `dtype`,
    and for the native kernels' formats a second copy of the biases in fp32, in the kernels' padded row order
    (tiermoe.experts.native)."""
    h, i, rows = spec.hidden_size, spec.expert_intermediate_size, spec.gate_up_rows
    bias = (rows + h) * dtype.itemsize if spec.expert_bias else 0
    if spec.expert_bias and fmt in KERNEL_FORMATS:
        bias += (rows // i * round_up(i, k_align(fmt)) + h) * 4
    return matrix_bytes(rows, h, fmt) + matrix_bytes(h, i, expert_down_format(fmt, down_fmt)) + bias


def cpu_format(expert_dtype: str | None, dtype: torch.dtype) -> str:
    """The CPU tier's format: the flag, else the compute dtype (as tiermoe.experts.registry chooses it)."""
    if expert_dtype:
        return expert_dtype
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]


@dataclass(frozen=True)
class ModelBytes:
    """A model's memory, by part; computed from headers or config, never from weights."""

    name: str
    spec: ArchSpec
    non_expert: int  # main device
    gpu_bytes_per_expert: int
    cpu_bytes_per_expert: int
    load_buffer: int  # the loader's one-expert host buffer (an expert in the compute dtype)
    cpu_format: str  # the CPU tier's experts' format (their down projections' where `cpu_down_format` says)
    kv: KVLayout  # cache bytes by layer kind (full attention per token, sliding windows, linear-attention states)
    source: str  # "safetensors headers", "config.json (fp8)", "GGUF headers"
    fp8_matrix: int = 0  # the largest FP8 non-expert weight, dequantised (a transient per forward thread)
    fp8_expert: int = 0  # one FP8 GPU-tier expert, dequantised (a transient of the MoE block)
    cpu_down_format: str | None = None  # None: `cpu_format`

    @property
    def cpu_formats(self) -> str:
        """The CPU tier's formats in words: "int4", "int4, down projections int6"."""
        down = self.cpu_down_format
        return self.cpu_format if down in (None, self.cpu_format) else f"{self.cpu_format}, down projections {down}"

    @property
    def total_experts(self) -> int:
        return self.spec.total_routed_experts

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes per token of the full-attention layers (the only ones that grow with every token)."""
        return self.kv.full_per_token


def _non_expert_from_config(cfg, dtype: torch.dtype, fp8: bool) -> tuple[int, int]:
    """(non-expert bytes, the largest FP8 weight dequantised) from the module tree alone (meta skeleton: no
    memory), in the released layout."""

    model = build_skeleton(copy.deepcopy(cfg), dtype)  # a copy: building sets the config's dtype
    tied = getattr(text_config(cfg), "tie_word_embeddings", False) or getattr(cfg, "tie_word_embeddings", False)
    total = fp8_matrix = 0
    for name, t in model.state_dict().items():
        if ROUTED_EXPERT_NAME.search(name) or (tied and name == "lm_head.weight"):
            continue
        if fp8 and is_fp8_quantised(name, tuple(t.shape)):
            nb, kb = scale_shape(tuple(t.shape), DEFAULT_BLOCK)
            total += t.numel() + 4 * nb * kb
            fp8_matrix = max(fp8_matrix, dequant_bytes(tuple(t.shape), DEFAULT_BLOCK, dtype))
        else:
            total += t.numel() * t.element_size()
    return total, fp8_matrix


def model_bytes(model: str | Path, dtype: str | None = None, cpu_expert_dtype: str | None = None,
                non_expert_dtype: str | None = None, head_dtype: str | None = None,
                cpu_expert_down_dtype: str | None = None) -> ModelBytes:
    """Memory of `model`: a checkpoint directory (safetensors headers), a GGUF file or directory, or a config
    file (a .json of any name, or a directory holding only a config.json) whose weights are `dtype` (bf16, fp16,
    fp32 or fp8; default: the dtype the config states). `cpu_expert_down_dtype`: the experts' down projections'
    format (None: as a load holds them, int6 under int4).
    `non_expert_dtype` (--non-expert-dtype): the non-expert linears counted packed in that format, as a CPU-only
    load holds them (tiermoe.model.non_expert_quant), the LM head in `head_dtype` if given (--head-dtype)."""

    path = Path(model)
    if not path.exists():
        raise TiermoeError(f"model path '{path}' does not exist")

    if gguf_files(path):
        cfg = load_gguf_config(path)
        spec = detect(cfg)
        compute = CONFIG_DTYPES[dtype][0] if dtype else spec.dtype
        return _bytes(path.name, spec, cfg, held_from_headers(path, compute, cfg, spec), compute,
                      cpu_expert_dtype, "GGUF headers (converted at load)", non_expert_dtype, head_dtype,
                      cpu_expert_down_dtype)
    config_file = path if path.is_file() else path / "config.json"
    if config_file.suffix != ".json" or not config_file.is_file():
        raise TiermoeError(f"'{path}' is neither a checkpoint directory, a config file (.json) nor a GGUF file")
    try:
        cfg = AutoConfig.from_pretrained(str(config_file), local_files_only=True)
    except (ValueError, KeyError, TypeError, OSError) as err:
        raise TiermoeError(f"{config_file} could not be read as a transformers config: {err}") from None
    spec = detect(cfg)

    # weights count only beside a checkpoint's own config.json: any other .json is a config file alone
    in_checkpoint = config_file.name == "config.json"
    cache = find_cache(config_file.parent) if in_checkpoint else None
    cpu_down_dtype = cpu_expert_down_dtype
    if cache is not None and cpu_expert_dtype in (None, cache.fmt) and cpu_down_dtype in (None, cache.down_fmt):  # a `tiermoe convert` output: its formats,
        cpu_expert_dtype, cpu_down_dtype = cache.fmt, cache.down_fmt  # the source's non-expert weights
    has_weights = cache is not None or (in_checkpoint and any(config_file.parent.glob("*.safetensors")))
    if has_weights:
        compute = CONFIG_DTYPES[dtype][0] if dtype else spec.dtype
        held = held_from_headers(config_file.parent, compute, cfg, spec)
        source = "safetensors headers"
    else:
        dtype = dtype or stated_dtype(cfg)
        if dtype is None:
            raise TiermoeError(f"'{path}' has no weights and states no dtype; say what they are with --dtype (bf16, "
                               "fp16, fp32 or fp8)")
        if dtype not in CONFIG_DTYPES:
            raise TiermoeError(f"--dtype '{dtype}' is unknown; choose one of: {', '.join(CONFIG_DTYPES)}")
        compute, fp8 = CONFIG_DTYPES[dtype]
        non_expert, fp8_matrix = _non_expert_from_config(cfg, compute, fp8)
        gpu_expert = fp8_expert_bytes(spec, DEFAULT_BLOCK) if fp8 else spec.bytes_per_expert(compute)
        fp8_expert = fp8_expert_dequant_bytes(spec, DEFAULT_BLOCK, compute) if fp8 else 0
        held = HeldBytes(non_expert, gpu_expert, fp8_matrix, fp8_expert)
        source = f"{config_file.name} ({dtype})"
    name = config_file.parent.name if in_checkpoint else config_file.stem
    return _bytes(name, spec, cfg, held, compute, cpu_expert_dtype, source, non_expert_dtype, head_dtype,
                  cpu_down_dtype)


def stated_dtype(cfg) -> str | None:
    """What a config says its weights are, as a --dtype name: fp8 for the released FP8 layout (a block-FP8
    quantization_config), else its `dtype` (`torch_dtype` in older configs); None when it says nothing."""
    if fp8_block_size(cfg) is not None:
        return "fp8"
    stated = getattr(text_config(cfg), "dtype", None) or getattr(cfg, "dtype", None)
    return next((name for name, (compute, fp8) in CONFIG_DTYPES.items() if compute == stated and not fp8), None)


def _bytes(name, spec, cfg, held: HeldBytes, compute, cpu_expert_dtype, source,
           non_expert_dtype: str | None = None, head_dtype: str | None = None,
           cpu_down_dtype: str | None = None) -> ModelBytes:
    fmt = cpu_format(cpu_expert_dtype, compute)
    down = expert_down_format(fmt, cpu_down_dtype)
    non_expert = held.non_expert
    if non_expert_dtype is not None:
        if non_expert_dtype not in NON_EXPERT_DTYPES:
            raise TiermoeError(f"--non-expert-dtype '{non_expert_dtype}' is unknown; choose one of: "
                               f"{', '.join(NON_EXPERT_DTYPES)}")
        tied = getattr(text_config(cfg), "tie_word_embeddings", False) or getattr(cfg, "tie_word_embeddings", False)
        skeleton = build_skeleton(copy.deepcopy(cfg), compute)
        non_expert += quantized_bytes_change(skeleton, spec.router_attr, non_expert_dtype, bool(tied),
                                             fp8=held.fp8_matrix > 0, head_dtype=head_dtype)
    return ModelBytes(
        name=name, spec=spec, non_expert=non_expert, gpu_bytes_per_expert=held.gpu_expert,
        cpu_bytes_per_expert=cpu_expert_bytes(spec, fmt, compute, down), load_buffer=spec.bytes_per_expert(compute),
        cpu_format=fmt, cpu_down_format=down,
        kv=kv_layout(text_config(cfg), compute.itemsize), source=source,
        fp8_matrix=held.fp8_matrix, fp8_expert=held.fp8_expert)


@dataclass(frozen=True)
class FitReport:
    """Memory of one placement: `gpu_experts` routed experts on the GPU tier, the rest on the CPU tier."""

    model: ModelBytes
    gpu_experts: int
    kv_tokens: int
    prefill_buffer: int
    gpu_memory: int | None = None  # limits, bytes (None: not given)
    ram: int | None = None
    max_running: int = 16  # sequences at once: each runs its forwards on its own thread
    cuda: bool = True  # the GPU tier is a CUDA device (gpu_device "cpu": no cuBLAS workspaces)

    @property
    def kv_cache(self) -> int:
        """The most max_running sequences holding kv_tokens tokens in all keep (tiermoe.placement.kv_layout)."""
        return self.model.kv.bytes(self.kv_tokens, self.max_running)

    @property
    def workspaces(self) -> int:
        """cuBLAS workspaces of the threads that run forwards (tiermoe.placement.budget)."""
        return forward_threads(self.max_running) * cublas_workspace_bytes() if self.cuda else 0

    @property
    def fp8_transients(self) -> int:
        m = self.model
        return fp8_transient_bytes(forward_threads(self.max_running), m.fp8_matrix, m.fp8_expert)

    @property
    def fixed_gpu(self) -> int:
        """Everything on the GPU but the experts."""
        return (self.model.non_expert + self.kv_cache + self.prefill_buffer + self.workspaces
                + self.fp8_transients)

    @property
    def gpu_total(self) -> int:
        return self.fixed_gpu + self.gpu_experts * self.model.gpu_bytes_per_expert

    @property
    def cpu_experts(self) -> int:
        return (self.model.total_experts - self.gpu_experts) * self.model.cpu_bytes_per_expert

    @property
    def host_total(self) -> int:
        """CPU-tier experts plus the loader's one-expert streaming buffer."""
        return self.cpu_experts + self.model.load_buffer

    @property
    def max_gpu_experts(self) -> int | None:
        """The largest GPU-tier expert count that fits the GPU memory limit (None without one)."""
        if self.gpu_memory is None:
            return None
        m = self.model
        left = self.gpu_memory - self.fixed_gpu
        return max(0, min(m.total_experts, left // m.gpu_bytes_per_expert)) if left > 0 else 0

    @property
    def min_gpu_experts(self) -> int | None:
        """The fewest GPU-tier experts with which the CPU tier fits the RAM limit (None without one)."""
        if self.ram is None:
            return None
        m = self.model
        over = m.total_experts * m.cpu_bytes_per_expert + m.load_buffer - self.ram
        return 0 if over <= 0 else -(-over // m.cpu_bytes_per_expert)

    def problems(self) -> list[str]:
        """Why this placement does not fit the limits (empty when it does)."""
        out = []
        if self.gpu_memory is not None and self.gpu_total > self.gpu_memory:
            fixed = self.fixed_gpu
            what = ("the non-expert weights, KV cache, prefill buffer and compute reserves alone need "
                    f"{_gib(fixed)}" if fixed > self.gpu_memory else
                    f"{self.gpu_experts} GPU experts need {_gib(self.gpu_total)} in all; at most "
                    f"{self.max_gpu_experts} fit")
            out.append(f"GPU memory: {what}, more than the {_gib(self.gpu_memory)} available")
        if self.ram is not None and self.host_total > self.ram:
            need = self.min_gpu_experts
            smaller = "a smaller --cpu-expert-dtype" + (" (or --cpu-expert-down-dtype int4)"
                                                         if self.model.cpu_down_format == "int6" else "")
            hint = (f"; put at least {need} experts on the GPU tier or choose {smaller}"
                    if need is not None and need <= self.model.total_experts else f"; choose {smaller}")
            out.append(f"host memory: the CPU tier needs {_gib(self.host_total)} (experts in "
                       f"{self.model.cpu_formats}), more than the {_gib(self.ram)} available{hint}")
        return out

    def describe(self) -> str:
        m, s = self.model, self.model.spec
        per_layer = self.max_gpu_experts // s.num_moe_layers if self.max_gpu_experts is not None else None
        rows = [
            ("model", (f"{m.name} ({s.model_type}), {s.num_moe_layers} MoE layers x {s.num_experts} experts, "
                       f"from {m.source}")),
            ("GPU: non-expert weights", _gib(m.non_expert)),
            ("GPU: experts", (f"{self.gpu_experts} x {_mib(m.gpu_bytes_per_expert)} = "
                              f"{_gib(self.gpu_experts * m.gpu_bytes_per_expert)}")),
            ("GPU: KV cache", f"{m.kv.describe(self.kv_tokens, self.max_running)} = {_gib(self.kv_cache)}"),
            ("GPU: prefill buffer", _gib(self.prefill_buffer)),
            ("GPU: cuBLAS workspaces", (f"{forward_threads(self.max_running)} threads x "
                                        f"{_mib(cublas_workspace_bytes())} = {_gib(self.workspaces)}"
                                        if self.cuda else "none (the GPU tier is the host)")),
            ("GPU: FP8 transients", _gib(self.fp8_transients) if self.fp8_transients else "none (no FP8 weights)"),
            ("GPU: total", _gib(self.gpu_total) + (f" of {_gib(self.gpu_memory)}" if self.gpu_memory else "")),
            ("host: CPU-tier experts", (f"{m.total_experts - self.gpu_experts} x {_mib(m.cpu_bytes_per_expert)} "
                                        f"({m.cpu_formats}) = {_gib(self.cpu_experts)}")),
            ("host: total", f"{_gib(self.host_total)} (with a one-expert load buffer)"
                            + (f" of {_gib(self.ram)}" if self.ram else "")),
        ]
        if {m.cpu_format, m.cpu_down_format} & set(GROUPED) and self.gpu_experts:  # restored exactly on demotion
            rows.append((f"host: kept {m.cpu_format} forms",  # (tiermoe.experts.native)
                         (f"up to {self.gpu_experts} x {_mib(m.cpu_bytes_per_expert)} = "
                                                   f"{_gib(self.gpu_experts * m.cpu_bytes_per_expert)} more once "
                                                   "dynamic placement has promoted CPU-tier experts")))
        if self.max_gpu_experts is not None:
            rows.append(("largest GPU expert count", (f"{self.max_gpu_experts} of {m.total_experts} "
                                                      f"(--num-gpu-experts {per_layer} per MoE layer)")))
        if self.min_gpu_experts is not None:
            rows.append(("fewest GPU experts for RAM", str(self.min_gpu_experts)))
        problems = self.problems()
        rows.append(("verdict", "fits" if not problems else "does not fit: " + "; ".join(problems)))
        width = max(len(k) for k, _ in rows) + 2
        return "\n".join(f"{k:<{width}}{v}" for k, v in rows)


def _gib(n: int) -> str:
    """Bytes in the largest binary unit that keeps a whole number in front (GiB for real models)."""
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


_mib = _gib


def fit_report(model: ModelBytes, gpu_experts: int | None = None, kv_tokens: int = 8192,
               prefill_buffer_gb: float = 0.0, gpu_memory_gb: float | None = None,
               ram_gb: float | None = None, max_running: int = 16, cuda: bool = True) -> FitReport:
    """A FitReport for `gpu_experts` GPU-tier experts (None: the largest count that fits, 0 without a limit)."""
    gpu_memory = int(gpu_memory_gb * GIB) if gpu_memory_gb is not None else None
    ram = int(ram_gb * GIB) if ram_gb is not None else None
    report = FitReport(model, 0, kv_tokens, int(prefill_buffer_gb * GIB), gpu_memory, ram, max_running, cuda)
    if gpu_experts is None:
        gpu_experts = report.max_gpu_experts or 0
    if not 0 <= gpu_experts <= model.total_experts:
        raise TiermoeError(f"{gpu_experts} GPU experts is outside 0..{model.total_experts} for this model")
    return replace(report, gpu_experts=gpu_experts)


def check_running_kv(sequences: int, flag: str, cfg, dtype: torch.dtype, device: str) -> None:
    """Refuse running `sequences` sequences at once (`flag` names the setting) when even the least KV cache they
    hold, MIN_KV_TOKENS_PER_REQUEST tokens each, does not fit what `device` has free (before loading)."""
    per_sequence = kv_layout(text_config(cfg), dtype.itemsize).bytes(MIN_KV_TOKENS_PER_REQUEST, 1)
    free = device_free_bytes(device)
    if free is None or per_sequence == 0 or sequences * per_sequence <= free:
        return
    raise TiermoeError(f"{flag} {sequences}: each running sequence holds at least {MIN_KV_TOKENS_PER_REQUEST} tokens "
                       f"of KV cache ({per_sequence:,} bytes), and {device} has {free / GIB:,.2f} GiB free: at most "
                       f"{free // per_sequence}")


def check_before_loading(model, plan: PlacementPlan, gpu_device: str, kv_tokens: int,
                         prefill_buffer_gb: float = 0.0, cpu_expert_dtype: str | None = None,
                         max_running: int = 16) -> FitReport:
    """The check `serve` and `generate` run before loading: raise TiermoeError (one line) when `plan` will not
    fit the GPU memory the user gave (--gpu-memory-gb, recorded in the plan's budget) or this machine's
    available RAM.

    Headers only: costs well under a second even for checkpoints of hundreds of GB."""
    model_dir = resolve_model(model)
    bytes_ = model_bytes(model_dir, cpu_expert_dtype=cpu_expert_dtype)
    gpu_experts = int(plan.mask.sum())
    # Only limits the user gave ("auto" was sized from the device's free memory by the planner itself): the KV
    # cache grows with use, so a device's free memory is no hard limit here.
    gpu_memory = plan.budget.get("gpu_memory_gb")
    gpu_memory = None if gpu_memory == "auto" else gpu_memory
    ram = available_ram()
    on_host = str(gpu_device) == "cpu"
    report = fit_report(bytes_, gpu_experts, kv_tokens, prefill_buffer_gb, gpu_memory,
                        None if ram is None else ram / GIB, max_running, cuda=not on_host)
    if on_host and ram is not None:  # the "GPU" tier is host memory too
        report = replace(report, ram=max(0, ram - report.gpu_total))
    problems = report.problems()
    if problems:
        raise TiermoeError(f"{model_dir.name} will not fit: {'; '.join(problems)} (details: tiermoe fit --model "
                           f"{model_dir})")
    return report

