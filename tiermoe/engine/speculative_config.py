"""Speculative decoding's settings, checked on construction (off unless an EngineConfig carries one).

SGLang's flags name them: `--speculative-algorithm` (`ngram`: drafts looked up in the prompt and the output so far;
`nextn`: the checkpoint's MTP layer, DeepSeek-V3/R1 and GLM-4.5: tiermoe.engine.speculative_mtp),
`--speculative-num-draft-tokens` (the most tokens drafted per sequence and step) and `--speculative-num-steps` (how
many of them a draft may take: the drafter's steps, one MTP round per drafted token; for n-gram lookup it only caps
the draft like num_draft_tokens). `adaptive` chooses each sequence's draft length per step, 0 included, from its
running acceptance and the verify step's cost (tiermoe.engine.speculative_length); without it every sequence drafts
what its drafter finds, up to the cap.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiermoe.errors import TiermoeError

ALGORITHMS = ("ngram", "nextn")
UNSUPPORTED_ALGORITHMS = {"eagle": "no draft model support yet", "eagle3": "no draft model support yet"}
# A verify step feeds draft + 1 rows per sequence, and acceptance decays geometrically: past 16 drafted tokens
# the expected gain is nil at any realistic acceptance while the step's rows keep growing.
MAX_DRAFT_TOKENS = 16
MAX_NGRAM = 16  # n-gram lengths looked up; longer matches add nothing a 16-token one does not find


@dataclass(frozen=True)
class SpeculativeConfig:
    algorithm: str = "ngram"
    num_draft_tokens: int = 4  # the most tokens drafted per sequence and step (K)
    num_steps: int | None = None  # None: num_draft_tokens; else the draft is capped at this many too
    adaptive: bool = True  # choose k in 0..K per sequence and step from acceptance and the verify step's cost
    ngram_max: int = 4  # longest suffix looked up
    ngram_min: int = 1  # shortest suffix looked up (1: a single repeated token already proposes)

    def __post_init__(self):
        if self.algorithm in UNSUPPORTED_ALGORITHMS:
            raise TiermoeError(f"speculative algorithm {self.algorithm!r} is not supported yet "
                               f"({UNSUPPORTED_ALGORITHMS[self.algorithm]}); use one of: {', '.join(ALGORITHMS)}")
        if self.algorithm not in ALGORITHMS:
            raise TiermoeError(f"speculative algorithm must be one of: {', '.join(ALGORITHMS)}; got "
                               f"{self.algorithm!r}")
        for name in ("num_draft_tokens", "num_steps"):
            value = getattr(self, name)
            if value is None and name == "num_steps":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_DRAFT_TOKENS:
                raise TiermoeError(f"speculative {name} must be an integer from 1 to {MAX_DRAFT_TOKENS}, got {value!r}")
        for name in ("ngram_min", "ngram_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_NGRAM:
                raise TiermoeError(f"speculative {name} must be an integer from 1 to {MAX_NGRAM}, got {value!r}")
        if self.ngram_min > self.ngram_max:
            raise TiermoeError(f"speculative ngram_min ({self.ngram_min}) must not exceed ngram_max ({self.ngram_max})")

    @property
    def max_draft(self) -> int:
        """K: the most tokens one sequence drafts in a step."""
        return min(self.num_draft_tokens, self.num_steps or self.num_draft_tokens)
