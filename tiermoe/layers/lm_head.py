"""The LM head as one contiguous 2-D matmul over the rows it is given, and, for CPU-only runs, a big head packed
for the native kernels and read by every core.

transformers hands the head `hidden_states[:, -1:, :]`: for a prompt of more than one token a strided [B, 1, D]
slice, which torch computes as a bmm that, in bf16 on the CPU, first copies the whole [D, V] weight (622 MB at
Qwen3's vocabulary, seconds per prefill). Folding the rows into one [rows, D] matrix makes it a plain mm on the
weight as it lies: the cost is the rows that are sampled (one per sequence, or every row for prompt logprobs).

At one row per sequence the head's product is a stream of its whole weight, the largest single read of a decode
step on a real vocabulary (622 MB for Qwen3's in bf16), and torch's bf16 product of one row reads it at about
16 GB/s here. A bf16 head of at least WIDE_HEAD_MIN_BYTES on a CPU-only run is therefore held packed (the same
values: tiermoe.layers.quantized_linear in bf16) and computed by the kernels on a team of every core, which the
decode step has to itself by then (the experts are done). Heads tied to the embeddings stay as they are (a packed
copy would hold the weight twice); smaller heads stay in torch on the calling thread.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tiermoe.experts.kernels import Kernels, ThreadTeam
from tiermoe.layers.quantized_linear import QuantizedLinear

WIDE_HEAD_MIN_BYTES = 64 << 20


class RowsLMHead(nn.Module):
    """Swapped in for the model's nn.Linear head; holds the same parameters under the same names (`weight`,
    `bias`), so tied embeddings stay tied and state dicts are unchanged."""

    def __init__(self, head: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = head.in_features, head.out_features
        self.weight = head.weight
        self.bias = head.bias

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.reshape(-1, hidden.shape[-1]).contiguous()  # [rows, D]: a copy of the rows at most
        return F.linear(rows, self.weight, self.bias).view(*hidden.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def use_rows_lm_head(model: nn.Module) -> None:
    """Swap the model's output projection for a RowsLMHead, if it is a plain nn.Linear (after weights are loaded
    and tied: the new module takes the same Parameter objects)."""
    head = model.get_output_embeddings()
    if type(head) is nn.Linear:
        model.set_output_embeddings(RowsLMHead(head))


def wide_head(head: nn.Module) -> bool:
    """Whether `head` is big enough for a team of every core (see the module docstring)."""
    weight = getattr(head, "weight", None)
    return weight is not None and weight.numel() * weight.element_size() >= WIDE_HEAD_MIN_BYTES


def use_packed_lm_head(model: nn.Module, kernels: Kernels, team: Callable[[], ThreadTeam]) -> bool:
    """Swap a big bf16 nn.Linear head not tied to the embeddings for a packed bf16 QuantizedLinear on `team`
    (CPU-only inference; see the module docstring). Returns whether it did."""
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear or head.weight.dtype != torch.bfloat16 or not wide_head(head):
        return False
    embeddings = model.get_input_embeddings()
    if embeddings is not None and embeddings.weight is head.weight:
        return False
    model.set_output_embeddings(QuantizedLinear(head, "bf16", kernels, team))
    return True
