"""The adapters `--lora` names (tiermoe.cli.lora_flag), read and checked against the model before any weight loads.

generate: `--lora DIR`, merged. serve: `--lora DIR` once, merged (as before adapters were served per request), or
`--lora NAME=DIR` (repeatable) and SGLang's `--lora-paths NAME=DIR|DIR|JSON ...`, served per request. Run-side:
imports the adapter reader (torch, safetensors).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tiermoe.bundled import resolve_model
from tiermoe.errors import TiermoeError
from tiermoe.model.lora_merge import MergedLoRA
from tiermoe.model.served_adapters import check_adapter_name
from tiermoe.training.adapter_merge import merged_lora

MERGED_NOTE = ("--lora DIR merges one adapter into the weights: every request runs with it (--lora NAME=DIR serves "
               "adapters per request instead)")


@dataclass(frozen=True)
class LoraChoice:
    """What the flags ask for: one adapter directory to merge, or adapters served per request ({name: directory})
    and whether more may be loaded while serving (--enable-lora)."""

    merged: str | None = None
    served: dict[str, str] | None = None
    dynamic: bool = False

    @property
    def per_request(self) -> bool:
        return self.served is not None


def lora_choice(args) -> LoraChoice:
    """The adapters the flags name, checked (a one-line TiermoeError for a bad name, a name given twice, or a merged
    adapter given with others)."""
    given = getattr(args, "lora", None)
    entries = [given] if isinstance(given, str) else list(given or ())
    paths = list(getattr(args, "lora_paths", None) or ())
    named = [_named(entry, "--lora") for entry in entries]
    unnamed = [path for name, path in named if name is None]
    if unnamed:
        if len(entries) > 1 or paths:
            raise TiermoeError("--lora DIR (merged into the weights) goes alone; to serve several adapters per "
                               "request give each a name: --lora NAME=DIR")
        return LoraChoice(merged=unnamed[0])
    served: dict[str, str] = {}
    for name, path in named + [_sglang_entry(entry) for entry in paths]:
        if name in served:
            raise TiermoeError(f"adapter name {name!r} is given twice (--lora / --lora-paths); each needs its own")
        served[name] = path
    dynamic = bool(getattr(args, "enable_lora", False))
    return LoraChoice(served=served, dynamic=True) if served or dynamic else LoraChoice()


def lora_from_args(args) -> MergedLoRA | None:
    """The adapter to merge (--lora DIR), read and checked against the model (before any weight loads), or None.
    Serving adapters per request merges none."""
    choice = lora_choice(args)
    if choice.merged is None:
        return None
    _need_peft()
    return merged_lora(choice.merged, resolve_model(args.model))


def served_loras(choice: LoraChoice, model) -> dict[str, tuple[MergedLoRA, str]]:
    """{name: (adapter, directory)} of the adapters served per request, each read and checked against the model."""
    if not choice.served:
        return {}
    _need_peft()
    model_dir = resolve_model(model)
    return {name: (merged_lora(path, model_dir), path) for name, path in choice.served.items()}


def adapter_reader(model_dir: Path):
    """What POST /load_lora_adapter reads a directory with: its adapter, checked against the model."""
    _need_peft()

    def read(path: str) -> MergedLoRA:
        return merged_lora(path, model_dir)

    return read


def _named(entry: str, flag: str) -> tuple[str | None, str]:
    """(name, directory) of `NAME=DIR`; (None, DIR) for a directory alone (also one whose path holds a '=')."""
    if "=" not in entry or Path(entry).is_dir():
        return None, entry
    name, _, path = entry.partition("=")
    try:
        check_adapter_name(name)
    except TiermoeError as err:
        raise TiermoeError(f"{flag} {entry}: {err}") from None
    if not path:
        raise TiermoeError(f"{flag} {entry}: no directory after '='; expected NAME=DIR")
    return name, path


def _sglang_entry(entry: str) -> tuple[str, str]:
    """--lora-paths' forms: NAME=DIR, a JSON {"lora_name", "lora_path"[, "pinned"]}, or DIR (named by itself)."""
    if entry.lstrip().startswith("{"):
        try:
            spec = json.loads(entry)
        except ValueError:
            raise TiermoeError(f"--lora-paths {entry[:80]}: not valid JSON; expected {{\"lora_name\": NAME, "
                               "\"lora_path\": DIR}") from None
        if not (isinstance(spec, dict) and isinstance(spec.get("lora_name"), str)
                and isinstance(spec.get("lora_path"), str) and set(spec) <= {"lora_name", "lora_path", "pinned"}):
            raise TiermoeError(f"--lora-paths {entry[:80]}: expected {{\"lora_name\": NAME, \"lora_path\": DIR}} "
                               "(and \"pinned\")")
        return _checked(spec["lora_name"], "--lora-paths"), spec["lora_path"]
    name, path = _named(entry, "--lora-paths")
    return (_checked(path, "--lora-paths"), path) if name is None else (name, path)


def _checked(name: str, flag: str) -> str:
    try:
        return check_adapter_name(name)
    except TiermoeError as err:
        raise TiermoeError(f"{flag}: {err}") from None


def _need_peft() -> None:
    try:
        import peft  # noqa: F401  (the [train] extra: reading an adapter's config needs it)
    except ImportError:
        raise TiermoeError("--lora needs PEFT to read the adapter: pip install 'tiermoe[train]'") from None
