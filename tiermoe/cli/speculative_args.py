"""The speculative-decoding flags (tiermoe.cli.speculative_flags) turned into the engine's settings, for the run
modules of `tiermoe generate` and `tiermoe serve`."""

from __future__ import annotations

from tiermoe.engine.speculative_config import SpeculativeConfig
from tiermoe.errors import TiermoeError

_TUNING = ("speculative_num_draft_tokens", "speculative_num_steps", "speculative_adaptive",
           "speculative_ngram_min_match_window_size", "speculative_ngram_max_match_window_size")


def speculative_from_args(args) -> SpeculativeConfig | None:
    """The settings the flags give (None: speculative decoding off); TiermoeError naming a bad value, or a tuning
    flag given without --speculative-algorithm."""
    algorithm = getattr(args, "speculative_algorithm", None)
    if algorithm is None:
        given = [name for name in _TUNING if getattr(args, name, None) is not None]
        if given:
            raise TiermoeError(f"--{given[0].replace('_', '-')} needs --speculative-algorithm (e.g. ngram)")
        return None
    given = {"num_draft_tokens": args.speculative_num_draft_tokens, "num_steps": args.speculative_num_steps,
             "adaptive": args.speculative_adaptive, "ngram_min": args.speculative_ngram_min_match_window_size,
             "ngram_max": args.speculative_ngram_max_match_window_size}
    kwargs = {name: value for name, value in given.items() if value is not None}
    if "ngram_min" in kwargs and "ngram_max" not in kwargs:  # a min above the default max lifts the max with it
        kwargs["ngram_max"] = max(kwargs["ngram_min"], SpeculativeConfig.ngram_max)
    return SpeculativeConfig(algorithm=str(algorithm).lower(), **kwargs)
