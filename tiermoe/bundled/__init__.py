"""Models that ship inside the package, and resolving the `--model` a user gave (or did not give)."""

from __future__ import annotations

from pathlib import Path

from tiermoe.bundled.demo_notice import say_demo_model_notice
from tiermoe.errors import TiermoeError

BUNDLED_MODEL_NAME = "tiermoe-demo"
BUNDLED_MODEL_DIR = Path(__file__).resolve().parent / BUNDLED_MODEL_NAME


def resolve_model(model: str | Path | None) -> Path:
    """The checkpoint directory for `model`; None (or the bundled model's name) means the bundled demo model.
    None, inside a command, also says once on stderr what the demo model is (tiermoe.bundled.demo_notice)."""
    if model is None or str(model) == BUNDLED_MODEL_NAME:
        if not (BUNDLED_MODEL_DIR / "config.json").is_file():
            raise TiermoeError(f"the bundled model is missing from {BUNDLED_MODEL_DIR}; reinstall tiermoe or pass "
                               "--model")
        if model is None:  # asked for by name, the user knows what it is
            say_demo_model_notice()
        return BUNDLED_MODEL_DIR
    path = Path(model)
    if path.suffix.lower() == ".gguf" and not path.exists():  # not "expected a checkpoint directory": a GGUF was meant
        raise TiermoeError(f"no such GGUF file: {path}")
    return path
