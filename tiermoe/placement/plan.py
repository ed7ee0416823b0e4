"""PlacementPlan: the one plan format every command reads and writes (`plan.json`).

An integer matrix assignment [num_layers, num_experts]: -1 = CPU tier, r >= 0 = GPU rank r. With one GPU it is
the boolean mask (True = GPU tier); rows of dense layers are all -1. The plan also records how it was made.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tiermoe.errors import TiermoeError

PLAN_FORMAT = "tiermoe-placement-plan"
PLAN_VERSION = 1


@dataclass(frozen=True)
class PlacementPlan:
    assignment: torch.Tensor  # int64 [L, E]: -1 CPU, r >= 0 GPU rank
    num_gpus: int = 1
    strategy: str = "custom"
    budget: dict = field(default_factory=dict)  # how the GPU expert count was chosen
    gpu_split: str | None = None
    model_type: str | None = None

    def __post_init__(self):
        a = torch.as_tensor(self.assignment)
        if a.dim() != 2 or a.dtype.is_floating_point or a.dtype == torch.bool:
            raise TiermoeError(f"a plan's assignment must be an integer matrix [layers, experts], got "
                               f"{a.dtype} of shape {list(a.shape)}")
        a = a.to("cpu", torch.int64)
        if self.num_gpus < 1:
            raise TiermoeError(f"num_gpus must be >= 1, got {self.num_gpus}")
        if a.numel() and (int(a.min()) < -1 or int(a.max()) >= self.num_gpus):
            raise TiermoeError(f"plan assignment values must be -1 (CPU) or a GPU rank 0..{self.num_gpus - 1}, "
                               f"found {int(a.min())}..{int(a.max())}")
        object.__setattr__(self, "assignment", a)

    @classmethod
    def all_cpu(cls, num_layers: int, num_experts: int, **kwargs) -> PlacementPlan:
        """Every routed expert on the CPU tier."""
        return cls(torch.full((num_layers, num_experts), -1, dtype=torch.int64), **kwargs)

    @classmethod
    def from_mask(cls, mask: torch.Tensor, **kwargs) -> PlacementPlan:
        mask = torch.as_tensor(mask).bool()
        return cls(torch.where(mask, 0, -1).to(torch.int64), **kwargs)

    @property
    def num_layers(self) -> int:
        return self.assignment.shape[0]

    @property
    def num_experts(self) -> int:
        return self.assignment.shape[1]

    @property
    def mask(self) -> torch.Tensor:
        """bool [L, E]: on any GPU."""
        return self.assignment >= 0

    def rank_mask(self, rank: int) -> torch.Tensor:
        """bool [L, E]: the experts GPU `rank` holds (each rank's mask counts only its own experts)."""
        return self.assignment == rank

    def gpu_experts_per_layer(self) -> list[int]:
        return self.mask.sum(dim=1).tolist()

    def to_dict(self) -> dict:
        return {
            "format": PLAN_FORMAT, "version": PLAN_VERSION, "model_type": self.model_type,
            "num_layers": self.num_layers, "num_experts": self.num_experts, "num_gpus": self.num_gpus,
            "strategy": self.strategy, "gpu_split": self.gpu_split, "budget": self.budget,
            "num_gpu_experts": int(self.mask.sum()), "assignment": self.assignment.tolist(),
        }

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        rows = ",\n    ".join(json.dumps(r) for r in self.assignment.tolist())
        head = json.dumps({k: v for k, v in self.to_dict().items() if k != "assignment"}, indent=2)[:-2]
        path.write_text(f"{head},\n  \"assignment\": [\n    {rows}\n  ]\n}}\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> PlacementPlan:
        path = Path(path)
        if not path.is_file():
            raise TiermoeError(f"plan file '{path}' does not exist")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise TiermoeError(f"plan file '{path}' is not valid JSON ({err})") from None
        if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT or "assignment" not in data:
            raise TiermoeError(f"'{path}' is not a tiermoe plan (expected format '{PLAN_FORMAT}' with 'assignment')")
        try:
            assignment = torch.tensor(data["assignment"], dtype=torch.int64)
        except (TypeError, ValueError) as err:
            raise TiermoeError(f"plan file '{path}': assignment is not a rectangular integer matrix ({err})") from None
        plan = cls(assignment, num_gpus=int(data.get("num_gpus", 1)), strategy=data.get("strategy", "custom"),
                   budget=data.get("budget") or {}, gpu_split=data.get("gpu_split"), model_type=data.get("model_type"))
        if (plan.num_layers, plan.num_experts) != (data.get("num_layers"), data.get("num_experts")):
            raise TiermoeError(f"plan file '{path}': assignment shape {list(assignment.shape)} does not match "
                               f"num_layers={data.get('num_layers')}, num_experts={data.get('num_experts')}")
        return plan

    def check_model(self, spec) -> None:
        """The plan must be sized for this model, and dense layers must hold no GPU experts."""
        expected = (spec.num_layers, spec.num_experts)
        if (self.num_layers, self.num_experts) != expected:
            raise TiermoeError(f"plan is for {self.num_layers} layers x {self.num_experts} experts, the model has "
                               f"{expected[0]} x {expected[1]}")
        dense = ~spec.moe_row_mask()
        if bool(self.mask[dense].any()):
            raise TiermoeError("plan puts GPU experts in dense (non-MoE) layers "
                               f"{dense.nonzero().flatten().tolist()}")
