"""Lag reuse measured live (tiermoe.engine.speculative_reuse): the experts a verify step's consecutive rows of one
sequence read together, from the engine's own verify passes, and what the draft lengths then count with."""

from __future__ import annotations

import math

import pytest
import torch

from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import SamplingParams
from tiermoe.engine.speculative_config import SpeculativeConfig
from tiermoe.engine.speculative_length import REUSE
from tiermoe.engine.speculative_reuse import DECAY, LOWEST, PRIOR_WEIGHT, LagReuse
from tiermoe.stats.recording import PassInfo


def ids_of(rows: list[list[int]], layers: int = 2) -> torch.Tensor:
    return torch.tensor([rows] * layers)  # [layers, rows, K]


def test_each_segment_gives_its_rows_union_as_a_power_of_its_length():
    lag = LagReuse(top_k=2, prior=0.5)
    same = ids_of([[0, 1], [1, 0], [0, 1], [1, 0]])  # 4 rows, the same 2 experts: no more read than one row's
    apart = ids_of([[0, 1], [2, 3], [4, 5], [6, 7]])  # as if routed independently (no overlap): 4x one row's
    half = ids_of([[0, 1], [0, 2], [1, 3], [4, 1]])  # 5 experts for 4 rows: 2.5x, so log(2.5) / log(4)
    for ids, want in [(same, LOWEST), (apart, 1.0), (half, math.log(2.5) / math.log(4))]:
        lag = LagReuse(top_k=2, prior=0.5)
        lag.observe(ids, [(0, 4)])
        assert lag.reuse == pytest.approx((want + 0.5 * PRIOR_WEIGHT) / (1 + PRIOR_WEIGHT))
    lag = LagReuse(top_k=2, prior=0.5)  # two segments of one pass, then a pass later: the first counts less
    both = torch.cat([same, apart], dim=1)
    lag.observe(both, [(0, 4), (4, 4)])
    lag.observe(apart, [(0, 4)])
    total, weight = DECAY * (LOWEST + 1.0) + 1.0, DECAY * 2 + 1
    assert lag.reuse == pytest.approx((total + 0.5 * PRIOR_WEIGHT) / (weight + PRIOR_WEIGHT))


def test_only_decode_segments_of_two_rows_or_more_are_measured():
    lag = LagReuse(top_k=2)
    lag.armed = True
    assert lag.enabled
    # rows: a plain decode row, a prompt chunk of 3, a verify segment of 3
    lag.begin_pass(PassInfo(request_ids=(1, 2, 3), num_tokens=(1, 3, 3), start_positions=(9, 0, 5),
                            is_prefill=(False, True, False)))
    rows = [[0, 1]] + [[2, 3]] * 3 + [[4, 5], [4, 5], [6, 7]]
    for layer in range(3):
        lag.record(layer, torch.tensor(rows), torch.zeros(8, dtype=torch.bool))
    lag.end_pass()
    assert not lag.enabled and lag.samples == 1  # the pass's end disarms it
    want = math.log(4 / 2) / math.log(3)  # rows 4-6: experts 4, 5, 6, 7 for 3 rows of 2
    assert lag.reuse == pytest.approx((want + REUSE * PRIOR_WEIGHT) / (1 + PRIOR_WEIGHT))


class VerifyPasses:
    """A second recorder: every pass it sees, with the routed ids of each MoE layer (always on)."""

    enabled = True

    def __init__(self):
        self.passes = []

    def begin_pass(self, info: PassInfo) -> None:
        self.passes.append((info, []))

    def record(self, layer: int, ids_TK: torch.Tensor, gpu_mask_E: torch.Tensor) -> None:
        self.passes[-1][1].append(ids_TK.clone())

    def end_pass(self) -> None:
        pass


def test_the_engine_measures_the_reuse_its_verify_steps_route_and_drafts_count_with_it(tiny_dir):
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [20, 21, 20, 21, 20]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    with LLM(tiny_dir("qwen3_moe"), dtype=torch.float32, progress=False,
             speculative=SpeculativeConfig(num_draft_tokens=4, adaptive=True)) as llm:
        engine, drafter = llm.engine, llm.engine.drafter
        seen = VerifyPasses()
        engine.add_recorder(seen)  # beside the drafter's (which is off between verify passes): both kept
        llm.generate(prompts, params)
        top_k = llm.hybrid.spec.top_k
    lag = drafter.routing
    assert lag.samples > 0 and drafter.drafted_tokens > 0
    # the same estimate from the passes the other recorder saw, its distinct experts counted with Python sets
    total = weight = 0.0
    for info, layers in seen.passes:
        segments, row = [], 0
        for n, prefill in zip(info.num_tokens, info.is_prefill):
            if n >= 2 and not prefill:
                segments.append((row, n))
            row += n
        if not segments:
            continue
        total, weight = total * DECAY, weight * DECAY
        for start, n in segments:
            distinct = sum(len({int(e) for e in ids[start:start + n].flatten()}) for ids in layers) / len(layers)
            total += min(1.0, max(LOWEST, math.log(max(1.0, distinct / top_k)) / math.log(n)))
            weight += 1
    assert weight > 0
    assert lag.reuse == pytest.approx((total + REUSE * PRIOR_WEIGHT) / (weight + PRIOR_WEIGHT))
    assert lag.reuse != pytest.approx(REUSE)  # it moved from the prior
    assert drafter.step_shape([], []).independent == 0 and drafter.reuse == lag.reuse
