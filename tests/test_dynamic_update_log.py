"""Each dynamic expert update leaves one INFO line (layers, experts moved, bytes, time), and `tiermoe serve`
prints tiermoe's INFO lines."""

from __future__ import annotations

import logging
import re

import torch

from tiermoe.cli.serve_http import show_tiermoe_logs
from tiermoe.config import DynamicPlacementConfig, PlacementConfig
from tiermoe.engine.dynamic import enable_dynamic_placement
from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import SamplingParams

LINE = re.compile(r"dynamic expert update \(kt-dynamic\): (\d+) experts moved \((\d+) swaps\) in layers "
                  r"\[([\d, ]+)\], ([\d.]+) MiB, ([\d.]+) ms")


def test_each_update_logs_one_line(tiny_dir, caplog):
    caplog.set_level(logging.INFO, logger="tiermoe")
    with LLM(tiny_dir("olmoe"), placement=PlacementConfig(num_gpu_experts=3), dtype=torch.float32,
             progress=False) as llm:
        manager = enable_dynamic_placement(llm.engine, DynamicPlacementConfig(policy="kt-dynamic",
                                                                              prefill_threshold=20))
        before = llm.placement.clone()
        llm.generate(list(range(5, 30)), SamplingParams(max_tokens=1))  # one 25-token prefill: one update
        manager.drain()
        changed = sorted((before != llm.placement).any(dim=1).nonzero().flatten().tolist())
        lines = [r.getMessage() for r in caplog.records if r.name.startswith("tiermoe") and "update" in r.msg]
        assert len(lines) == 1, lines
        assert all(r.levelno == logging.INFO for r in caplog.records if r.getMessage() in lines)
        experts, swaps, layers, mib, ms = LINE.fullmatch(lines[0]).groups()
        assert int(swaps) == manager.copies_landed // 2 > 0 and int(experts) == 2 * int(swaps)
        assert [int(x) for x in layers.split(", ")] == changed
        assert float(mib) == round(llm.hybrid.swap_stats.bytes / 2**20, 2) > 0
        assert float(ms) >= 0
        manager.close()


def test_serve_prints_tiermoe_info_lines(monkeypatch, capsys):
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # as in `tiermoe serve`: nobody set logging up
    logger = logging.getLogger("tiermoe")
    monkeypatch.setattr(logger, "handlers", [])
    level = logger.level
    logger.setLevel(logging.NOTSET)
    try:
        handler = show_tiermoe_logs()
        assert handler is not None and show_tiermoe_logs() is None  # once
        logging.getLogger("tiermoe.engine.update_log").info("dynamic expert update (test)")
        assert "INFO:     dynamic expert update (test)" in capsys.readouterr().err
    finally:
        logger.setLevel(level)  # also clears the loggers' cached levels
