"""Fine-tuning checkpoints: the adapter, the optimizer, the schedule, the step, the data position, the RNGs.

OUT/checkpoint-NNNNNNN/ holds the adapter in PEFT's layout (tiermoe.training.adapter_io: PEFT and `--lora` load it
as it is), `trainer_state.pt` (optimizer state by parameter name, schedule state, torch's and Python's generators) and
`trainer_state.json` (step, data position, the losses so far, and the settings that decide the run, which a resume
must repeat). A checkpoint is written under a temporary name and renamed when complete, so an interrupted save
never leaves a checkpoint that looks whole; the oldest are removed beyond `keep`.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from tiermoe.errors import TiermoeError
from tiermoe.training.adapter_io import load_adapter, save_adapter

PREFIX = "checkpoint-"
STATE_FILE = "trainer_state.pt"
INFO_FILE = "trainer_state.json"


@dataclass
class TrainerState:
    step: int = 0
    data: dict = field(default_factory=dict)  # SFTBatches.state_dict()
    history: list[dict] = field(default_factory=list)  # one entry per step: step, loss, lr, tokens, ...
    evals: list[dict] = field(default_factory=list)  # held-out loss: step, loss
    run: dict = field(default_factory=dict)  # the settings that decide the result (compared on resume)


def checkpoint_dirs(out_dir: str | Path) -> list[Path]:
    """Complete checkpoints in `out_dir`, oldest first."""
    out_dir = Path(out_dir)
    found = []
    for path in out_dir.glob(PREFIX + "*") if out_dir.is_dir() else ():
        step = path.name[len(PREFIX):]
        if step.isdigit() and (path / INFO_FILE).is_file() and (path / STATE_FILE).is_file():
            found.append((int(step), path))
    return [path for _, path in sorted(found)]


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    found = checkpoint_dirs(out_dir)
    return found[-1] if found else None


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _named_optimizer_state(model, optimizer) -> dict:
    """The optimizer's state with each parameter's name beside its index: a resumed model may register its
    adapters in another order (tiermoe.training.adapter_io rebuilds them from the saved config)."""
    names = {id(p): n for n, p in model.named_parameters()}
    state = optimizer.state_dict()
    order = [p for group in optimizer.param_groups for p in group["params"]]
    return {"state": state, "names": [names[id(p)] for p in order]}


def _load_named_optimizer_state(model, optimizer, saved: dict, where: Path) -> None:
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    if sorted(order) != sorted(saved["names"]):
        missing = sorted(set(order) ^ set(saved["names"]))[:3]
        raise TiermoeError(f"checkpoint '{where}': its optimizer holds other parameters than this model's "
                           f"adapters (e.g. {', '.join(missing)})")
    index_now = {name: i for i, name in enumerate(order)}
    remap = {i: index_now[name] for i, name in enumerate(saved["names"])}
    state = saved["state"]
    if len(state["param_groups"]) != 1:
        raise TiermoeError(f"checkpoint '{where}': expected one optimizer parameter group")
    state = {"state": {remap[int(i)]: v for i, v in state["state"].items()},
             "param_groups": [{**state["param_groups"][0], "params": list(range(len(order)))}]}
    optimizer.load_state_dict(state)


def save_checkpoint(out_dir: str | Path, state: TrainerState, model, optimizer, schedule, keep: int = 0) -> Path:
    """Write checkpoint `state.step` into `out_dir`; keep the newest `keep` checkpoints (0: all)."""
    out_dir = Path(out_dir)
    final = out_dir / f"{PREFIX}{state.step:07d}"
    partial = out_dir / f".{final.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    save_adapter(model, partial)
    torch.save({"optimizer": _named_optimizer_state(model, optimizer), "schedule": schedule.state_dict(),
                "rng": _rng_state()}, partial / STATE_FILE)
    (partial / INFO_FILE).write_text(json.dumps(asdict(state), indent=1) + "\n", encoding="utf-8")
    if final.exists():
        shutil.rmtree(final)
    partial.rename(final)
    if keep > 0:
        for old in checkpoint_dirs(out_dir)[:-keep]:
            shutil.rmtree(old)
    return final


def read_state(path: str | Path) -> TrainerState:
    info = Path(path) / INFO_FILE
    try:
        return TrainerState(**json.loads(info.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError) as err:
        raise TiermoeError(f"checkpoint '{path}' is unreadable ({info.name}: {err})") from None


def load_checkpoint_model(hybrid, path: str | Path):
    """The model to train on from a checkpoint: its adapter, trainable, on a freshly loaded trainable hybrid model."""
    return load_adapter(hybrid, path, trainable=True)


def load_checkpoint_state(path: str | Path, model, optimizer, schedule) -> TrainerState:
    """Restore the optimizer, schedule and generators of a checkpoint (its model: load_checkpoint_model)."""
    path = Path(path)
    state = read_state(path)
    try:
        saved = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
        _load_named_optimizer_state(model, optimizer, saved["optimizer"], path)
    except (OSError, RuntimeError, KeyError, ValueError) as err:
        raise TiermoeError(f"checkpoint '{path}': cannot restore the optimizer ({err})") from None
    schedule.load_state_dict(saved["schedule"])
    _set_rng_state(saved["rng"])
    return state
