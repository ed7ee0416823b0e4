"""The routed experts' feed-forward, shared by every tier and the reference backend.

Legend: T tokens, D hidden, K top-k, N (token, expert) pairs routed to one expert.
ids_TK holds expert ids, or -1 for pairs that belong to another tier; weights_TK the router's weights.
Results accumulate in the input dtype after scaling in the weights' dtype, as transformers' experts do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from tiermoe.experts.weights import ExpertWeights


def _named_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """transformers' activation `name` (ACT2FN). Imported here, not with this module: transformers.activations
    imports transformers' model loading (seconds), and tiermoe.experts is imported by commands that compute no
    expert (`tiermoe stats`, `tiermoe place`); an import of a loaded module costs well under the lookup itself."""
    from transformers.activations import ACT2FN

    return ACT2FN[name]


@dataclass(frozen=True)
class ExpertActivation:
    """How an expert turns gate/up projections into the down projection's input.

    "silu_glu" and "gpt_oss_glu" are computed here (and both by the native kernels too). "model" is any
    other experts module's own arithmetic: its `_apply_gate` (or, for experts without a gate, its `act_fn`) is
    called on the module itself (its parameters stay on the meta device; the methods read scalars and
    activations only), with gate and up interleaved again where the module keeps them so (tiermoe's layout
    has gate rows first).
    """

    kind: str  # "silu_glu" | "gpt_oss_glu" | "model"
    hidden_act: str = "silu"
    alpha: float = 1.702  # GPT-OSS only
    limit: float = 7.0  # GPT-OSS only
    module: Any = field(default=None, compare=False, repr=False)  # "model": the transformers experts module
    gated: bool = True
    interleaved: bool = False  # "model": the module's own gate_up output alternates gate and up columns

    @classmethod
    def from_config(cls, kind: str, cfg) -> ExpertActivation:
        if kind == "gpt_oss_glu":
            return cls(kind, alpha=getattr(cfg, "swiglu_alpha", 1.702), limit=cfg.swiglu_limit)
        return cls(kind, hidden_act=getattr(cfg, "hidden_act", "silu"))

    @classmethod
    def of_module(cls, kind: str, experts) -> ExpertActivation:
        """The activation a transformers experts module computes, of the `kind` discovery found for it
        (tiermoe.arch.discover.ExpertsForm.activation)."""
        if kind == "gpt_oss_glu":
            return cls(kind, alpha=float(experts.alpha), limit=float(experts.limit))
        if kind == "silu_glu":
            return cls(kind, hidden_act="silu")
        return cls(kind, module=experts, gated=bool(getattr(experts, "has_gate", True)),
                   interleaved=not getattr(experts, "is_concatenated", True))

    @property
    def name(self) -> str:
        """What computes it, for people (and the log line saying why a tier runs in torch)."""
        if self.kind != "model":
            return self.kind
        if not self.gated:
            return f"{type(self.module.act_fn).__name__} without a gate"
        return f"{type(self.module).__name__}._apply_gate"

    def __call__(self, gate_up_N2I: torch.Tensor) -> torch.Tensor:
        if self.kind == "model":
            return self._module_own(gate_up_N2I)
        gate, up = gate_up_N2I.chunk(2, dim=-1)
        if self.kind == "gpt_oss_glu":
            gate = gate.clamp(max=self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
            return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

        return _named_activation(self.hidden_act)(gate) * up

    def _module_own(self, h_N2I: torch.Tensor) -> torch.Tensor:
        if not self.gated:
            return self.module.act_fn(h_N2I)
        if self.interleaved:  # [gate | up] -> gate0, up0, gate1, up1, ...
            h_N2I = h_N2I.unflatten(-1, (2, -1)).transpose(-1, -2).flatten(-2)
        apply_gate = getattr(type(self.module), "_apply_gate", None)
        if apply_gate is None:  # a module outside the interface (Llama-4's): act(gate) * up, as discovery checked
            gate, up = h_N2I.chunk(2, dim=-1)
            return self.module.act_fn(gate) * up
        return apply_gate(self.module, h_N2I)


def expert_ffn(w: ExpertWeights, x_ND: torch.Tensor, act: ExpertActivation) -> torch.Tensor:
    """One expert applied to the rows routed to it: [N, D] -> [N, D]."""
    h_N2I = F.linear(x_ND, w.gate_up, w.gate_up_bias)
    return F.linear(act(h_N2I), w.down, w.down_bias)


def routed_experts_forward(
    experts: Mapping[int, ExpertWeights],
    x_TD: torch.Tensor,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    act: ExpertActivation,
) -> torch.Tensor:
    """Sum over each token's routed experts that are in `experts` (ids -1 are skipped): [T, D]."""
    out_TD = torch.zeros_like(x_TD)
    hit = torch.unique(ids_TK[ids_TK >= 0]).tolist()
    for e in hit:
        w = experts.get(e)
        if w is None:
            raise RuntimeError(f"expert {e} was routed to a tier that does not hold it")
        tok_N, slot_N = torch.where(ids_TK == e)
        y_ND = expert_ffn(w, x_TD[tok_N], act) * weights_TK[tok_N, slot_N, None]
        out_TD.index_add_(0, tok_N, y_ND.to(out_TD.dtype))
    return out_TD


class ConvertedOnLookup(Mapping):
    """Experts a tier holds in another form (FP8 codes, int8/int4 matrices), seen as ExpertWeights: each is
    converted by `convert` when looked up, so routed_experts_forward converts only the experts a batch routes to,
    one at a time, and no converted copy outlives its use."""

    def __init__(self, stored: Mapping[int, Any], convert: Callable[[Any], ExpertWeights]):
        self._stored, self._convert = stored, convert

    def __getitem__(self, expert: int) -> ExpertWeights:
        return self._convert(self._stored[expert])

    def __iter__(self) -> Iterator[int]:
        return iter(self._stored)

    def __len__(self) -> int:
        return len(self._stored)
