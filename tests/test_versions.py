"""The torch and transformers releases we declare are the ones tested, and a known-bad release says so at load."""

from __future__ import annotations

import logging
import os
import re
import subprocess
from pathlib import Path

import pytest
import tomllib
import torch
import transformers
from packaging.requirements import Requirement
from packaging.version import Version

from tiermoe.arch import transformers_version
from tiermoe.arch.transformers_version import (
    check_transformers_for,
    declared_range,
    range_ends,
)
from tiermoe.errors import TiermoeError

ROOT = Path(__file__).resolve().parents[1]


def declared() -> dict[str, Requirement]:
    """pyproject.toml's dependencies by name."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {r.name: r for r in map(Requirement, deps)}


def test_the_range_the_code_reads_is_the_one_pyproject_declares():
    assert declared_range() == declared()["transformers"].specifier


def test_the_suite_runs_on_the_newest_release_below_the_cap():
    floor, cap = range_ends(declared()["transformers"].specifier)
    installed = Version(transformers.__version__)
    assert floor <= installed < cap
    assert installed.release[:2] == (cap.major, cap.minor - 1), (
        f"transformers {installed} is not the release below the cap {cap}: the cap says what CI tests")


@pytest.mark.skipif("TIERMOE_FLOOR_PYTHON" not in os.environ, reason="scripts/test.sh (no arguments) sets it")
def test_the_floor_environment_runs_the_floor_release():
    floor, _ = range_ends(declared()["transformers"].specifier)
    script = "import transformers, tiermoe; print(transformers.__version__)"
    out = subprocess.run([os.environ["TIERMOE_FLOOR_PYTHON"], "-c", script], capture_output=True, text=True,
                         check=True).stdout
    assert Version(out.strip()) == floor


def test_torch_is_in_its_declared_range():
    assert Version(torch.__version__.split("+")[0]) in declared()["torch"].specifier


def test_readme_states_the_declared_ranges():
    line = next(ln for ln in (ROOT / "README.md").read_text().splitlines() if ln.startswith("Requirements:"))
    deps = declared()
    for name in ("torch", "transformers"):
        written = re.search(rf"`{name}([^`]*)`", line)
        assert written and Requirement(name + written.group(1)).specifier == deps[name].specifier, line


def test_a_release_known_to_fail_for_an_architecture_is_one_line_at_load(tiny_dir, monkeypatch):
    from tiermoe.model.loader import load_hybrid_model

    monkeypatch.setattr(transformers_version, "installed_release", lambda: "5.23.0")
    with pytest.raises(TiermoeError) as err:
        load_hybrid_model(tiny_dir("qwen3_next"), gpu_device="cpu", progress=False)
    message = str(err.value)
    assert "\n" not in message
    assert "qwen3_next needs transformers >= 5.24.0" in message and "5.23.0 is installed" in message
    assert "pip install 'transformers" in message


def test_other_architectures_on_a_release_outside_the_range_load_with_one_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="tiermoe.arch.transformers_version"):
        check_transformers_for("qwen3_moe", installed="5.23.0")
        check_transformers_for("qwen3_moe", installed=transformers.__version__)
    assert len(caplog.records) == 1 and "outside the range" in caplog.records[0].getMessage()
    with pytest.raises(TiermoeError, match="qwen3_next needs"):
        check_transformers_for("qwen3_next", installed="5.20.0")
    check_transformers_for("qwen3_next", installed=str(range_ends(declared_range())[0]))
