"""PEFT's layout of LoRA on a fused expert parameter, and ours.

PEFT's `ParamWrapper` on an [E, out, in] parameter holds lora_A as an nn.Linear(in, r * E) (weight [r * E, in],
expert e's rows e*r ... e*r + r - 1) and lora_B as an nn.Linear(r * E, out) (weight [out, r * E], expert e's
columns j * E + e: rank-major); expert e's update is scaling * B_e @ A_e. tiermoe's ExpertLoRA keeps A [E, r, in]
and B [E, out, r]. These two pure functions convert, so adapters trained here load with PEFT on the unmodified
transformers model and adapters trained there load here.
"""

from __future__ import annotations

import torch


def from_peft(lora_A: torch.Tensor, lora_B: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(lora_A.weight [r*E, in], lora_B.weight [out, r*E]) -> (A [E, r, in], B [E, out, r])."""
    rE, n_in = lora_A.shape
    if rE % num_experts or lora_B.shape[1] != rE:
        raise ValueError(f"LoRA factors {tuple(lora_A.shape)} and {tuple(lora_B.shape)} do not fit {num_experts} "
                         "experts (expected [r*E, in] and [out, r*E])")
    r = rE // num_experts
    return lora_A.reshape(num_experts, r, n_in), lora_B.reshape(lora_B.shape[0], r, num_experts).permute(2, 0, 1)


def to_peft(A: torch.Tensor, B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [E, r, in], B [E, out, r]) -> (lora_A.weight [r*E, in], lora_B.weight [out, r*E]), contiguous."""
    E, r, n_in = A.shape
    return A.reshape(E * r, n_in).contiguous(), B.permute(1, 2, 0).reshape(B.shape[1], r * E).contiguous()
