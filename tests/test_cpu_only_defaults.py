"""CPU-only runs of a bf16 model: packed non-expert linears on a kernel team of every core, torch's threads beside
it (tiermoe.model.cpu_only), and the team running small jobs on the caller alone."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from conftest import rel_err
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from tiermoe.config import CPUConfig
from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import SamplingParams
from tiermoe.errors import TiermoeError
from tiermoe.experts.kernels import (
    MAX_SPIN_US,
    SOLO_BYTES,
    SPIN_US,
    ThreadTeam,
    load_kernels,
    solo_bytes_from_env,
    spin_us_from_env,
    supported_isa,
)
from tiermoe.experts.quant import blocked_nbytes
from tiermoe.experts.threads import physical_cpus, torch_threads
from tiermoe.layers.quantized_linear import QuantizedLinear
from tiermoe.model.cpu_only import cpu_only_defaults, torch_threads_beside

needs_kernels = pytest.mark.skipif(supported_isa() is None, reason="the kernel library is unavailable")
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@needs_kernels
def test_a_bf16_model_run_cpu_only_packs_its_linears_in_bf16_on_every_core():
    cores = len(physical_cpus())
    auto = cpu_only_defaults(CPUConfig(), CPU, torch.bfloat16, trainable=False, multi_rank=False)
    assert (auto.non_expert_dtype, auto.threads) == ("bf16", cores)
    assert torch_threads_beside(auto) == 1  # every core in the team: torch keeps one, the caller's
    assert torch_threads_beside(CPUConfig(non_expert_dtype="bf16", threads=1)) == max(1, cores - 1)
    # an explicit format takes the same team; explicit threads stay
    assert cpu_only_defaults(CPUConfig(non_expert_dtype="int4"), CPU, torch.bfloat16, False, False).threads == cores
    assert cpu_only_defaults(CPUConfig(threads=1), CPU, torch.bfloat16, False, False).threads == 1


@pytest.mark.parametrize("case", ["fp32", "gpu", "trainable", "ranks", "as loaded", "torch backend"])
def test_the_defaults_leave_other_runs_as_they_were(case):
    cpu = CPUConfig(non_expert_dtype="none") if case == "as loaded" else \
        CPUConfig(backend="torch") if case == "torch backend" else CPUConfig()
    out = cpu_only_defaults(cpu, CUDA if case == "gpu" else CPU, torch.float32 if case == "fp32" else torch.bfloat16,
                            trainable=case == "trainable", multi_rank=case == "ranks")
    assert out == cpu and torch_threads_beside(out) is None


def test_without_kernels_nothing_is_packed(monkeypatch):
    monkeypatch.setenv("TIERMOE_CPU_ISA", "torch")
    assert cpu_only_defaults(CPUConfig(), CPU, torch.bfloat16, False, False) == CPUConfig()


def test_the_solo_size_can_be_set_for_tests_and_a_bad_one_says_what_is_expected(monkeypatch):
    assert solo_bytes_from_env() == SOLO_BYTES
    monkeypatch.setenv("TIERMOE_TEAM_SOLO_BYTES", "0")
    assert solo_bytes_from_env() == 0
    monkeypatch.setenv("TIERMOE_TEAM_SOLO_BYTES", "4MB")
    with pytest.raises(ValueError, match="expected a whole number of bytes"):
        solo_bytes_from_env()
    if supported_isa() is not None:  # read when the kernels load, so a model load stops there with that message
        with pytest.raises(TiermoeError, match="TIERMOE_TEAM_SOLO_BYTES='4MB': expected a whole number of bytes"):
            load_kernels()


def test_the_helpers_spin_can_be_set_and_a_bad_or_unbounded_one_says_what_is_expected(monkeypatch):
    assert spin_us_from_env() == SPIN_US
    monkeypatch.setenv("TIERMOE_TEAM_SPIN_US", "2000")
    assert spin_us_from_env() == 2000
    if supported_isa() is not None:  # the kernels carry it to every team made from them
        kernels = load_kernels()
        assert kernels.spin_us == 2000
        team = ThreadTeam(kernels, 2)
        assert team.read_seconds(torch.ones(1 << 16, dtype=torch.int64), 1) > 0  # helpers that spin still work
        team.close()
    for bad in ("2ms", "-5", str(MAX_SPIN_US + 1)):
        monkeypatch.setenv("TIERMOE_TEAM_SPIN_US", bad)
        with pytest.raises(TiermoeError, match=f"TIERMOE_TEAM_SPIN_US='{bad}': expected a whole number of microseconds"):
            spin_us_from_env()


def test_torch_threads_are_set_for_the_block_and_restored():
    before = torch.get_num_threads()
    with torch_threads(None):
        assert torch.get_num_threads() == before
    with torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError), torch_threads(1):
        raise RuntimeError("a failed step")
    assert torch.get_num_threads() == before


@needs_kernels
def test_a_loaded_bf16_model_computes_on_the_team_with_torch_beside_it_and_matches_as_loaded(tiny_dir):
    path = tiny_dir("qwen3_moe")
    seen = []
    prompts = [[5, 9, 13, 2, 7], [3, 4]]
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    with LLM(path, dtype=torch.bfloat16, progress=False) as llm:
        model = llm.hybrid.model
        attn = model.model.layers[0].self_attn
        assert isinstance(model.get_output_embeddings(), QuantizedLinear)
        assert isinstance(attn.o_proj, QuantizedLinear)
        assert llm.hybrid.torch_threads == 1  # the team has every core
        layer = model.model.layers[0]  # its forward runs every step (the whole-layer call or the per-op modules)
        hook = layer.register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
        before = torch.get_num_threads()
        packed = [r.token_ids for r in llm.generate(prompts, greedy)]
        hook.remove()
        logits = llm.hybrid(input_ids=torch.tensor([prompts[0]])).logits.float()
    assert seen and set(seen) == {llm.hybrid.torch_threads} and torch.get_num_threads() == before
    with LLM(path, dtype=torch.bfloat16, cpu=CPUConfig(non_expert_dtype="none"), progress=False) as llm:
        assert not isinstance(llm.hybrid.model.get_output_embeddings(), QuantizedLinear)
        assert llm.hybrid.torch_threads is None
        loaded = [r.token_ids for r in llm.generate(prompts, greedy)]
        ref = llm.hybrid(input_ids=torch.tensor([prompts[0]])).logits.float()
    assert rel_err(logits, ref) < 2e-2  # the same bf16 values, summed in another order
    # the first tokens agree; later ones may part at a near tie of this random model (both runs are within bf16
    # rounding of transformers': tests/test_fused_decode_layer.py)
    assert [t[:1] for t in packed] == [t[:1] for t in loaded] and all(len(t) == 6 for t in packed)


class _ThreadsPerOp(TorchDispatchMode):
    """torch's intra-op thread count at every op dispatched on this thread."""

    def __init__(self):
        super().__init__()
        self.seen = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.setdefault(torch.get_num_threads(), set()).add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@needs_kernels
def test_a_fed_step_runs_every_op_at_the_engines_torch_threads_the_logits_copy_too(tiny_dir):
    """An op at more threads wakes torch's OpenMP workers, which then spin on the kernel team's cores through the
    next steps (the logits' fp32 copy once did that on every `feed`: the 8-row demo step 30% slower)."""
    with LLM(tiny_dir("qwen3_moe"), dtype=torch.bfloat16, max_running=2, progress=False) as llm:
        engine = llm.engine
        assert engine.hybrid.torch_threads == 1
        seqs = [engine.new_sequence() for _ in range(2)]
        engine.feed(seqs, [[5, 9, 13], [3, 4]])
        with torch_threads(2), _ThreadsPerOp() as ops:
            logits = engine.feed(seqs, [[7], [8]])
        for seq in seqs:
            engine.release(seq)
    assert logits[0].dtype == torch.float32 and ops.seen and set(ops.seen) == {1}, ops.seen


@needs_kernels
@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_a_small_product_runs_on_the_caller_alone_and_a_large_one_on_the_team_alike(fmt):
    """A product's work: its weight bytes, each row beyond the first an eighth more (a prompt's rows are work to
    split too). bf16: 2 MiB and 16 MiB of weights; int4: a quarter of each; SOLO_BYTES is 4 MiB."""
    kernels = load_kernels()
    g = torch.Generator().manual_seed(0)
    medium, large = nn.Linear(1024, 1024), nn.Linear(4096, 2048)
    assert blocked_nbytes(fmt, 1024, 1024) < SOLO_BYTES <= blocked_nbytes(fmt, 2048, 4096)
    x = torch.randn(64, 4096, generator=g)
    one, pair, always = ThreadTeam(kernels, 1), ThreadTeam(kernels, 2), ThreadTeam(kernels, 2, solo_bytes=0)
    try:
        for linear, rows, solo in ((medium, 1, True), (medium, 64, False), (large, 3, False)):
            xs = x[:rows, :linear.in_features]
            before = pair.shared_jobs
            y = QuantizedLinear(linear, fmt, kernels, lambda: pair)(xs)
            assert pair.shared_jobs - before == (0 if solo else 1), (rows, linear)
            for team in (one, always):
                assert torch.equal(QuantizedLinear(linear, fmt, kernels, lambda t=team: t)(xs), y)
        assert always.shared_jobs == 3 and one.shared_jobs == 0
    finally:
        for team in (one, pair, always):
            team.close()


@needs_kernels
def test_the_read_probe_and_the_empty_job_run_on_every_member_and_refuse_what_they_cannot_read():
    """The benchmarks' floor (bench_read_pace.py): the team's members read the buffer (every one takes part, so the
    helpers' job count moves), and a buffer the probe cannot read is refused with a message, not read past."""
    kernels = load_kernels()
    team = ThreadTeam(kernels, 2)
    try:
        buffer = torch.ones(1 << 20, dtype=torch.int64)  # 8 MiB: 32 of the probe's chunks
        before = team.shared_jobs
        assert team.read_seconds(buffer, 2) > 0
        team.empty_job()
        assert team.shared_jobs - before == 3  # two passes and the empty job, none on the caller alone
        for bad in (buffer[::2], torch.ones(3, dtype=torch.uint8), buffer[1:].view(torch.uint8)[1:9]):
            with pytest.raises(ValueError, match="contiguous CPU buffer of a multiple of 8 bytes"):
                team.read_seconds(bad, 1)
        with pytest.raises(ValueError, match="reps >= 1"):
            team.read_seconds(buffer, 0)
    finally:
        team.close()


@needs_kernels
@pytest.mark.skipif(len(physical_cpus()) < 2, reason="needs two cores")
def test_a_thread_pinned_by_a_team_still_sees_every_core():
    """A team pins its calling thread to one CPU on its first job; a team made later from that thread (a second
    model, another thread count) must still be offered every core, not the one the caller was pinned to."""
    kernels = load_kernels()
    cores, seen = physical_cpus(), {}
    team = ThreadTeam(kernels, 1, cpus=[cores[-1]])

    def pinned_caller():
        team.empty_job()  # pins this thread
        seen["affinity"], seen["cores"] = sorted(os.sched_getaffinity(0)), physical_cpus()

    try:
        worker = threading.Thread(target=pinned_caller)
        worker.start()
        worker.join()
    finally:
        team.close()
    assert seen["affinity"] == [cores[-1]]
    assert seen["cores"] == cores
