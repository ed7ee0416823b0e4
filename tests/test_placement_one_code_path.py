"""One code path: the live engine's placement manager and trace replay run the same policy through the same swap
schedule (tiermoe.placement.swap_schedule), so a trace recorded while serving, replayed, proposes the same swaps at
the same steps. Tiny OLMoE (every layer MoE), copies that land before the next step in both."""

from __future__ import annotations

import torch

from tiermoe.analysis.placement_traffic import pass_shapes, placement_traffic
from tiermoe.analysis.trace_replay import replay
from tiermoe.config import AdaptiveSettings, DynamicPlacementConfig, PlacementConfig
from tiermoe.engine.dynamic import enable_dynamic_placement
from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import SamplingParams
from tiermoe.experts.copier import AsyncCopier, CopyTicket
from tiermoe.placement.pass_cost import expert_cost_model
from tiermoe.placement.policies import Swap
from tiermoe.placement.profiles import GPUProfile
from tiermoe.placement.swap_schedule import SwapSchedule
from tiermoe.stats.model_shape import ModelShape
from tiermoe.stats.recorders import make_recorder

PROMPTS = [list(range(5, 30)), [40, 41, 42], list(range(60, 75)), [7, 8, 9, 10]]
# swap at the first sign of a difference, so a short run sees many swaps (and a full copy budget)
EAGER = AdaptiveSettings(half_life_tokens=8, margin=0.0, z_score=0.0, swap_z_score=0.0, settled_swap_z_score=0.0,
                         max_swaps_in_flight=2)


class CopyAtOnce(AsyncCopier):
    """Every copy has landed by the time the manager next looks (as a replay's copies do: they take less than a
    pass), so both see the same placement after every step."""

    def start(self, weights, device, pin=False, out=None) -> CopyTicket:
        landed = weights.to(torch.device(device), pin=pin)
        if out is not None:
            for d, s in zip(out.tensors(), landed.tensors()):
                d.copy_(s)
            landed = out
        return CopyTicket(landed)


def test_a_recorded_trace_replays_to_the_swaps_serving_made_step_by_step(tiny_dir):
    with LLM(tiny_dir("olmoe"), placement=PlacementConfig(num_gpu_experts=2), dtype=torch.float32,
             progress=False) as llm:
        spec = llm.hybrid.spec
        assert spec.num_moe_layers == spec.num_layers  # the replay's rows are the MoE layers
        # copies fast against any pass, so a copy started after a pass lands during the next, live and replayed
        fast_link = GPUProfile("fast-link", 1e12, 1e14, 1e18, 5e-6)
        cost = expert_cost_model(spec.bytes_per_expert(llm.hybrid.expert_dtype), 2.0 * spec.params_per_expert,
                                 fast_link)
        recorder = make_recorder("per_token", ModelShape.of(spec), -1)
        llm.engine.add_recorder(recorder)
        manager = enable_dynamic_placement(llm.engine, DynamicPlacementConfig(policy="adaptive", adaptive=EAGER),
                                           cost, copier=CopyAtOnce())
        live = []
        accept = manager.schedule.accept
        manager.schedule.accept = lambda proposals, busy: [
            live.append((manager.policy._passes - 1, s)) or s for s in accept(proposals, busy)]
        llm.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True))
        manager.close()
        trace = recorder.dump()
    assert len(live) >= 10  # the run really swaps
    ratio = 2 / spec.num_experts  # 2 GPU experts a layer, placed by uniform (no calibration) in both
    replayed = replay(trace, "adaptive", ratio, cost, adaptive=EAGER, copy_budget=EAGER.max_swaps_in_flight)
    assert replayed.swap_log == live
    bench_log: list = []  # bench placement's simulation runs the same schedule
    placement_traffic(pass_shapes(trace), "adaptive", ratio, None, cost, adaptive=EAGER, swap_log=bench_log)
    assert bench_log == live


def test_the_schedule_demotes_first_and_keeps_busy_experts_out_of_new_swaps():
    schedule = SwapSchedule(max_in_flight=1)
    busy = schedule.busy(2, 4)
    accepted = schedule.accept([Swap(0, 2, 0), Swap(0, 2, 1), Swap(1, 3, 0, layer_out=0)], busy)
    assert accepted == [Swap(0, 2, 0)]  # the other two touch an expert of the first
    tickets = []

    class Ticket:
        done = False

        def landed(self):
            return self.done

    start = lambda swap, layer, expert, to_gpu: tickets.append((layer, expert, to_gpu, Ticket())) or tickets[-1][3]
    schedule.start(lambda s: True, start)
    assert [t[:3] for t in tickets] == [(0, 0, False)]  # the demotion first
    assert schedule.landed() == []  # nothing flips before its copy lands
    tickets[0][3].done = True
    (copy,) = schedule.landed()
    assert not schedule.after_landing(copy)  # half done: waits for its promotion
    schedule.start(lambda s: True, start)
    assert [t[:3] for t in tickets][1:] == [(0, 2, True)]
    tickets[1][3].done = True
    assert schedule.after_landing(schedule.landed()[0]) and schedule.idle
