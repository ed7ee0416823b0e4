"""How much host memory a LoRA training step takes per token of context, measured on the model's own architecture.

`tiermoe fit --train` predicts the longest context a machine can train (all experts on the CPU tier, gradient
checkpointing on, every MoE layer's CPU-tier part in spans of `expert_chunk` tokens) as

    budget = baseline + tiers + adapter state + fixed step bytes + per_token x context

- tiers: the weights as loaded (tiermoe.fit: non-expert weights and every expert in the CPU tier's format);
- adapter state: PEFT's trainable parameter count for the config (PEFT itself, on a meta-device model: no memory)
  x 20 bytes (fp32 weight, gradient, AdamW's two moments, and its update's temporaries);
- per_token and the fixed step bytes: measured. The config is cut to proxies of its first layers, up to its first and
  up to its second MoE layer, with its widths and vocabulary but fewer experts (per-token activations depend on
  top-k, not on the expert count: only the recomputed router logits [T, E] shrink, 4 (E - E') bytes a token in one
  layer at a time), written with random weights, loaded for training, and one forward + backward at two context
  lengths counts the CPU allocator's peak (the profiler's allocation events; with expert LoRA everything runs on
  the calling thread). Per token = base + layers x per layer, from the two proxies; the CPU tier's spans
  (expert_chunk tokens) are measured as the slope they remove (spans of SPAN_PROBE tokens against none) and counted
  once, as fixed bytes;
- baseline: this process's resident memory before the measurement (interpreter, torch, transformers).
"""

from __future__ import annotations

import copy
import gc
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from tiermoe.arch import detect
from tiermoe.config import CPUConfig
from tiermoe.errors import TiermoeError
from tiermoe.model.loader import load_hybrid_model
from tiermoe.training.long_context import set_expert_chunk
from tiermoe.training.lora import apply_lora

ADAPTER_BYTES_PER_PARAM = 20  # fp32 weight + gradient + AdamW's two moments + its update's temporaries
LENGTHS = (128, 384)  # tokens of the two measured steps
SPAN_PROBE = 32  # tokens: spans short enough that the CPU tier's per-span bytes do not grow between LENGTHS
EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


@dataclass(frozen=True)
class ContextMemory:
    """Host bytes of one training step, by term (see the module docstring)."""

    baseline: int
    tiers: int
    adapter_params: int
    per_token_layer: float  # each decoder layer's bytes per token (gradient checkpointing: its saved input)
    per_token_rest: float  # the rest per token: embeddings, the LM head and loss, one layer's recompute
    layers: int
    span_per_token: float  # the CPU tier's bytes per token of a span, held once per span
    expert_chunk: int
    fixed_step: int  # the step's bytes that do not grow with the context

    @property
    def adapter_state(self) -> int:
        return self.adapter_params * ADAPTER_BYTES_PER_PARAM

    @property
    def per_token(self) -> float:
        return self.per_token_rest + self.layers * self.per_token_layer

    @property
    def fixed(self) -> int:
        """Everything but the per-token term."""
        return (self.baseline + self.tiers + self.adapter_state + self.fixed_step
                + int(self.span_per_token * self.expert_chunk))

    def longest_context(self, budget: int) -> int:
        """The most tokens of context one step fits in `budget` bytes (0: not even the weights fit)."""
        return max(0, math.floor((budget - self.fixed) / self.per_token)) if self.per_token > 0 else 0

    def rows(self, budget: int) -> list[tuple[str, str]]:
        gib = (lambda n: f"{n / 2**30:.2f} GiB")
        return [
            ("train: baseline (interpreter, libraries)", gib(self.baseline)),
            ("train: tiers (weights as loaded)", gib(self.tiers)),
            ("train: adapter + AdamW state", (f"{self.adapter_params:,} parameters x {ADAPTER_BYTES_PER_PARAM} B = "
                                              f"{gib(self.adapter_state)}")),
            ("train: step, fixed", gib(self.fixed_step)),
            ("train: CPU-tier spans", (f"{self.expert_chunk} tokens x {self.span_per_token:,.0f} B = "
                                       f"{gib(int(self.span_per_token * self.expert_chunk))}")),
            ("train: per token", (f"{self.per_token_rest:,.0f} B + {self.layers} layers x "
                                  f"{self.per_token_layer:,.0f} B = {self.per_token:,.0f} B")),
            ("train: longest context", f"{self.longest_context(budget):,} tokens in {gib(budget)}"),
        ]


def adapter_parameters(cfg, rank: int) -> int:
    """Trainable parameters of PEFT's LoraConfig(r=rank, target_modules="all-linear") on the transformers model
    of `cfg` (built on the meta device), routed experts included: what tiermoe's apply_lora trains."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(cfg))
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear"))
    return sum(p.numel() for p in peft_model.parameters() if p.requires_grad)


def proxy_config(cfg, layers: int):
    """`cfg` cut to its first `layers` layers, with as few experts as its routing allows (at least 2 x top-k)."""
    spec = detect(cfg)
    out = copy.deepcopy(cfg)
    out.num_hidden_layers = layers
    if isinstance(getattr(out, "layer_types", None), list):
        out.layer_types = out.layer_types[:layers]
    field = next((f for f in EXPERT_COUNT_FIELDS if getattr(out, f, None)), None)
    if field is None:
        raise TiermoeError(f"{spec.model_type}: no expert count field ({', '.join(EXPERT_COUNT_FIELDS)}) to size "
                           "a measuring copy by")
    groups = getattr(out, "n_group", None) or 1
    fewest = max(2 * spec.top_k, 8)
    setattr(out, field, min(spec.num_experts, -(-fewest // groups) * groups))
    return out


def proxy_layer_counts(cfg) -> tuple[int, ...]:
    """The two proxies' layer counts: up to the first MoE layer, and up to the next one (the layers between are
    the model's own kinds); one count when the model has a single MoE layer."""
    moe = sorted(detect(cfg).moe_layers)
    return (moe[0] + 1,) if len(moe) == 1 else (moe[0] + 1, moe[1] + 1)


def step_peak_bytes(model, ids: torch.Tensor) -> int:
    """The most bytes the CPU allocator held at once during one forward + backward, beyond what it held before
    (the profiler's allocation events of the calling thread)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    def walk(events):
        for e in events:
            yield e
            yield from walk(e.children)

    events = sorted(walk(prof.profiler.kineto_results.experimental_event_tree()), key=lambda e: e.start_time_ns)
    net = peak = 0
    for e in events:
        if e.tag == _EventType.Allocation:
            net += e.extra_fields.alloc_size
            peak = max(peak, net)
    return peak


def measure_steps(model_dir: Path, dtype: torch.dtype, cpu_format: str | None, rank: int) -> dict:
    """{(span, tokens): peak bytes} of one step of the checkpoint at `model_dir`, all experts on the CPU tier,
    gradient checkpointing on, spans of SPAN_PROBE tokens and none."""
    from peft import LoraConfig

    cpu = CPUConfig(expert_dtype=cpu_format) if cpu_format else CPUConfig()
    found = {}
    with load_hybrid_model(model_dir, None, gpu_device="cpu", dtype=dtype, cpu=cpu, progress=False,
                           trainable=True) as hybrid:
        model = apply_lora(hybrid, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear"))
        model.gradient_checkpointing_enable()
        model.train()
        vocab = hybrid.config.vocab_size
        gen = torch.Generator().manual_seed(0)
        for span in (SPAN_PROBE, 0):
            set_expert_chunk(hybrid, span)
            for tokens in LENGTHS:
                ids = torch.randint(0, vocab, (1, tokens), generator=gen)
                model.zero_grad(set_to_none=True)
                found[(span, tokens)] = step_peak_bytes(model, ids)
    return found


def write_proxy(cfg, out: Path, dtype: torch.dtype) -> Path:
    """A checkpoint of `cfg` with random weights (initializer_range) at `out`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), dtype=dtype)
    model.save_pretrained(out)
    del model
    gc.collect()
    return out


def _slope(found: dict, span: int) -> float:
    (t1, t2) = LENGTHS
    return (found[(span, t2)] - found[(span, t1)]) / (t2 - t1)


def resident_bytes() -> int:
    """This process's resident memory (Linux /proc; 0 elsewhere)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class StepBytes:
    """The measured terms of a step (see ContextMemory)."""

    per_token_layer: float
    per_token_rest: float
    span_per_token: float
    fixed_step: int


def measure_step_bytes(cfg, dtype: torch.dtype, cpu_format: str | None, rank: int = 16,
                       work_dir: Path | None = None) -> StepBytes:
    """The per-token and fixed bytes of one step of the model of `cfg`, measured on proxies written under
    `work_dir` (default: a temporary directory)."""
    counts = proxy_layer_counts(cfg)
    first = counts[0]
    found = {}
    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        for n in counts:
            path = write_proxy(proxy_config(cfg, n), Path(tmp) / f"layers-{n}", dtype)
            found[n] = measure_steps(path, dtype, cpu_format, rank)
    chunked = {n: _slope(f, SPAN_PROBE) for n, f in found.items()}
    per_layer = (chunked[counts[-1]] - chunked[first]) / (counts[-1] - first) if len(counts) == 2 else 0.0
    last = found[counts[-1]]
    return StepBytes(per_token_layer=per_layer, per_token_rest=chunked[first] - first * per_layer,
                     span_per_token=max(0.0, _slope(last, 0) - chunked[counts[-1]]),
                     fixed_step=max(0, int(last[(SPAN_PROBE, LENGTHS[0])] - chunked[counts[-1]] * LENGTHS[0])))


def context_memory(cfg, tiers: int, dtype: torch.dtype, cpu_format: str | None, rank: int = 16,
                   expert_chunk: int = 4096, work_dir: Path | None = None) -> ContextMemory:
    """The terms of one LoRA training step of the model of `cfg` whose weights take `tiers` bytes as loaded
    (tiermoe.fit.model_bytes)."""
    baseline = resident_bytes()
    step = measure_step_bytes(cfg, dtype, cpu_format, rank, work_dir)
    return ContextMemory(baseline=baseline, tiers=tiers, adapter_params=adapter_parameters(cfg, rank),
                         per_token_layer=step.per_token_layer, per_token_rest=step.per_token_rest,
                         layers=detect(cfg).num_layers, span_per_token=step.span_per_token,
                         expert_chunk=expert_chunk, fixed_step=step.fixed_step)
