"""Cross-layer swaps with several ranks (gloo, gpu_device=cpu): a GPU slot moves from one layer to another on the
rank that held the demoted expert, every rank applies the move in the same step (rank 0's step plan), and the
tokens are one process's.

The ranks are real processes: this file is also their program (`python tests/test_distributed_cross_layer.py JOB`);
the helpers and the single-process reference are tests/test_distributed.py's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import save_tiny
from test_distributed import MAX_TOKENS, PROMPTS, _holdings, _spec, check_share, run_ranks, single_process

WORKER = Path(__file__).resolve()


def _record_applied_swaps(rank: int) -> list:
    """Every call of apply_swaps on this rank (one per step, on every rank), as the list of swaps it applied."""
    import tiermoe.distributed.follower as follower
    import tiermoe.distributed.step_plan as step_plan

    module = step_plan if rank == 0 else follower  # the leader applies in its step, a follower in follow()
    applied, apply = [], module.apply_swaps

    def recording(hybrid, share, swaps):
        applied.append([[s.layer, s.expert_in, s.expert_out, s.rank, s.out_layer] for s in swaps])
        return apply(hybrid, share, swaps)

    module.apply_swaps = recording
    return applied


def rank_main(job_file: str) -> None:
    from tiermoe.config import AdaptiveSettings, CPUConfig, DynamicPlacementConfig
    from tiermoe.distributed import RankEnv, RankGroup, RankModel, rank_device
    from tiermoe.engine.sampling import SamplingParams
    from tiermoe.placement.policies import Swap

    job = json.loads(Path(job_file).read_text())
    env = RankEnv.from_env()
    reports = []
    with RankGroup(env, rank_device("cpu", env), timeout_s=job["timeout"]) as group:
        for case in job["cases"]:
            leads = group.rank == 0
            dynamic = None
            if case["adaptive"] and leads:  # eager, and asked to move slots between layers
                dynamic = DynamicPlacementConfig(policy="adaptive", adaptive=AdaptiveSettings(
                    half_life_tokens=8, replan_every=1, margin=0.0, max_swaps_in_flight=2, cross_layer=True))
            with RankModel(group, case["path"], torch.tensor(case["assignment"]), dtype=torch.float32,
                           max_running=3, prefill_chunk=3, progress=False, dynamic=dynamic,
                           cpu=CPUConfig(expert_dtype=case["cpu_dtype"])) as rm:
                report = {"before": _holdings(rm), "applied": _record_applied_swaps(group.rank)}
                if leads:
                    rm.share.queue_swaps([Swap(*s) for s in case["swaps"]])  # applied before the first step
                    promoted = {(s[0], s[1]): rm.hybrid.blocks[s[0]].cpu_tier.get(s[1]) for s in case["swaps"]
                                if case.get("round_trip")}
                    outs = rm.llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
                    report["tokens"] = [o.token_ids for o in outs]
                    if case.get("round_trip"):  # the same swaps undone: the promoted experts come back
                        rm.share.queue_swaps([Swap(layer_out, e_out, e_in, layer)
                                              for layer, e_in, e_out, layer_out in case["swaps"]])
                        rm.llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2, ignore_eos=True))
                        report["came_back_as_stored"] = all(
                            all(torch.equal(a, b) for a, b in zip(rm.hybrid.blocks[layer].cpu_tier.get(e).tensors(),
                                                                  w.tensors()))
                            for (layer, e), w in promoted.items())
                    report["swaps"] = rm.hybrid.swap_stats.swaps
                else:
                    report["steps"] = rm.follow()
                report["after"] = _holdings(rm)
            reports.append(report)
    (Path(job["out"]) / f"rank{env.rank}.json").write_text(json.dumps(reports))


@pytest.fixture(scope="module")
def cross_layer_run(tmp_path_factory):
    """Two ranks, experts 0-2 of every MoE layer on the GPUs (round-robin); cases: two cross-layer swaps queued
    by hand (one each way, so both ranks move a slot), with the torch CPU tier, the native one (which converts
    experts, so slots are written and released) and FP8 GPU tiers (one per layer, not a shared slot pool); and the
    adaptive policy with cross_layer=True."""
    from tiermoe.config import CPU_BACKENDS
    from tiermoe.model.gguf_checkpoint import open_checkpoint
    from tiermoe.model.held_bytes import gpu_expert_bytes
    from tiermoe.placement.partition import split_across_gpus
    from tiermoe.testing.fp8_write import write_fp8_checkpoint

    path = save_tiny("qwen3_moe", tmp_path_factory.mktemp("xlayer-model"))
    spec = _spec(path)
    first, last = spec.moe_layers[0], spec.moe_layers[-1]
    mask = torch.zeros(spec.num_layers, spec.num_experts, dtype=torch.bool)
    mask[list(spec.moe_layers), :3] = True
    assignment = split_across_gpus(mask, 2, "round-robin")
    # (layer, expert_in, expert_out, layer_out): expert 5 of the first layer takes the slot of rank 1's expert in
    # the last, expert 6 of the last takes the slot of rank 0's expert in the first
    on_rank = lambda layer, rank: int((assignment[layer] == rank).nonzero()[0])  # noqa: E731
    swaps = [(first, 5, on_rank(last, 1), last), (last, 6, on_rank(first, 0), first)]
    base = {"path": str(path), "assignment": assignment.tolist()}
    cases = [dict(base, swaps=swaps, adaptive=False, cpu_dtype=None)]
    if "native" in CPU_BACKENDS:
        cases.append(dict(base, swaps=swaps, adaptive=False, cpu_dtype="bf16"))
    # FP8: each layer's GPU tier is its own (no shared slot pool); a promotion requantises what the slot holds
    fp8 = write_fp8_checkpoint(path, tmp_path_factory.mktemp("xlayer-fp8") / "m")
    cases.append(dict(base, path=str(fp8), swaps=swaps, adaptive=False, cpu_dtype=None))
    cases.append(dict(base, swaps=[], adaptive=True, cpu_dtype=None))
    if "native" in CPU_BACKENDS:  # int4 experts promoted and demoted again come back with their stored codes
        cases.append(dict(base, swaps=swaps, adaptive=False, cpu_dtype="int4", round_trip=True))
    for case in cases:
        with open_checkpoint(case["path"]) as ckpt:  # FP8 GPU tiers hold experts as stored
            case["gpu_bytes_per_expert"] = gpu_expert_bytes(ckpt, spec, torch.float32)
    reports = run_ranks(tmp_path_factory.mktemp("xlayer"), cases, program=[sys.executable, str(WORKER)])
    return path, spec, assignment, swaps, cases, reports


def test_a_queued_cross_layer_swap_moves_one_slot_on_its_rank_and_every_rank_applies_it(cross_layer_run):
    _, spec, assignment, swaps, cases, reports = cross_layer_run
    expected = assignment.clone()
    for layer, expert_in, expert_out, layer_out in swaps:
        expected[layer, expert_in], expected[layer_out, expert_out] = int(assignment[layer_out, expert_out]), -1
    bpe = spec.bytes_per_expert(torch.float32)
    for i, case in enumerate(cases):
        if case["adaptive"] or case.get("round_trip"):
            continue
        assert reports[0][i]["swaps"] == 2 * len(swaps)  # two experts moved per swap
        for rank in (0, 1):
            after = torch.tensor(reports[rank][i]["after"]["assignment"])
            assert torch.equal(after, expected), (rank, case["cpu_dtype"])
            # the rank keeps its total, its layers' shares change: one slot of it moved to another layer
            assert int((after == rank).sum()) == int((assignment == rank).sum())
            assert not torch.equal((after == rank).sum(dim=1), (assignment == rank).sum(dim=1))
            native = case["cpu_dtype"] is not None
            cpu_bytes = None if not native else reports[0][i]["before"]["tier_bytes"][1] // int(
                ((assignment == -1) & spec.moe_row_mask()[:, None]).sum())
            # the tiers and the shared slots hold what the assignment says
            check_share(reports[rank][i]["after"], rank, case["gpu_bytes_per_expert"], bpe, cpu_bytes)


def test_two_ranks_with_cross_layer_moves_give_one_process_tokens(cross_layer_run):
    _, _, assignment, _, cases, reports = cross_layer_run
    references = {}
    for i, case in enumerate(cases):
        if case.get("round_trip"):
            continue
        key = (case["path"], case["cpu_dtype"])
        if key not in references:
            references[key] = single_process(case["path"], assignment, case["cpu_dtype"])[1]
        tokens = references[key]
        assert reports[0][i]["swaps"] > 0  # with the moves applied
        assert reports[0][i]["tokens"] == tokens, case
        assert reports[1][i]["steps"] > 0


def test_the_adaptive_policy_moves_slots_between_layers_on_two_ranks_when_asked(cross_layer_run):
    _, _, assignment, _, cases, reports = cross_layer_run
    i = next(k for k, case in enumerate(cases) if case["adaptive"])
    applied = [reports[r][i]["applied"] for r in (0, 1)]
    assert applied[0] == applied[1]  # the same swaps, step by step, on both ranks
    cross = [s for step in applied[0] for s in step if s[4] != s[0]]
    assert cross and {s[3] for s in cross} == {0, 1}, applied[0]  # slots moved between layers, on both ranks
    after = [torch.tensor(reports[r][i]["after"]["assignment"]) for r in (0, 1)]
    assert torch.equal(after[0], after[1])
    for rank in (0, 1):
        assert int((after[0] == rank).sum()) == int((assignment == rank).sum())  # each rank keeps its total


def test_int4_experts_swapped_back_across_ranks_come_back_as_stored(cross_layer_run):
    _, _, assignment, swaps, cases, reports = cross_layer_run
    trips = [i for i, case in enumerate(cases) if case.get("round_trip")]
    if not trips:
        pytest.skip("the native CPU backend is not built here")
    for i in trips:
        assert reports[0][i]["came_back_as_stored"]
        assert reports[0][i]["swaps"] == 4 * len(swaps)
        for rank in (0, 1):
            assert torch.equal(torch.tensor(reports[rank][i]["after"]["assignment"]), assignment)


if __name__ == "__main__":
    rank_main(sys.argv[1])
