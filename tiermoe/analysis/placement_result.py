"""The placement benchmark's figures: one Cell per (strategy, ratio), and the run around them.

Every figure says how it was obtained. `estimated` cells have throughput and time to first token from the cost
model (hit rates, CPU expert bytes and copies are still exact replays of the measured workload); measured cells
come from serving the workload end to end. The JSON keeps every field; markdown and plot read it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class Cell:
    strategy: str
    ratio: float
    estimated: bool  # throughput / TTFT from the cost model (True) or measured end to end (False)
    hit_rate: float  # share of routed (token, expert) pairs the GPU tier computed
    cpu_expert_bytes_per_output_token: float  # expert weights the CPU tier read, per output token
    expert_bytes_copied: int  # between tiers: swaps and layerwise-prefill streaming
    swaps: int
    seconds: float  # to serve the whole workload
    output_tokens_per_s: float
    total_tokens_per_s: float  # prompt + output tokens
    ttft_seconds: dict  # mean, median, p99


@dataclass
class PlacementBenchResult:
    mode: str  # "measured" (CUDA, end to end) or "estimated" (cost model on a CPU-only machine)
    ratios: list[float]
    strategies: list[str]
    cells: list[Cell]
    setup: dict  # model, dataset, workloads, concurrency, command
    gpu_profile: dict
    calibration: dict = field(default_factory=dict)  # CPU backend fit, host costs, model costs, this-cpu profile
    validation: list[dict] = field(default_factory=list)  # this-cpu: estimate vs measurement
    timed: list[dict] = field(default_factory=list)  # this-cpu: cells served in alternating rounds (placement_rounds)

    @property
    def estimated(self) -> bool:
        return self.mode == "estimated"

    def get(self, strategy: str, ratio: float) -> Cell:
        return next(c for c in self.cells if c.strategy == strategy and abs(c.ratio - ratio) < 1e-9)

    def validation_passed(self) -> bool | None:
        if not self.validation:
            return None
        return all(v["within_tolerance"] for v in self.validation)

    def as_dict(self) -> dict:
        return {"mode": self.mode, "estimated": self.estimated,
                "label": "ESTIMATE (cost model)" if self.estimated else "measured end to end",
                "ratios": self.ratios, "strategies": self.strategies, "setup": self.setup,
                "gpu_profile": self.gpu_profile, "calibration": self.calibration, "validation": self.validation,
                "validation_passed": self.validation_passed(), "cells": [asdict(c) for c in self.cells],
                "timed": self.timed}

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.as_dict(), indent=2) + "\n")
