"""The server raises its soft open-file limit to the hard one (issue: serving under hostile load): each connection
holds a file descriptor, and a soft limit of 1024 is filled by a few hundred idle or slow clients. The limits are
faked here, so no test changes those of the process running it."""

from __future__ import annotations

import logging
import resource

import pytest
from conftest import run_cli
from test_cli_bad_input import MISSING_MODEL

from tiermoe import config
from tiermoe.config import OPEN_FILES_WANTED, raise_open_files_limit


@pytest.fixture
def limits(monkeypatch):
    """The open-file limits (soft, hard) as a dict the fake getrlimit / setrlimit read and write."""
    state = {"limits": (1024, 65536), "refuse": False}

    def setrlimit(which, value):
        assert which == resource.RLIMIT_NOFILE
        if state["refuse"]:
            raise ValueError("not allowed")
        state["limits"] = value

    monkeypatch.setattr(config.resource, "getrlimit", lambda which: state["limits"])
    monkeypatch.setattr(config.resource, "setrlimit", setrlimit)
    return state


def test_the_soft_limit_is_raised_to_the_hard_one_once(limits):
    assert raise_open_files_limit() == (1024, 65536)
    assert limits["limits"] == (65536, 65536)
    assert raise_open_files_limit() is None


def test_an_unlimited_hard_limit_raises_the_soft_one_to_a_bounded_number(limits):
    limits["limits"] = (1024, resource.RLIM_INFINITY)
    assert raise_open_files_limit() == (1024, OPEN_FILES_WANTED)
    assert limits["limits"] == (OPEN_FILES_WANTED, resource.RLIM_INFINITY)


def test_a_refused_raise_keeps_the_old_limit(limits):
    limits["refuse"] = True
    assert raise_open_files_limit() is None
    assert limits["limits"] == (1024, 65536)


def test_serve_raises_the_limit_before_it_bounds_the_requests_in_flight_by_it(limits, caplog):
    """1032 requests in flight do not fit a soft limit of 1024 (256 kept for the rest), but fit the hard one: the
    command goes on to the model, which is missing."""
    caplog.set_level(logging.INFO, logger="tiermoe")
    result = run_cli("serve", *MISSING_MODEL, "--max-queued-requests", "1000")
    assert result.returncode == 2 and "ulimit" not in result.stderr, result.stderr
    assert "/nonexistent/model" in result.stderr
    assert "open-file limit (ulimit -n) raised from 1024 to 65536" in caplog.text
