"""A GGUF model seen through the checkpoint interface the loader reads: transformers' tensor names, torch layout.

Each tensor the transformers skeleton needs is mapped to its GGUF tensor with the gguf package's own name map
(`gguf.get_tensor_name_map`, e.g. `model.layers.0.self_attn.q_proj` -> `blk.0.attn_q`). Routed experts, merged
in GGUF as `blk.N.ffn_{gate,up,down}_exps.weight` [E, ...], appear as transformers' fused
`model.layers.N.mlp.experts.gate_up_proj` [E, 2I, H] / `down_proj` [E, H, I], read one expert at a time.
llama.cpp permutes the rows of Llama-family q/k projections for its rotary layout, and its newer DeepSeek files
split `kv_b_proj` into per-head `attn_k_b` (transposed) and `attn_v_b`; reading undoes both.

Experts are converted at load, not kept in their GGUF quantisation: each is dequantised (exactly, in fp32) and
then takes the tier's format, so the only error added to the GGUF's own is the compute dtype's rounding (none
in fp32; bf16 rounds each weight to 8 significant bits, at most 0.4 %) and the --cpu-expert-dtype quantisation
if one is chosen. Keeping Q4_K experts in place would need a Q4_K CPU kernel, which tiermoe does not have.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path

import gguf
import torch

from tiermoe.arch import load_config
from tiermoe.checkpoint.expert_cache import find_cache
from tiermoe.checkpoint.gguf_reader import GGUFFiles, gguf_files
from tiermoe.checkpoint.safetensors import Checkpoint, TensorIndex, checkpoint_files
from tiermoe.errors import TiermoeError
from tiermoe.model.skeleton import build_skeleton

_FUSED = {"gate_up_proj": ("ffn_gate_exps", "ffn_up_exps"), "down_proj": ("ffn_down_exps",)}


@dataclass(frozen=True)
class GGUFEntry:
    """What inspection needs of one tensor: its file, torch shape, stored bytes; read as fp32."""

    file: Path
    shape: tuple[int, ...]
    nbytes: int
    gguf_names: tuple[str, ...]
    op: str  # "plain" | "permute_q" | "permute_k" | "kv_b"
    dtype: torch.dtype = torch.float32

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: rows (h, 2, d/2) were stored as (h, d/2, 2)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GGUFCheckpoint(TensorIndex):
    """The Checkpoint interface (entries, `in`, shape, read) over a GGUF model, with transformers' names. Nothing
    to close: the gguf package's memory maps close with its reader objects."""

    def __init__(self, path: str | Path, config=None):
        self.model_dir = Path(path)
        self.fp8_block = None
        self.files = GGUFFiles(path)
        self.config = config or load_config(path)
        arch = self.files.architecture
        try:
            name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], self.config.num_hidden_layers)
        except KeyError:
            raise TiermoeError(f"GGUF architecture '{arch}' is unknown to the gguf package") from None
        permute = arch == "llama"  # llama.cpp permutes q/k rows of Llama-family models only
        self.entries: dict[str, GGUFEntry] = {}
        # a copy: building a model sets the config's dtype, and the caller's config must keep its own
        for name, t in build_skeleton(copy.deepcopy(self.config), torch.float32).state_dict().items():
            base, _, leaf = name.rpartition(".")
            if base.endswith(".experts") and leaf in _FUSED:
                layer = base.split(".")[2]
                names = tuple(f"blk.{layer}.{g}.weight" for g in _FUSED[leaf])
                op = "plain"
            elif leaf == "e_score_correction_bias":
                names, op = (f"blk.{base.split('.')[2]}.exp_probs_b.bias",), "plain"
            else:
                mapped = name_map.get_name(base)
                if mapped is None:
                    continue
                names = (f"{mapped}.{leaf}",)
                op = "plain"
                if permute and base.endswith("self_attn.q_proj") and leaf == "weight":
                    op = "permute_q"
                elif permute and base.endswith("self_attn.k_proj") and leaf == "weight":
                    op = "permute_k"
            if base.endswith("self_attn.kv_b_proj") and names[0] not in self.files.tensors:
                blk = names[0].rsplit(".", 2)[0]  # llama.cpp's newer DeepSeek files split kv_b per head
                names, op = (f"{blk}.attn_k_b.weight", f"{blk}.attn_v_b.weight"), "kv_b"
            if not all(n in self.files.tensors for n in names):
                continue  # missing: the loader names it (or ties lm_head to the embeddings)
            nbytes = sum(self.files.nbytes(n) for n in names)
            self.entries[name] = GGUFEntry(self.files.file_of[names[0]], tuple(t.shape), nbytes, names, op)
            self._check_shape(name, tuple(t.shape), names)

    def _check_shape(self, name: str, want: tuple[int, ...], names: tuple[str, ...]) -> None:
        got = [self.files.shape(n) for n in names]
        numel = sum(torch.Size(s).numel() for s in got)
        if numel != torch.Size(want).numel():
            raise TiermoeError(f"GGUF tensor {', '.join(names)} has shape {got}, but the config's model needs "
                               f"{name} of shape {list(want)}")

    def read(self, name: str, out: torch.Tensor | None = None, index: int | None = None) -> torch.Tensor:
        """Tensor `name` (or its slice [index] along dim 0), dequantised into `out` (fp32 when None)."""
        entry = self.entries[name]
        shape = entry.shape if index is None else entry.shape[1:]
        if (out is not None and entry.op == "plain" and len(entry.gguf_names) == 1 and out.is_contiguous()
                and self.files.shape(entry.gguf_names[0])[1 if index is not None else 0:] == tuple(shape)):
            return self.files.read(entry.gguf_names[0], index, out)  # straight in, chunk by chunk (embeddings)
        parts = [self.files.read(n, index) for n in entry.gguf_names]
        if entry.op == "kv_b":  # k_b [heads, kv_lora, nope] and v_b [heads, v, kv_lora] -> [heads (nope + v), kv_lora]
            k_b, v_b = parts
            value = torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, k_b.shape[1])
        else:
            value = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)  # gate rows, then up rows
        if entry.op == "permute_q":
            value = _unpermute(value, self.config.num_attention_heads)
        elif entry.op == "permute_k":
            value = _unpermute(value, self.config.num_key_value_heads)
        if out is None:
            out = torch.empty(shape, dtype=torch.float32)
        if tuple(out.shape) != tuple(shape):
            raise TiermoeError(f"{self.model_dir}: tensor {name} has shape {list(shape)}, expected {list(out.shape)}")
        return out.copy_(value.reshape(shape))


def weight_files(path: str | Path) -> list[Path]:
    """The files holding a model's weights: its GGUF files, else its safetensors files."""

    return gguf_files(path) or checkpoint_files(Path(path))


def open_checkpoint(path: str | Path, config=None, fp8_block: tuple[int, int] | None = None):
    """A Checkpoint for a safetensors directory, a GGUFCheckpoint for a GGUF file or directory; for a
    `tiermoe convert` cache, the checkpoint of the source it was converted from."""

    cache = find_cache(path)
    if cache is not None:
        path = cache.source

    if gguf_files(path):
        return GGUFCheckpoint(path, config)
    return Checkpoint(path, fp8_block)
