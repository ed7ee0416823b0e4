"""The GPU check's checkpoints and the measures its checks share.

Two make-model checkpoints (random weights, Qwen3-MoE's layout), written once per run into the run's work
folder by the first check that needs one, and reused by the later checks (each runs in its own process):
- "small": 4 MoE layers x 64 experts, top-8, hidden 1024: many layers and experts, fast to load;
- "real": one MoE layer at Qwen3-30B-A3B's real shapes (H 2048, I 768, E 128, K 8), where timings, copy sizes
  and memory mean what they will mean for users.
With `quick` (a rehearsal without CUDA) both are toy sizes of the same structure.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import torch

from tiermoe.analysis.gpu_check.plan import CheckContext
from tiermoe.analysis.placement_traffic import strategy_mask
from tiermoe.arch import detect, load_config
from tiermoe.arch.spec import ArchSpec
from tiermoe.testing.make_model import make_model
from tiermoe.testing.presets import make_config

SIZES = {
    "small": dict(hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512, num_hidden_layers=4,
                  mlp_only_layers=[], num_experts=64, num_experts_per_tok=8, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=128, vocab_size=8192, max_position_embeddings=4096),
    "real": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=1,
                 mlp_only_layers=[], num_experts=128, num_experts_per_tok=8, num_attention_heads=32,
                 num_key_value_heads=4, head_dim=128, vocab_size=8192, max_position_embeddings=4096),
}
QUICK_SIZES = {
    "small": dict(hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2, mlp_only_layers=[],
                  num_experts=16, num_experts_per_tok=4, vocab_size=256, max_position_embeddings=512),
    "real": dict(hidden_size=128, moe_intermediate_size=48, num_hidden_layers=1, mlp_only_layers=[],
                 num_experts=32, num_experts_per_tok=8, vocab_size=256, max_position_embeddings=512),
}
EXACT_TOLERANCE = 1e-3  # max |a - ref| / max |ref| of fp32 logits
TINY_ARCHS = ("gpt_oss", "deepseek_v3")  # the engine check's: attention sinks and a sliding window; MLA


def checkpoint(ctx: CheckContext, size: str) -> Path:
    """The run's `size` checkpoint, written now if no earlier check did (into a temporary name, then renamed:
    a check stopped while writing leaves nothing a later one would take for a checkpoint)."""
    path = Path(ctx.work_dir) / size
    if not path.exists():
        partial = Path(ctx.work_dir) / f"{size}.partial-{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        make_model("qwen3_moe", partial, config_overrides=(QUICK_SIZES if ctx.quick else SIZES)[size],
                   progress=False)
        partial.rename(path)
    return path


def model_shape(ckpt: Path) -> tuple[ArchSpec, int]:
    """(its ArchSpec, its vocabulary size), read from config.json without loading the model."""
    config = load_config(ckpt)
    return detect(config), int(config.vocab_size)


def token_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """`num` random prompts of `length` token ids (make-model checkpoints have no tokenizer)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=gen).tolist() for _ in range(num)]


def vocab_of(llm) -> int:
    return int(llm.hybrid.config.vocab_size)


def uniform_mask(spec, ratio: float) -> torch.Tensor:
    """GPU-tier mask [L, E] with `ratio` of each MoE layer's experts on the GPU (the uniform strategy)."""
    return strategy_mask("uniform", spec.moe_row_mask(), spec.num_experts, ratio, None)


def logits(llm, ids: torch.Tensor) -> torch.Tensor:
    """fp32 logits [B, T, V] of one forward of `ids` through the hybrid model, on the host."""
    with torch.inference_mode():
        return llm.hybrid(input_ids=ids.to(llm.hybrid.gpu_device)).logits.float().cpu()


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref|: the project's measure of exactness."""
    a, ref = a.float().cpu(), ref.float().cpu()
    return float((a - ref).abs().max() / ref.abs().max())


def argmax_agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of positions whose most likely token is the same in `a` and `b` ([..., V])."""
    return float((a.argmax(-1) == b.argmax(-1)).float().mean())


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where two outputs differ (None when equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def skipped(reason: str) -> dict:
    return {"status": "skipped", "reason": reason}


NO_CUDA = skipped("no CUDA")


LONG_CONTEXT = 16400  # the long-context checkpoint's positions: a 16k past and its decode steps


def tiny_checkpoint(ctx: CheckContext, arch: str, long_context: bool = False) -> Path:
    """A tiny fp32 checkpoint of `arch` (tiermoe.testing.presets' config, the suite's), written once per run like
    `checkpoint`: GPT-OSS has attention sinks and sliding-window layers, DeepSeek-V3 MLA. `long_context`: with
    LONG_CONTEXT positions (the tiny configs have 256)."""
    from transformers import AutoModelForCausalLM

    name = f"tiny-{arch}" + ("-long" if long_context else "")
    path = Path(ctx.work_dir) / name
    if not path.exists():
        partial = Path(ctx.work_dir) / f"{name}.partial-{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        torch.manual_seed(0)
        extra = {"max_position_embeddings": LONG_CONTEXT} if long_context else {}
        config = make_config(arch, initializer_range=0.1, **extra)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(partial)
        partial.rename(path)
    return path


def check_checkpoints(ctx: CheckContext) -> dict:
    """Write every checkpoint the run's checks read, before any timed check: a check's budget then times the check,
    not the writing of a 1.2 GB file (a check run alone still writes what it needs itself)."""
    seconds = {}
    for name, write in (("small", lambda: checkpoint(ctx, "small")), ("real", lambda: checkpoint(ctx, "real")),
                        *((f"tiny-{arch}", lambda arch=arch: tiny_checkpoint(ctx, arch)) for arch in TINY_ARCHS),
                        ("tiny-qwen3_moe-long", lambda: tiny_checkpoint(ctx, "qwen3_moe", long_context=True))):
        started = time.perf_counter()
        write()
        seconds[name] = round(time.perf_counter() - started, 2)
    return {"status": "pass", "seconds": seconds}
