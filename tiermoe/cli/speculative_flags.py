"""Speculative decoding's flags, as SGLang spells them, for `tiermoe generate` and `tiermoe serve`.

Off unless `--speculative-algorithm` is given. Light: parsers import it for `--help`; turning the flags into the
engine's settings is tiermoe.cli.speculative_args, which the run modules import.
"""

from __future__ import annotations

import argparse

from tiermoe.cli.choices import MAX_DRAFT_TOKENS, MAX_NGRAM
from tiermoe.cli.choices import SPECULATIVE_ALGORITHMS as ALGORITHMS


def add_speculative_flags(p) -> None:
    g = p.add_argument_group("speculative decoding (off unless --speculative-algorithm is given)")
    g.add_argument("--speculative-algorithm", metavar="ALGO", default=None,
                   help=f"draft tokens and verify them in one forward per step: {', '.join(ALGORITHMS)} (ngram: drafts "
                        "looked up in the prompt and the reply so far: rewriting, summarising, code edits; nextn: "
                        "the checkpoint's MTP layer, DeepSeek-V3/R1 and GLM-4.5); greedy output is unchanged, sampled output "
                        "keeps its distribution")
    g.add_argument("--speculative-num-draft-tokens", metavar="N", type=int, default=None,
                   help=f"the most tokens a sequence drafts per step (1-{MAX_DRAFT_TOKENS}; default 4)")
    g.add_argument("--speculative-num-steps", metavar="N", type=int, default=None,
                   help="drafting steps per verify step (nextn: MTP rounds, one per drafted token); n-gram lookup "
                        "drafts in one, so this only caps the draft")
    g.add_argument("--speculative-adaptive", action=argparse.BooleanOptionalAction, default=None,
                   help="choose each sequence's draft length per step (0 included) from its acceptance and the "
                        "verify step's measured cost (default on); --no-speculative-adaptive drafts what the "
                        "lookup finds, up to N, every step")
    g.add_argument("--speculative-ngram-min-match-window-size", metavar="N", type=int, default=None,
                   help=f"shortest suffix of the text looked up for a draft (1-{MAX_NGRAM}; default 1)")
    g.add_argument("--speculative-ngram-max-match-window-size", metavar="N", type=int, default=None,
                   help=f"longest suffix looked up, tried first (1-{MAX_NGRAM}; default 4)")
