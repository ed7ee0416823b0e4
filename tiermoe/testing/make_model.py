"""Write a randomly initialised checkpoint with a real model's shapes, in the layout real releases use.

For tests and benchmarks where the real weights are out of reach: the tensors are written shard by shard
(bounded memory, whatever the model size), with the checkpoint names a Hugging Face release uses: per-expert
keys (`mlp.experts.{e}.gate_proj.weight`, Mixtral's `block_sparse_moe.experts.{e}.w1.weight`) or GPT-OSS's
fused expert tensors, and `model.safetensors.index.json` when there is more than one shard.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from tiermoe.arch import detect
from tiermoe.errors import TiermoeError
from tiermoe.model.skeleton import build_skeleton
from tiermoe.testing.checkpoint_tokenizer import BYTE_LEVEL_VOCAB, write_tokenizer
from tiermoe.testing.presets import make_config

DEFAULT_SHARD_BYTES = 1 << 30


def make_model(arch: str, out: str | Path, preset: str | None = None, layers: int | None = None,
               dtype: torch.dtype = torch.bfloat16, seed: int = 0, shard_bytes: int = DEFAULT_SHARD_BYTES,
               progress: bool = True, config_overrides: dict | None = None, tokenizer: bool = False) -> Path:
    """Write config.json, generation_config.json and safetensors shards for `arch` to `out`; returns `out`.

    `config_overrides` changes config fields of the preset (or tiny config), e.g. to size a test checkpoint.
    `tokenizer`: write one too (tiermoe.testing.checkpoint_tokenizer; a tiny config's vocabulary grows to the
    byte-level tokenizer's 259 ids), with the config's bos / eos / pad ids set to its own.
    """
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise TiermoeError(f"output directory '{out}' exists and is not empty; choose a new one")
    overrides = dict(config_overrides or {})
    if tokenizer and preset is None:
        overrides["vocab_size"] = max(overrides.get("vocab_size", 0), BYTE_LEVEL_VOCAB)
    cfg = make_config(arch, preset, layers, **overrides)
    cfg.dtype = dtype
    spec = detect(cfg)
    skeleton = build_skeleton(cfg, dtype)
    shapes = _disk_tensors(skeleton, spec, dtype)
    total = sum(s.numel() * dt.itemsize for s, dt in (v for v in shapes.values()))
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer:
        what, fields = write_tokenizer(arch, preset, cfg.vocab_size, out)
        for name, value in fields.items():
            setattr(cfg, name, value)
        if progress:
            print(f"tokenizer: {what}")
    cfg.save_pretrained(out)
    _write_generation_config(cfg, out)
    gen = torch.Generator().manual_seed(seed)
    std = getattr(cfg, "initializer_range", 0.02) or 0.02
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {out.name}", disable=not progress) as bar:
        _write_shards(out, shapes, gen, std, shard_bytes, bar)
    return out


def _disk_tensors(skeleton, spec, dtype) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Checkpoint name -> (shape, dtype), non-expert tensors first, then each layer's experts."""
    tensors: dict[str, tuple[torch.Size, torch.dtype]] = {}
    state = skeleton.state_dict()
    experts_by_layer: dict[int, list[tuple[str, torch.Size]]] = {}
    for name, t in state.items():
        if ".experts." in name:
            continue
        if name == "lm_head.weight" and getattr(skeleton.config, "tie_word_embeddings", False):
            continue
        if spec.disk.block != "mlp":
            name = name.replace(".mlp.", f".{spec.disk.block}.")
        tensors[name] = (t.shape, t.dtype)
    h, i, e_count = spec.hidden_size, spec.expert_intermediate_size, spec.num_experts
    for layer in spec.moe_layers:
        prefix = f"model.layers.{layer}.{spec.disk.block}.experts"
        if spec.disk.fused_kind == "gpt_oss":
            experts_by_layer[layer] = [
                (f"{prefix}.gate_up_proj", torch.Size((e_count, h, 2 * i))),
                (f"{prefix}.gate_up_proj_bias", torch.Size((e_count, 2 * i))),
                (f"{prefix}.down_proj", torch.Size((e_count, i, h))),
                (f"{prefix}.down_proj_bias", torch.Size((e_count, h))),
            ]
        else:
            gate, up, down = spec.disk.proj_names
            experts_by_layer[layer] = [
                entry for e in range(e_count) for entry in (
                    (f"{prefix}.{e}.{gate}.weight", torch.Size((i, h))),
                    (f"{prefix}.{e}.{up}.weight", torch.Size((i, h))),
                    (f"{prefix}.{e}.{down}.weight", torch.Size((h, i))),
                )
            ]
        for name, shape in experts_by_layer[layer]:
            tensors[name] = (shape, dtype)
    return tensors


def _random_tensor(name: str, shape: torch.Size, dtype: torch.dtype, gen: torch.Generator, std: float) -> torch.Tensor:
    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        return torch.ones(shape, dtype=dtype)
    if name.endswith("bias") or "e_score_correction_bias" in name:
        return torch.zeros(shape, dtype=dtype)
    if not dtype.is_floating_point:
        return torch.zeros(shape, dtype=dtype)
    return (torch.randn(shape, generator=gen, dtype=torch.float32) * std).to(dtype)


def _shard_groups(shapes: dict, shard_bytes: int) -> Iterator[list[str]]:
    group, size = [], 0
    for name, (shape, dtype) in shapes.items():
        nbytes = shape.numel() * dtype.itemsize
        if group and size + nbytes > shard_bytes:
            yield group
            group, size = [], 0
        group.append(name)
        size += nbytes
    if group:
        yield group


def _write_shards(out: Path, shapes: dict, gen, std: float, shard_bytes: int, bar) -> None:
    groups = list(_shard_groups(shapes, shard_bytes))
    weight_map, total = {}, 0
    for k, names in enumerate(groups):
        file = "model.safetensors" if len(groups) == 1 else f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        shard = {}
        for name in names:
            shape, dtype = shapes[name]
            shard[name] = _random_tensor(name, shape, dtype, gen, std)
            weight_map[name] = file
            nbytes = shard[name].numel() * shard[name].element_size()
            total += nbytes
            bar.update(nbytes)
        save_file(shard, str(out / file), metadata={"format": "pt"})
        del shard
    if len(groups) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _write_generation_config(cfg, out: Path) -> None:
    fields = {k: getattr(cfg, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (out / "generation_config.json").write_text(json.dumps({k: v for k, v in fields.items() if v is not None}, indent=2))
