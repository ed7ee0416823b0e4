"""The LM head as one contiguous 2-D matmul over the rows it is given.

transformers hands the head `hidden_states[:, -1:, :]`: for a prompt of more than one token a strided [B, 1, D]
slice, which torch computes as a bmm that, in bf16 on the CPU, first copies the whole [D, V] weight (622 MB at
Qwen3's vocabulary, seconds per prefill). Folding the rows into one [rows, D] matrix makes it a plain mm on the
weight as it lies: the cost is the rows that are sampled (one per sequence, or every row for prompt logprobs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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
