"""`serve` logs SGLang's decode-batch line every --decode-log-interval decode steps (default 40, 0: never), with the
throughput measured over the interval."""

from __future__ import annotations

import argparse
import logging
import re
from types import SimpleNamespace

import httpx
import pytest
from server_thread import server_thread

from tiermoe.cli.serve_flags import add_serve_flags
from tiermoe.cli.serve_http import build_state
from tiermoe.errors import TiermoeError
from tiermoe.server.decode_log import DecodeLog

LINE = re.compile(r"Decode batch\. #running-req: (\d+), #token: (\d+), token usage: (\d\.\d\d), "
                  r"gen throughput \(token/s\): (\d+\.\d\d), #queue-req: (\d+)")


def fake_engine(running: int, waiting: int, used_pages: int, pages: int, page_size: int = 16):
    pool = SimpleNamespace(used_pages=lambda: {None: used_pages}, pages=SimpleNamespace(num_pages={None: pages}),
                           page_size=page_size)
    return SimpleNamespace(running=[object()] * running, waiting=[object()] * waiting, pool=pool)


def test_one_line_per_interval_with_the_throughput_of_that_interval():
    log = DecodeLog(interval=4)
    engine = fake_engine(running=3, waiting=1, used_pages=5, pages=100)
    lines = [log.after_step(tokens, seconds, engine)
             for tokens, seconds in [(3, 0.1), (0, 0.2), (3, 0.1), (3, 0.1), (3, 0.1), (3, 0.5), (3, 0.5)]]
    # the 4th decode step (a prefill-only step between them counts its time, not its step): 12 tokens in 0.6 s
    assert lines[:4] == [None, None, None, None] and lines[5] is None
    assert lines[4] == ("Decode batch. #running-req: 3, #token: 80, token usage: 0.05, gen throughput (token/s): "
                        "20.00, #queue-req: 1")
    assert lines[6] is None  # a new interval: two steps so far
    # the last step's sequences, those that finished in it included (they have left engine.running)
    ended = DecodeLog(interval=1).after_step(3, 0.1, fake_engine(running=1, waiting=0, used_pages=1, pages=10), 2)
    assert ended.startswith("Decode batch. #running-req: 3, ")
    assert all(DecodeLog(0).after_step(3, 0.1, engine) is None for _ in range(100))  # 0: never
    with pytest.raises(TiermoeError, match="--decode-log-interval"):
        DecodeLog(-1)


def test_the_flag_is_sglangs_with_its_default():
    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    assert parser.parse_args([]).decode_log_interval == 40
    assert parser.parse_args(["--decode-log-interval", "0"]).decode_log_interval == 0
    with pytest.raises(SystemExit):
        parser.parse_args(["--decode-log-interval", "-1"])


def test_a_server_logs_the_line_as_it_decodes(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="tiermoe.server.decode_log")
    with server_thread(tmp_path) as (url, state):
        state.llm.engine.eos_token_ids = frozenset()  # the reply runs to max_tokens
        state.service.decode_log = DecodeLog(interval=3)
        r = httpx.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 7}, timeout=60)
        assert r.status_code == 200, r.text
        # `tiermoe serve` hands its flag to the engine service it builds
        parser = argparse.ArgumentParser()
        add_serve_flags(parser)
        built = build_state(parser.parse_args(["--decode-log-interval", "5"]), llm=state.llm)
        assert built.service.decode_log.interval == 5
    lines = [LINE.fullmatch(r.getMessage()) for r in caplog.records if r.name == "tiermoe.server.decode_log"]
    assert len(lines) == 2 and all(lines)  # 7 decode steps: a line after the 3rd and the 6th
    running, tokens, usage, throughput, queued = lines[0].groups()
    assert (running, queued) == ("1", "0") and int(tokens) > 0 and float(usage) >= 0 and float(throughput) > 0
