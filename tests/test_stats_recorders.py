"""Expert distribution recorders: exact counts against the router's own output, per-token traces, GPU-tier
snapshots, SGLang's buffer semantics, no work when off, and no host-device synchronisation in stat mode."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tiermoe.arch import detect, load_config
from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import SamplingParams
from tiermoe.errors import TiermoeError
from tiermoe.stats.gpu_mask_recorder import GpuMaskRecorder
from tiermoe.stats.model_shape import ModelShape
from tiermoe.stats.per_pass_recorder import PerPassRecorder
from tiermoe.stats.recorders import RecorderGroup, make_recorder
from tiermoe.stats.recording import NO_RECORDER, PassInfo
from tiermoe.stats.stat_recorder import StatRecorder
from tiermoe.stats.traces import PerTokenRecorder, passes_from_trace

# Uneven prompts, more of them than may run at once, prompts cut into chunks: passes mix prefill and decode rows.
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21], [30, 31, 32, 33, 34], [40], [50, 51, 52]]
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


class RouterSpy:
    """Forward hooks on every block's router: the routed ids [T, K] of each call, per layer, in call order."""

    def __init__(self, llm):
        self.ids = {layer: [] for layer in llm.hybrid.blocks}
        self.handles = [
            block._modules[block.spec.router_attr].register_forward_hook(
                lambda module, args, out, layer=layer: self.ids[layer].append(out[2].detach().clone()))
            for layer, block in llm.hybrid.blocks.items()
        ]

    def counts(self, num_layers: int, num_experts: int) -> torch.Tensor:
        counts_LE = torch.zeros(num_layers, num_experts, dtype=torch.int64)
        for layer, calls in self.ids.items():
            counts_LE[layer] = torch.bincount(torch.cat(calls).reshape(-1), minlength=num_experts)
        return counts_LE


class PassSpy:
    """A recorder that only remembers the PassInfo of every pass (run beside a real one)."""

    enabled = True

    def __init__(self):
        self.passes: list[PassInfo] = []

    def begin_pass(self, info):
        self.passes.append(info)

    def record(self, layer, ids_TK, gpu_mask_E):
        pass

    def end_pass(self):
        pass

    start = stop = reset = end_pass

    def dump(self):
        return {}


def run_recorded(path, recorder, prompts=PROMPTS, **llm_kwargs):
    with LLM(path, dtype=torch.float32, max_running=3, prefill_chunk=4, recorder=recorder, progress=False,
             **llm_kwargs) as llm:
        spy = RouterSpy(llm)
        outputs = llm.generate(prompts, GREEDY)
    return spy, outputs


def shape_of(path) -> ModelShape:
    return ModelShape.of(detect(load_config(path)))


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_stat_counts_are_exactly_what_the_routers_chose(arch, tiny_dir):
    path = tiny_dir(arch)
    shape = shape_of(path)
    recorder = StatRecorder(shape)
    spy, outputs = run_recorded(path, recorder)
    dump = recorder.dump()

    logical = dump["logical_count"]
    # SGLang's stat layout: int32, one [L, E] slot per pass (-1: unbounded)
    assert logical.shape == (dump["num_passes"], shape.num_layers, shape.num_experts) and logical.dtype == torch.int32
    assert dump["average_utilization_rate_over_window"] is None and dump["rank"] == 0
    assert torch.equal(logical.sum(dim=0, dtype=torch.int64), spy.counts(shape.num_layers, shape.num_experts))
    # every fed token (the prompts, then each generated token but the last) routes to top-k experts per MoE layer
    prefill = sum(len(p) for p in PROMPTS)
    decode = sum(len(o.token_ids) - 1 for o in outputs)
    assert dump["num_prefill_tokens"] == prefill and dump["num_decode_tokens"] == decode
    assert int(logical.sum()) == (prefill + decode) * shape.top_k * len(shape.moe_layers)
    dense = [layer for layer in range(shape.num_layers) if layer not in shape.moe_layers]
    assert int(logical[:, dense].sum()) == 0
    assert torch.equal(dump["logical_count_prefill"] + dump["logical_count_decode"],
                       logical.sum(dim=0, dtype=torch.int64))
    assert int(dump["logical_count_prefill"].sum()) == prefill * shape.top_k * len(shape.moe_layers)
    assert dump["model_type"] == arch and dump["top_k"] == shape.top_k and dump["moe_layers"] == list(shape.moe_layers)


def test_per_token_trace_has_every_token_with_its_request_position_and_phase(tiny_dir):
    path = tiny_dir("deepseek_v3")
    shape = shape_of(path)
    trace_recorder, passes = PerTokenRecorder(shape), PassSpy()
    spy, outputs = run_recorded(path, RecorderGroup(trace_recorder, passes))
    trace = trace_recorder.dump()

    # the requests are the engine's sequence ids 0..4, in prompt order
    for request, (prompt, out) in enumerate(zip(PROMPTS, outputs)):
        mine = trace["token_request"] == request
        positions = trace["token_position"][mine]
        fed = len(prompt) + len(out.token_ids) - 1
        assert positions.tolist() == list(range(fed))  # every token once, in pass order
        assert trace["token_is_prefill"][mine].tolist() == [p < len(prompt) for p in range(fed)]
    assert trace["token_pass"].diff().ge(0).all()
    # the routed ids of every token and MoE layer are the router's, row for row
    for m, layer in enumerate(shape.moe_layers):
        assert torch.equal(trace["topk_ids"][:, m].long(), torch.cat(spy.ids[layer]))
    assert trace["topk_ids"].dtype == torch.int16
    # which requests shared which pass, as the engine announced it
    assert passes_from_trace(trace) == passes.passes
    assert any(len(set(p.is_prefill)) == 2 for p in passes.passes), "the test should cover mixed passes"
    assert torch.equal(trace["logical_count"][0], spy.counts(shape.num_layers, shape.num_experts))


def test_per_pass_counts_sum_to_the_stat_counts(tiny_dir):
    path = tiny_dir("qwen3_moe")
    shape = shape_of(path)
    per_pass, passes = PerPassRecorder(shape), PassSpy()
    spy, _ = run_recorded(path, RecorderGroup(per_pass, passes))
    dump = per_pass.dump()
    assert dump["logical_count"].shape[0] == len(passes.passes) == dump["num_passes"]
    assert torch.equal(dump["logical_count"].sum(dim=0), spy.counts(shape.num_layers, shape.num_experts))
    assert dump["pass_index"].tolist() == list(range(len(passes.passes)))
    for i, info in enumerate(passes.passes):
        prefill = sum(n for n, p in zip(info.num_tokens, info.is_prefill) if p)
        assert (dump["num_prefill_tokens"][i], dump["num_decode_tokens"][i]) == (prefill, info.total_tokens - prefill)
        assert int(dump["logical_count"][i].sum()) == info.total_tokens * shape.top_k * len(shape.moe_layers)


def test_gpu_mask_snapshots_show_the_mask_in_force_at_every_pass(tiny_dir):
    path = tiny_dir("qwen3_moe")
    shape = shape_of(path)
    mask = torch.zeros(shape.num_layers, shape.num_experts, dtype=torch.bool)
    mask[0, :3] = True
    mask[2, 5] = True
    recorder = make_recorder("stat", shape, -1, record_gpu_masks=True)
    with LLM(path, dtype=torch.float32, placement=mask, recorder=recorder, progress=False) as llm:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))  # passes 0-2
        llm.hybrid.blocks[2].move_experts([6], to_gpu=True)
        llm.generate([[8, 9]], SamplingParams(max_tokens=2, ignore_eos=True))  # passes 3-4
        moved = llm.placement
    dump = recorder.dump()
    masks = dump["gpu_expert_masks"]
    assert masks.shape == (5, shape.num_layers, shape.num_experts) and masks.dtype == torch.bool
    assert dump["gpu_expert_masks_pass_index"].tolist() == [0, 1, 2, 3, 4]
    assert all(torch.equal(m, mask) for m in masks[:3]) and all(torch.equal(m, moved) for m in masks[3:])
    assert "logical_count" in dump  # the counts ride along


@pytest.mark.parametrize("mode", ["stat", "per_pass", "per_token"])
def test_windowed_buffers_and_reset_work_between_engine_runs(mode, tiny_dir):
    path = tiny_dir("olmoe")
    recorder = make_recorder(mode, shape_of(path), buffer_size=2, record_gpu_masks=True)
    with LLM(path, dtype=torch.float32, recorder=recorder, progress=False) as llm:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))  # 4 passes, the first 2 forgotten
        assert recorder.dump()["num_passes"] == 2
        recorder.reset()
        llm.generate([[8, 9]], SamplingParams(max_tokens=1, ignore_eos=True))  # 1 pass of 2 tokens
    dump = recorder.dump()
    assert dump["num_passes"] == 1 and dump["num_tokens"] == 2 and dump["gpu_expert_masks"].shape[0] == 2
    assert dump["gpu_expert_masks_pass_index"].tolist() == [0, -1]  # SGLang's slot layout: slot 1 not yet filled
    assert int(dump["logical_count"].sum()) == 2 * 2 * 2  # tokens x top-k x MoE layers


def fake_pass(recorder, ids_TK, prefill=(True,), layer=0):
    rows = ids_TK.shape[0]
    sizes = [rows // len(prefill)] * len(prefill)
    recorder.begin_pass(PassInfo(tuple(range(len(prefill))), tuple(sizes), (0,) * len(prefill), tuple(prefill)))
    recorder.record(layer, ids_TK, torch.zeros(4, dtype=torch.bool))
    recorder.end_pass()


def test_circular_buffer_keeps_the_last_passes_like_sglang():
    shape = ModelShape(num_layers=1, num_experts=4, top_k=1, moe_layers=(0,))
    passes = [torch.tensor([[0]]), torch.tensor([[1]]), torch.tensor([[2]])]
    windowed, unbounded = StatRecorder(shape, buffer_size=2), StatRecorder(shape, -1)
    per_pass = PerPassRecorder(shape, 2)
    for ids in passes:
        for r in (windowed, unbounded, per_pass):
            fake_pass(r, ids)
    # stat, N = 2: slots hold passes 2 and 1 (slot = pass mod N, as SGLang's circular buffer)
    assert windowed.dump()["logical_count"][:, 0].tolist() == [[0, 0, 1, 0], [0, 1, 0, 0]]
    assert windowed.dump()["num_passes"] == 2 and windowed.dump()["num_tokens"] == 2
    # stat, -1: every pass in its own slot, as SGLang's growing buffer
    assert unbounded.dump()["logical_count"][:, 0].tolist() == [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0]] \
        and unbounded.dump()["num_passes"] == 3
    # per_pass, N = 2: the last two passes, oldest first
    dump = per_pass.dump()
    assert dump["pass_index"].tolist() == [1, 2]
    assert dump["logical_count"][:, 0].tolist() == [[0, 1, 0, 0], [0, 0, 1, 0]]


def test_stat_splits_a_mixed_pass_by_phase():
    shape = ModelShape(num_layers=1, num_experts=4, top_k=2, moe_layers=(0,))
    recorder = StatRecorder(shape)
    # two sequences of two rows each: the first prefilling, the second decoding (a chunked pass shape)
    fake_pass(recorder, torch.tensor([[0, 1], [0, 2], [3, 3], [3, 1]]), prefill=(True, False))
    dump = recorder.dump()
    assert dump["logical_count_prefill"].tolist() == [[2, 1, 1, 0]]
    assert dump["logical_count_decode"].tolist() == [[0, 1, 0, 3]]
    assert (dump["num_prefill_tokens"], dump["num_decode_tokens"]) == (2, 2)


def test_reset_start_and_stop():
    shape = ModelShape(num_layers=1, num_experts=4, top_k=1, moe_layers=(0,))
    recorder = StatRecorder(shape)
    fake_pass(recorder, torch.tensor([[1]]))
    recorder.stop()
    assert not recorder.enabled
    recorder.reset()
    recorder.start()
    fake_pass(recorder, torch.tensor([[2]]))
    assert recorder.dump()["logical_count"].tolist() == [[[0, 0, 1, 0]]]


class Explodes:
    """A recorder that is off: any call is a failure of the 'no work when off' contract."""

    enabled = False

    def begin_pass(self, info):
        raise AssertionError("begin_pass called while recording is off")

    def record(self, layer, ids_TK, gpu_mask_E):
        raise AssertionError("record called while recording is off")

    def end_pass(self):
        raise AssertionError("end_pass called while recording is off")


def test_recording_off_calls_nothing(tiny_dir):
    with LLM(tiny_dir("qwen3_moe"), dtype=torch.float32, recorder=Explodes(), progress=False) as llm:
        llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=3, ignore_eos=True))
    shape = shape_of(tiny_dir("qwen3_moe"))
    assert make_recorder(None, shape) is NO_RECORDER and NO_RECORDER.enabled is False
    with pytest.raises(TiermoeError, match="needs --expert-distribution-recorder-mode"):
        make_recorder(None, shape, record_gpu_masks=True)


def test_a_stopped_recorder_is_not_called(tiny_dir):
    shape = shape_of(tiny_dir("qwen3_moe"))
    recorder = StatRecorder(shape)
    recorder.stop()
    recorder.begin_pass = recorder.record = recorder.end_pass = Explodes().record
    with LLM(tiny_dir("qwen3_moe"), dtype=torch.float32, recorder=recorder, progress=False) as llm:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))


# Ops that make the host wait for the device (or read device data on the host), on any device.
SYNCING_OPS = {"_local_scalar_dense", "item", "nonzero", "bincount", "unique", "_unique2", "masked_select",
               "equal", "is_nonzero", "allclose", "_to_copy", "to", "cpu", "tolist"}


class OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("make", [
    lambda shape: StatRecorder(shape, -1),
    lambda shape: StatRecorder(shape, 3),
    lambda shape: PerPassRecorder(shape, -1),
    lambda shape: GpuMaskRecorder(shape, 2),
    lambda shape: PerTokenRecorder(shape, -1, flush_bytes=1 << 40),
], ids=["stat", "stat-windowed", "per_pass", "gpu_masks", "per_token"])
def test_recording_reads_nothing_back_from_the_device(make):
    """On the meta device a tensor has no data, so any op that reads data back to the host (.item(), bool(),
    .cpu(), nonzero, bincount with a data-dependent size) fails; the op log double-checks by name."""
    shape = ModelShape(num_layers=3, num_experts=8, top_k=2, moe_layers=(0, 2))
    recorder = make(shape)
    log = OpLog()
    with log:
        for step in range(5):
            rows = 4 if step == 0 else 3
            info = PassInfo(tuple(range(rows - 1)), (2,) + (1,) * (rows - 2), (0,) * (rows - 1),
                            (True,) + (False,) * (rows - 2))
            recorder.begin_pass(info)
            for layer in shape.moe_layers:
                ids = torch.empty(rows, 2, dtype=torch.int64, device="meta")
                recorder.record(layer, ids, torch.empty(8, dtype=torch.bool, device="meta"))
            recorder.end_pass()
    assert log.ops, "the op log saw nothing"
    assert not SYNCING_OPS & set(log.ops), f"syncing ops: {SYNCING_OPS & set(log.ops)}"


def test_stat_record_is_one_kernel_per_same_phase_run():
    shape = ModelShape(num_layers=2, num_experts=8, top_k=2, moe_layers=(0, 1))
    recorder = StatRecorder(shape)
    fake_pass(recorder, torch.zeros(4, 2, dtype=torch.int64))  # allocate the buffers once
    log = OpLog()
    ids_TK, mask_E = torch.zeros(2, 2, dtype=torch.int64), torch.zeros(8, dtype=torch.bool)
    recorder.begin_pass(PassInfo((0, 1), (1, 1), (5, 9), (False, False)))
    with log:
        recorder.record(0, ids_TK, mask_E)
    recorder.end_pass()
    assert [op for op in log.ops if op not in ("select", "slice", "view", "alias", "_unsafe_view")] == ["index_add_"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_stat_recording_never_synchronises_on_cuda():
    shape = ModelShape(num_layers=4, num_experts=64, top_k=8, moe_layers=(1, 2, 3))
    recorder = make_recorder("stat", shape, 16, record_gpu_masks=True)
    ids = torch.randint(0, 64, (32, 8), device="cuda")
    mask = torch.zeros(64, dtype=torch.bool, device="cuda")
    info = PassInfo(tuple(range(32)), (1,) * 32, (7,) * 32, (False,) * 32)
    with torch.inference_mode():
        fake = PassInfo((0,), (32,), (0,), (True,))  # first pass allocates the buffers
        recorder.begin_pass(fake)
        for layer in shape.moe_layers:
            recorder.record(layer, ids, mask)
        recorder.end_pass()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(40):  # wraps the 16-slot buffer
                recorder.begin_pass(info)
                for layer in shape.moe_layers:
                    recorder.record(layer, ids, mask)
                recorder.end_pass()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert int(recorder.dump()["logical_count"].sum()) == 16 * 32 * 8 * 3
