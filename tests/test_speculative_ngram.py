"""N-gram (prompt lookup) drafting and speculative decoding's settings: pure functions, no model."""

from __future__ import annotations

import pytest

from tiermoe.engine.speculative_config import MAX_DRAFT_TOKENS, SpeculativeConfig
from tiermoe.engine.speculative_ngram import ngram_draft
from tiermoe.errors import TiermoeError


def test_the_longest_suffix_that_occurred_before_proposes_what_followed_it():
    ids = [1, 2, 3, 9, 9, 7, 2, 3, 4, 5, 6, 1, 2, 3]
    # [1, 2, 3] occurred at the start (followed by 9, 9, 7); [2, 3] alone would match later (followed by 4, 5)
    assert ngram_draft(ids, 3, max_n=3, min_n=1) == [9, 9, 7]
    assert ngram_draft(ids, 3, max_n=2, min_n=1) == [4, 5, 6]  # the latest [2, 3]


def test_the_latest_occurrence_wins_and_k_caps_the_draft():
    ids = [5, 1, 8, 8, 5, 1, 6, 6, 6, 5, 1]
    assert ngram_draft(ids, 2, max_n=2) == [6, 6]
    assert ngram_draft(ids, 10, max_n=2) == [6, 6, 6, 5, 1]  # runs to the end of the ids
    assert ngram_draft(ids, 0) == []


def test_no_earlier_occurrence_or_too_short_a_suffix_proposes_nothing():
    assert ngram_draft([1, 2, 3, 4], 4) == []
    assert ngram_draft([7], 4) == []
    assert ngram_draft([3, 4, 9, 3, 4], 4, max_n=2, min_n=2) == [9, 3, 4]
    assert ngram_draft([3, 5, 9, 7, 4], 4, max_n=2, min_n=2) == []  # only a 1-token match, below min_n


def test_a_match_that_straddles_token_boundaries_in_the_packed_bytes_is_no_match():
    # packed as 4-byte ints, [256, 1] holds the bytes of [1, 0] at an odd offset (little-endian: 00 01 00 00 01 ..)
    ids = [256, 1, 5, 5, 1, 0]
    assert ngram_draft(ids, 2, max_n=2, min_n=2) == []
    assert ngram_draft([1, 0, 4, 256, 1, 1, 0], 2, max_n=2, min_n=2) == [4, 256]


def test_large_token_ids_are_looked_up():
    big = 151_000
    assert ngram_draft([big, big + 1, 3, big, big + 1], 2, max_n=2) == [3, big]


@pytest.mark.parametrize("kwargs, message", [
    (dict(algorithm="eagle"), "not supported yet"),
    (dict(algorithm="medusa"), "must be one of: ngram"),
    (dict(num_draft_tokens=0), "num_draft_tokens must be an integer from 1"),
    (dict(num_draft_tokens=MAX_DRAFT_TOKENS + 1), "num_draft_tokens"),
    (dict(num_steps=True), "num_steps"),
    (dict(ngram_min=3, ngram_max=2), "ngram_min"),
    (dict(ngram_max=0), "ngram_max"),
])
def test_bad_speculative_settings_are_refused_in_one_line(kwargs, message):
    with pytest.raises(TiermoeError, match=message) as err:
        SpeculativeConfig(**kwargs)
    assert "\n" not in str(err.value)


def test_num_steps_caps_the_draft_too():
    assert SpeculativeConfig(num_draft_tokens=6).max_draft == 6
    assert SpeculativeConfig(num_draft_tokens=6, num_steps=3).max_draft == 3
