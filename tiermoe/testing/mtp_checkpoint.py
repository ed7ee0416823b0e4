"""Tiny DeepSeek-V3 checkpoints with a multi-token-prediction (MTP) layer, for tests of `nextn` drafting.

A released DeepSeek-V3/R1 or GLM-4.5 checkpoint stores its MTP module as decoder layer `num_hidden_layers`
(`model.layers.{N}.*`): a full decoder layer (attention, MoE) plus `enorm`, `hnorm`, `eh_proj` and
`shared_head.norm` / `shared_head.head`. transformers' save_pretrained writes no such layer, so these helpers add
one to a saved model: into its model.safetensors, or as a shard of its own that the checkpoint's index names.

- `add_mtp_layer`: random MTP weights (drafts a random model would make: some accepted, most rejected);
- `add_exact_mtp_layer`: for a model built by `exact_mtp_config` (one MoE layer whose attention adds nothing, and
  unit-RMS embeddings, so its next token is a function of the current token alone), an MTP layer that computes the
  same function of the token it is given: every draft is the model's own next token. `shift=1` makes its head
  score token v with the model's row v - 1, so every draft is one past the model's token: always wrong.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

MTP_FILE = "mtp.safetensors"


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118 - safe_open is no dict
    return out


def _write(model_dir: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Add `tensors` to the checkpoint: into its one file (rewritten), or as a shard of their own named in its
    index (transformers reads only the files an index names, or model.safetensors)."""
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        save_file(tensors, str(model_dir / MTP_FILE), metadata={"format": "pt"})
        data = json.loads(index.read_text())
        data["weight_map"].update(dict.fromkeys(tensors, MTP_FILE))
        index.write_text(json.dumps(data, indent=2))
        return
    single = model_dir / "model.safetensors"
    with safe_open(single, "pt") as f:
        held = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - safe_open is no dict
    save_file({**held, **tensors}, str(single), metadata={"format": "pt"})


def _layer_count(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["num_hidden_layers"])


def add_mtp_layer(model_dir: str | Path, seed: int = 0, head: bool = True) -> Path:
    """Add a random MTP layer to the saved DeepSeek-V3 or GLM-4.5 model in `model_dir` (its last decoder layer, a
    MoE one, gives the shapes); `head` False leaves `shared_head.head` out (the model's lm_head is then the MTP's
    head)."""
    model_dir = Path(model_dir)
    n = _layer_count(model_dir)
    tensors = _tensors(model_dir)
    gen = torch.Generator().manual_seed(seed)
    last, new = f"model.layers.{n - 1}.", f"model.layers.{n}."
    mtp = {}
    for name, t in tensors.items():
        if name.startswith(last):
            value = 1 + 0.1 * torch.randn(t.shape, generator=gen) if name.endswith("norm.weight") else \
                0.1 * torch.randn(t.shape, generator=gen)
            mtp[new + name.removeprefix(last)] = value.to(t.dtype)
    hidden = tensors["model.norm.weight"].numel()
    dtype = tensors["model.norm.weight"].dtype
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        mtp[f"{new}{norm}.weight"] = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    mtp[f"{new}eh_proj.weight"] = (0.1 * torch.randn(hidden, 2 * hidden, generator=gen)).to(dtype)
    if head:
        mtp[f"{new}shared_head.head.weight"] = (0.1 * torch.randn(tensors["lm_head.weight"].shape,
                                                                   generator=gen)).to(dtype)
    _write(model_dir, mtp)
    return model_dir


def exact_mtp_config() -> dict:
    """Config values (over the tiny deepseek_v3 ones) of a model `add_exact_mtp_layer` can copy: one decoder layer,
    a MoE one."""
    return {"num_hidden_layers": 1, "first_k_dense_replace": 0}


def add_exact_mtp_layer(model_dir: str | Path, shift: int = 0) -> Path:
    """Rewrite the one-layer model in `model_dir` so its next token depends on the current token only (the
    attention's output projection zeroed; every embedding row scaled to RMS 1), and add an MTP layer that computes
    that function of the token it is given: a copy of the layer, `eh_proj` = [I | 0] (the embedding passes, the
    hidden state is dropped), `enorm` of ones (a unit-RMS row comes out unchanged but for the norm's epsilon),
    `shared_head.norm` = the model's final norm and `shared_head.head` = the LM head with its rows rolled by
    `shift` (0: every draft is the model's next token; 1: never)."""
    model_dir = Path(model_dir)
    if _layer_count(model_dir) != 1:
        raise ValueError("add_exact_mtp_layer copies a one-layer model (exact_mtp_config)")
    tensors = _tensors(model_dir)
    embed = tensors["model.embed_tokens.weight"]
    tensors["model.embed_tokens.weight"] = embed / embed.pow(2).mean(dim=-1, keepdim=True).sqrt()
    tensors["model.layers.0.self_attn.o_proj.weight"].zero_()
    for file in sorted(model_dir.glob("*.safetensors")):  # the main weights, rewritten in their own files
        with safe_open(file, "pt") as f:
            names = list(f.keys())
        save_file({k: tensors[k].contiguous() for k in names}, str(file), metadata={"format": "pt"})
    hidden = embed.shape[1]
    mtp = {f"model.layers.1.{name.removeprefix('model.layers.0.')}": t.clone()
           for name, t in tensors.items() if name.startswith("model.layers.0.")}
    mtp["model.layers.1.enorm.weight"] = torch.ones(hidden, dtype=embed.dtype)
    mtp["model.layers.1.hnorm.weight"] = torch.ones(hidden, dtype=embed.dtype)
    mtp["model.layers.1.eh_proj.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1).to(
        embed.dtype)
    mtp["model.layers.1.shared_head.norm.weight"] = tensors["model.norm.weight"].clone()
    mtp["model.layers.1.shared_head.head.weight"] = tensors["lm_head.weight"].roll(shift, dims=0)
    _write(model_dir, mtp)
    return model_dir
