"""`bench placement`'s adaptive strategy runs with the --adaptive-* settings: they change what it does (in the
estimated table and on the live path) and the result records them."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import run_cli, save_tiny

from tiermoe.analysis.placement_live import measure_configuration
from tiermoe.analysis.placement_workload import Workload
from tiermoe.config import AdaptiveSettings
from tiermoe.engine.llm import LLM
from tiermoe.stats.trace_csv import write_trace_csv

E, K, LAYERS = 8, 2, 4
EAGER = dict(half_life_tokens=8, margin=0.0, z_score=0.0, swap_z_score=0.0)  # swap at the first difference


def hot_trace(pairs: dict[int, tuple[int, int]], requests: int = 4, tokens: int = 24, prompt: int = 4) -> dict:
    """`requests` requests of `tokens` tokens (the first `prompt` of them prefill), every token of every layer
    routed to that layer's pair in `pairs`."""
    n = requests * tokens
    ids = torch.zeros(n, LAYERS, K, dtype=torch.int16)
    for layer in range(LAYERS):
        ids[:, layer] = torch.tensor(pairs.get(layer, (0, 1)), dtype=torch.int16)
    position = torch.arange(tokens).repeat(requests)
    return {"num_layers": LAYERS, "num_experts": E, "moe_layers": list(range(LAYERS)), "topk_ids": ids,
            "token_request": torch.arange(requests).repeat_interleave(tokens).to(torch.int32),
            "token_position": position.to(torch.int32), "token_is_prefill": position < prompt,
            "token_pass": torch.arange(n, dtype=torch.int32)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny("qwen3_moe", tmp_path_factory.mktemp("bench-adaptive") / "m")  # MoE layers 0 and 2, top-2


def test_the_settings_change_what_the_adaptive_column_does_and_are_recorded(model_dir, tmp_path):
    # served: the replayed layers (0 and 3) route to (6, 7) and (4, 5); calibrated: to (0, 1) and (2, 3), so the
    # starting placement (frequency) misses every pair and adaptive has to swap to hit
    served = write_trace_csv(hot_trace({0: (6, 7), 3: (4, 5)}), tmp_path / "served.csv")
    calibration = write_trace_csv(hot_trace({0: (0, 1), 3: (2, 3)}), tmp_path / "calibration.csv")

    def run(*flags):
        out = tmp_path / "r.json"
        result = run_cli("bench", "placement", "--model", str(model_dir), "--routing-trace", str(served),
                         "--routing-calibration", str(calibration), "--ratios", "0.25", "--strategies",
                         "frequency,adaptive", "--concurrency", "2", "--repeats", "1", "--prefill-threshold", "0",
                         "--out", str(out), *flags)
        assert result.returncode == 0, result.stderr
        data = json.loads(out.read_text())
        return {c["strategy"]: c for c in data["cells"]}, data["setup"]["adaptive"], result.stdout

    cells, settings, text = run()
    assert settings == dict(vars(AdaptiveSettings(cross_layer=True)))  # the defaults, one process: cross-layer
    assert cells["frequency"]["hit_rate"] == 0.0 and cells["adaptive"]["swaps"] > 0
    assert cells["adaptive"]["hit_rate"] > 0.5
    assert "Adaptive settings: the defaults" in text
    cells, settings, text = run("--adaptive-max-swaps", "0", "--no-adaptive-cross-layer")
    assert (settings["max_swaps_in_flight"], settings["cross_layer"]) == (0, False)
    assert cells["adaptive"]["swaps"] == 0 and cells["adaptive"]["expert_bytes_copied"] == 0
    assert cells["adaptive"]["hit_rate"] == cells["frequency"]["hit_rate"] == 0.0  # never left its start
    assert "Adaptive settings: max_swaps_in_flight=0, cross_layer=False (the rest as default: " in text


def test_the_live_path_runs_adaptive_with_the_settings_given(model_dir):
    """What a CUDA machine measures: the engine's placement manager gets the settings."""
    workload = Workload("held-out", tuple(tuple(range(3 + i, 9 + i)) for i in range(4)), (12,) * 4)
    with LLM(model_dir, progress=False) as llm:
        calibration_LE = torch.zeros(llm.hybrid.spec.num_layers, E, dtype=torch.float64)
        calibration_LE[:, :2] = 1e6  # the starting placement keeps experts 0 and 1 of each layer, whatever is routed

        def swaps(**settings) -> int:
            _, traffic = measure_configuration(llm, workload, "adaptive", 0.25, calibration_LE, 2, 512, None,
                                               adaptive=AdaptiveSettings(**settings))
            return traffic["swaps"]

        assert swaps(**EAGER) > 0
        assert swaps(**EAGER, max_swaps_in_flight=0) == 0
