"""The bundled models' old import path: `tiermoe.models.resolve_model` and its names, kept for the scripts and
notebooks that use it. The bundled model files and their code are in tiermoe.bundled."""

from tiermoe.bundled import BUNDLED_MODEL_DIR, BUNDLED_MODEL_NAME, resolve_model

__all__ = ["BUNDLED_MODEL_DIR", "BUNDLED_MODEL_NAME", "resolve_model"]
