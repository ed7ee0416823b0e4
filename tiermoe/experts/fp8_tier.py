"""A GPU tier that keeps its experts block-FP8, as FP8 checkpoints store them: about 1 byte per parameter.

Why: on FP8 releases (DeepSeek-V3/R1, Qwen3-*-FP8) the experts are most of the model, so holding GPU-tier experts
in bf16 would halve how many fit. Each expert keeps the checkpoint's own codes and scales for gate, up and down
separately (gate and up are blocked apart on disk, so their rows share a block only when I is a multiple of the
block height; keeping them apart needs no such luck) and is dequantised inside the forward, one expert at a time,
to the activation's dtype, exactly as FP8Linear does for the non-expert weights and as the checkpoint reader
dequantises: the output equals that of the dequantised checkpoint.

Tier swaps keep moving the canonical `ExpertWeights`: `get` dequantises, and `add` of a canonical expert (one
arriving from the CPU tier) quantises it back with the same block rule. For an expert that left this tier through
a bf16/fp32 CPU tier the codes come back unchanged (each block's largest value was a code of 448 times its scale,
so the new scale is the old one up to the compute dtype's rounding, far below e4m3's code spacing); after an
int8/int4 CPU tier the expert carries that format's error too. A move therefore carries the compute dtype over
PCIe, twice the FP8 bytes, on purpose: quantising or dequantising on the host instead would spend CPU time, the
scarce resource while the CPU tier computes, to save a copy that runs on a side stream anyway.

Cost: each forward dequantises the experts it uses (two passes over the weight, see dequantize_fp8) before the
matmul reads them, and computing expert by expert costs the host 3 + g synchronisations per layer (g: the experts
a step routes here). So on CUDA the loader gives FP8 layers tiermoe.experts.slotted_fp8_tier instead (slots of
codes, a grouped GEMM that decodes them in the kernel, no sync); this tier remains where that kernel cannot run
(a CPU device, no triton package), and is the reference the slotted one is tested against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from tiermoe.experts.ffn import ConvertedOnLookup, ExpertActivation, routed_experts_forward
from tiermoe.experts.fp8_blocks import FP8_DTYPES, dequantize_fp8, quantize_fp8, scale_shape
from tiermoe.experts.tiers import ExpertSet
from tiermoe.experts.weights import ExpertWeights


@dataclass
class FP8ExpertWeights:
    """One routed expert as e4m3 codes with fp32 block scales (the released per-expert layout)."""

    gate: torch.Tensor  # e4m3 [I, H]
    gate_scale: torch.Tensor  # fp32 [ceil(I/bn), ceil(H/bk)]
    up: torch.Tensor  # e4m3 [I, H]
    up_scale: torch.Tensor  # fp32 [ceil(I/bn), ceil(H/bk)]
    down: torch.Tensor  # e4m3 [H, I]
    down_scale: torch.Tensor  # fp32 [ceil(H/bn), ceil(I/bk)]
    block: tuple[int, int]

    def __post_init__(self):
        for name in ("gate", "up", "down"):
            if getattr(self, name).dtype not in FP8_DTYPES:
                raise ValueError(f"FP8 expert: '{name}' is {getattr(self, name).dtype}, expected an FP8 dtype")

    @classmethod
    def quantize(cls, w: ExpertWeights, block: tuple[int, int]) -> FP8ExpertWeights:
        """Block-quantise a canonical expert on its own device (how releases were made)."""
        if w.gate_up_bias is not None or w.down_bias is not None:
            raise ValueError("FP8 experts have no biases (no FP8 release of a biased-expert model exists)")
        i = w.gate_up.shape[0] // 2
        return cls(*quantize_fp8(w.gate_up[:i], block), *quantize_fp8(w.gate_up[i:], block),
                   *quantize_fp8(w.down, block), tuple(block))

    def dequantized(self, dtype: torch.dtype) -> ExpertWeights:
        """The canonical expert in `dtype`: gate_up [2I, H] (gate rows first), down [H, I]."""
        i = self.gate.shape[0]
        gate_up = torch.empty((2 * i, self.gate.shape[1]), dtype=dtype, device=self.device)
        dequantize_fp8(self.gate, self.gate_scale, self.block, dtype, out=gate_up[:i])
        dequantize_fp8(self.up, self.up_scale, self.block, dtype, out=gate_up[i:])
        return ExpertWeights(gate_up, dequantize_fp8(self.down, self.down_scale, self.block, dtype))

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self) if f.name != "block"]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @property
    def device(self) -> torch.device:
        return self.gate.device

    def to(self, device: torch.device | str) -> FP8ExpertWeights:
        return FP8ExpertWeights(*(t.to(device, copy=True) for t in self.tensors()), self.block)


def as_fp8(weights: ExpertWeights | FP8ExpertWeights, block: tuple[int, int]) -> FP8ExpertWeights:
    """An expert arriving at an FP8 GPU tier: as it is, or (a canonical one, from the CPU tier) quantised where it
    landed, with the releases' block rule."""
    return weights if isinstance(weights, FP8ExpertWeights) else FP8ExpertWeights.quantize(weights, block)


def fp8_expert_bytes(spec, block: tuple[int, int]) -> int:
    """Bytes of one FP8 expert of `spec` (an ArchSpec): a byte per parameter plus an fp32 scale per block."""
    h, i = spec.hidden_size, spec.expert_intermediate_size
    blocks = 2 * math.prod(scale_shape((i, h), block)) + math.prod(scale_shape((h, i), block))
    return 3 * i * h + 4 * blocks


class FP8ExpertSet(ExpertSet):
    """The GPU tier of one layer whose experts stay block-FP8; `dtype` is what `get` dequantises to (the
    model's compute dtype, the layout tier swaps move)."""

    def __init__(self, device: torch.device | str, act: ExpertActivation, block: tuple[int, int],
                 dtype: torch.dtype):
        super().__init__(device, act)
        self.block = tuple(block)
        self.dtype = dtype

    def add(self, expert: int, weights: ExpertWeights | FP8ExpertWeights) -> None:
        super().add(expert, as_fp8(weights, self.block))

    def get(self, expert: int) -> ExpertWeights:
        return self.experts[expert].dequantized(self.dtype)

    def forward(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        experts = ConvertedOnLookup(self.experts, lambda w: w.dequantized(x_TD.dtype))  # one expert at a time
        return routed_experts_forward(experts, x_TD, ids_TK, weights_TK, self.act)
