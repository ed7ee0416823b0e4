"""PlacementPlan: the one plan format every command reads and writes (`plan.json`).

An integer matrix assignment [num_layers, num_experts]: -1 = CPU tier, r >= 0 = GPU rank r. With one GPU it is
the boolean mask (True = GPU tier); rows of dense layers are all -1. The plan also records how it was made.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tiermoe.config import MAX_GPUS
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
        if isinstance(self.num_gpus, bool) or not isinstance(self.num_gpus, int) or not 1 <= self.num_gpus <= MAX_GPUS:
            raise TiermoeError(f"a plan's num_gpus must be an integer between 1 and {MAX_GPUS}, got {self.num_gpus!r}")
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
        try:
            path.write_text(f"{head},\n  \"assignment\": [\n    {rows}\n  ]\n}}\n")
        except OSError as err:
            raise TiermoeError(f"cannot write the plan to '{path}': {err.strerror or err}") from None
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
        _check_fields(data, path)
        assignment = _assignment(data["assignment"], path)
        plan = cls(assignment, num_gpus=data.get("num_gpus", 1), strategy=data.get("strategy", "custom"),
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


# plan.json field -> (the types JSON may give it, what the message says is expected); absent fields take defaults
_FIELDS = {
    "num_gpus": ((int,), f"an integer between 1 and {MAX_GPUS}"),
    "strategy": ((str,), "a string"),
    "budget": ((dict, type(None)), "an object"),
    "gpu_split": ((str, type(None)), "a string or null"),
    "model_type": ((str, type(None)), "a string or null"),
}


def _check_fields(data: dict, path: Path) -> None:
    """Each recorded field has its JSON type (bool is no integer: `true` is not one GPU)."""
    for name, (types, expected) in _FIELDS.items():
        if name in data:
            value = data[name]
            if isinstance(value, bool) or not isinstance(value, types):
                raise TiermoeError(f"plan file '{path}': {name} must be {expected}, got {json.dumps(value)}")
    num_gpus = data.get("num_gpus", 1)
    if not 1 <= num_gpus <= MAX_GPUS:
        raise TiermoeError(f"plan file '{path}': num_gpus must be {_FIELDS['num_gpus'][1]}, got {num_gpus}")


def _assignment(rows, path: Path) -> torch.Tensor:
    """The assignment as int64 [L, E]: JSON integers only (0.9 is not rank 0, true is not rank 1), in rows of
    one length. Checked element by element before torch sees it, which would truncate floats."""
    if not isinstance(rows, list) or not all(isinstance(row, list) for row in rows):
        raise TiermoeError(f"plan file '{path}': assignment must be a list of rows [layers][experts]")
    for i, row in enumerate(rows):
        for j, value in enumerate(row):
            if type(value) is not int or not -1 <= value < 2**63:
                raise TiermoeError(f"plan file '{path}': assignment[{i}][{j}] is {json.dumps(value)}; expected an "
                                   "integer, -1 (CPU) or a GPU rank")
    if len({len(row) for row in rows}) > 1:
        raise TiermoeError(f"plan file '{path}': assignment rows differ in length; expected [layers][experts]")
    return torch.tensor(rows, dtype=torch.int64).reshape(len(rows), len(rows[0]) if rows else 0)
