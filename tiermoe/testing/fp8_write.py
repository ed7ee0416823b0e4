"""Write a checkpoint in the released FP8 layout from a bf16/fp32 one (for tests and benchmarks).

What DeepSeek-V3 and Qwen3-*-FP8 releases quantise: every Linear weight of the decoder layers (attention,
dense MLPs, shared and routed experts) as e4m3 with `weight_scale_inv` per 128x128 block; the embeddings,
lm_head, norms, routers (`mlp.gate`) and biases stay in the source dtype. config.json gains their
`quantization_config` and names bf16 as the model dtype. Tensors are processed one at a time and written shard by shard, so memory stays bounded.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tiermoe.checkpoint.fp8 import is_fp8_quantised, scale_name
from tiermoe.checkpoint.safetensors import Checkpoint
from tiermoe.errors import TiermoeError
from tiermoe.experts.fp8_blocks import DEFAULT_BLOCK, quantize_fp8


def write_fp8_checkpoint(src: str | Path, out: str | Path, block: tuple[int, int] = DEFAULT_BLOCK,
                         shard_bytes: int = 1 << 30) -> Path:
    """Quantise checkpoint `src` into `out` in the released FP8 layout; returns `out`."""
    src, out = Path(src), Path(out)
    if out.exists() and any(out.iterdir()):
        raise TiermoeError(f"output directory '{out}' exists and is not empty; choose a new one")
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    config.pop("torch_dtype", None)
    config["dtype"] = "bfloat16"  # what the releases name: the compute dtype of everything not FP8
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for extra in src.iterdir():  # tokenizer and generation config travel along
        if extra.is_file() and not extra.name.endswith(".safetensors") and extra.name not in (
                "config.json", "model.safetensors.index.json"):
            (out / extra.name).write_bytes(extra.read_bytes())
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    with Checkpoint(src) as ckpt:
        for name in ckpt.entries:
            value = ckpt.read(name)
            tensors = {name: value}
            if is_fp8_quantised(name, tuple(value.shape)):
                q, s = quantize_fp8(value, block)
                tensors = {name: q, scale_name(name): s}
            nbytes = sum(t.nbytes for t in tensors.values())
            if shards[-1] and size + nbytes > shard_bytes:
                _flush(out, shards, len(shards) - 1)
                shards.append({})
                size = 0
            shards[-1].update(tensors)
            size += nbytes
    _flush(out, shards, len(shards) - 1)
    _write_index(out, shards)
    return out


def _shard_file(k: int, n: int | None) -> str:
    return f"model-{k + 1:05d}.safetensors" if n is None else f"model-{k + 1:05d}-of-{n:05d}.safetensors"


def _flush(out: Path, shards: list[dict], k: int) -> None:
    """Write shard k now (under a provisional name) and drop its tensors, so memory stays one shard."""
    save_file(shards[k], str(out / _shard_file(k, None)), metadata={"format": "pt"})
    shards[k] = {name: None for name in shards[k]}  # names kept for the index


def _write_index(out: Path, shards: list[dict]) -> None:
    """Give the flushed shards their final names and write the index from the names each one kept."""
    weight_map = {}
    for k, shard in enumerate(shards):
        final = _shard_file(k, len(shards))
        (out / _shard_file(k, None)).rename(out / final)
        weight_map.update({name: final for name in shard})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
