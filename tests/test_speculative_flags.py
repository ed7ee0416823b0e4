"""Speculative decoding's flags (SGLang's spellings) turn into the engine's settings, or one line saying what is
wrong."""

from __future__ import annotations

import argparse

import pytest

from tiermoe.cli.speculative_args import speculative_from_args
from tiermoe.cli.speculative_flags import add_speculative_flags
from tiermoe.engine.speculative_config import SpeculativeConfig
from tiermoe.errors import TiermoeError


def parse(*argv: str):
    parser = argparse.ArgumentParser()
    add_speculative_flags(parser)
    return speculative_from_args(parser.parse_args(list(argv)))


def test_off_unless_an_algorithm_is_given():
    assert parse() is None


def test_the_flags_set_the_engine_settings():
    assert parse("--speculative-algorithm", "ngram") == SpeculativeConfig()
    assert parse("--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "6", "--speculative-num-steps",
                 "3", "--no-speculative-adaptive", "--speculative-ngram-min-match-window-size", "2",
                 "--speculative-ngram-max-match-window-size", "5") == SpeculativeConfig(
        num_draft_tokens=6, num_steps=3, adaptive=False, ngram_min=2, ngram_max=5)
    assert parse("--speculative-algorithm", "ngram", "--speculative-ngram-min-match-window-size", "6").ngram_max == 6
    assert parse("--speculative-algorithm", "nextn", "--speculative-num-steps", "2") == SpeculativeConfig(
        algorithm="nextn", num_steps=2)


@pytest.mark.parametrize("argv, message", [
    (("--speculative-num-draft-tokens", "4"), "--speculative-num-draft-tokens needs --speculative-algorithm"),
    (("--speculative-algorithm", "eagle"), "not supported yet"),
    (("--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "99"), "from 1 to 16"),
])
def test_bad_flags_give_one_line(argv, message):
    with pytest.raises(TiermoeError, match=message) as err:
        parse(*argv)
    assert "\n" not in str(err.value)
