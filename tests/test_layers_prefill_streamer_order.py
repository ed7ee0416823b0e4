"""The layerwise-prefill streamer orders its device work correctly, checked on the CPU path with fake streams.

Two staging buffers are shared by all layers and calls. A fake pair of queues logs every record and wait, every
copy into a buffer (on the stream it was issued on), every expert computed from a buffer, and every host read of
a CPU-tier expert. From that log:
- every write of a buffer comes after (the side stream waited for) the last compute that read it, whichever layer
  or call that compute belonged to; every compute comes after the copy it reads;
- each forward issues stage(0), launch(0), stage(1), launch(1), ...: the next chunk's host work (dequantisation,
  copies) is issued after the current chunk's compute, so the device computes while the host stages;
and the logits are exactly those of the same model without the streamer.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import pytest
import torch
from conftest import make_mask

import tiermoe.layers.prefill_streamer as prefill_streamer
from tiermoe.arch import detect, load_config
from tiermoe.layers.prefill_streamer import PrefillStreamer
from tiermoe.model.loader import load_hybrid_model


@dataclass
class FakeEvent:
    stream: str
    position: int  # ops issued on `stream` before the record


@dataclass
class FakeQueues:
    """Two named streams; the log holds (op, stream, detail) in issue order."""

    log: list = field(default_factory=list)
    ops: dict = field(default_factory=lambda: {"compute": 0, "side": 0})
    current: list = field(default_factory=lambda: ["compute"])

    def compute(self):
        return "compute"

    def side(self):
        return "side"

    @contextlib.contextmanager
    def on(self, stream):
        self.current.append(stream)
        try:
            yield
        finally:
            self.current.pop()

    def record(self, stream):
        event = FakeEvent(stream, self.ops[stream])
        self.log.append(("record", stream, event))
        return event

    def wait(self, stream, event):
        if event is not None:  # None: nothing recorded yet, so nothing to wait for
            self.log.append(("wait", stream, event))

    def issue(self, op: str, detail) -> None:
        stream = self.current[-1]
        self.log.append((op, stream, detail))
        self.ops[stream] += 1


def buffer_of(streamer: PrefillStreamer, t: torch.Tensor) -> int:
    """Which staging buffer `t` lies in."""
    for b, buf in enumerate(streamer._buffers):
        if buf is None:
            continue
        base = buf.tensors[0]
        start = base.untyped_storage().data_ptr()
        if start <= t.data_ptr() < start + base.untyped_storage().nbytes():
            return b
    raise AssertionError("a compute read weights that are not in a staging buffer")


def instrument(monkeypatch, streamer: PrefillStreamer, queues: FakeQueues, hybrid) -> None:
    copy_into, expert_ffn = prefill_streamer._copy_into, prefill_streamer.expert_ffn

    def logged_copy(dst, src):
        queues.issue("copy", buffer_of(streamer, dst.gate_up))
        return copy_into(dst, src)

    def logged_ffn(w, x, act):
        queues.issue("read", buffer_of(streamer, w.gate_up))
        return expert_ffn(w, x, act)

    monkeypatch.setattr(prefill_streamer, "_copy_into", logged_copy)
    monkeypatch.setattr(prefill_streamer, "expert_ffn", logged_ffn)
    for block in hybrid.blocks.values():
        get = block.cpu_tier.get
        block.cpu_tier.get = lambda e, get=get: (queues.log.append(("get", "host", e)), get(e))[1]


def check_buffer_hazards(log) -> int:
    """Replay the log as two in-order streams joined only by waits on recorded events; returns the reuses seen."""
    issued = {"compute": 0, "side": 0}
    waited = {"compute": {"side": 0}, "side": {"compute": 0}}  # ops of the other stream known to be done
    last_read = {}  # buffer -> compute position of the last read
    last_copy = {}  # buffer -> side position of the last copy
    reuses = 0
    for op, stream, detail in log:
        if op == "wait":
            other = detail.stream
            waited[stream][other] = max(waited[stream][other], detail.position)
        elif op == "copy":
            assert stream == "side", "copies go on the side stream"
            if detail in last_read:
                reuses += 1
                assert waited["side"]["compute"] > last_read[detail], \
                    f"buffer {detail} is overwritten before the compute that read it is done"
            last_copy[detail] = issued["side"]
        elif op == "read":
            assert stream == "compute"
            assert waited["compute"]["side"] > last_copy[detail], f"buffer {detail} is read before its copy landed"
            last_read[detail] = issued["compute"]
        if op in ("copy", "read"):
            issued[stream] += 1
    return reuses


def phases(log) -> list[str]:
    """The log as runs of host reads (G), copies (C) and computes (R), one letter per run."""
    letters = {"get": "G", "copy": "C", "read": "R"}
    out = []
    for op, _, _ in log:
        letter = letters.get(op)
        if letter and (not out or out[-1] != letter):
            out.append(letter)
    return out


def test_staging_buffers_are_reused_only_after_their_last_read_across_layers_and_calls(tiny_dir, monkeypatch):
    path = tiny_dir("qwen3_moe")
    spec = detect(load_config(path))
    ids = torch.randint(3, 200, (1, 24), generator=torch.Generator().manual_seed(0))
    with load_hybrid_model(path, make_mask("single_gpu_expert", spec), dtype=torch.float32,
                           progress=False) as hybrid:
        ref = hybrid(input_ids=ids).logits
        queues = FakeQueues()
        # one expert per buffer: every layer streams several chunks, and both buffers are reused by every layer
        streamer = PrefillStreamer("cpu", threshold=8, buffer_bytes=1, bytes_per_expert=1,
                                   num_experts=spec.num_experts, queues=queues)
        for block in hybrid.blocks.values():
            block.prefill_streamer = streamer
        instrument(monkeypatch, streamer, queues, hybrid)
        first = hybrid(input_ids=ids).logits
        calls_log = len(queues.log)
        second = hybrid(input_ids=ids).logits
    assert streamer.batches == 2 * len(hybrid.blocks) and streamer.chunk == 1
    assert torch.equal(first, ref) and torch.equal(second, ref)
    reuses = check_buffer_hazards(queues.log)
    assert reuses > 4 * len(hybrid.blocks)  # the check above really saw buffers change hands
    # per forward of a layer: G C R per chunk, never two stages in a row before the first compute
    letters = "".join(phases(queues.log[:calls_log]))
    per_layer = letters.split("GCR")
    assert set(per_layer) == {""}, f"stages and launches interleave wrongly: {letters[:40]}..."


def test_the_checker_catches_a_buffer_overwritten_while_read():
    """The replay above is not vacuous: a copy after a read, with no wait in between, is a hazard."""
    landed = FakeEvent("side", 1)
    log = [("copy", "side", 0), ("record", "side", landed), ("wait", "compute", landed), ("read", "compute", 0),
           ("copy", "side", 0)]
    try:
        check_buffer_hazards(log)
    except AssertionError as err:
        assert "overwritten" in str(err)
    else:
        raise AssertionError("the hazard went unnoticed")


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_chunk_is_capped_by_the_expert_count_and_buffers_sized_by_it(arch, tiny_dir):
    path = tiny_dir(arch)
    spec = detect(load_config(path))
    ids = torch.randint(3, 200, (1, 16), generator=torch.Generator().manual_seed(1))
    with load_hybrid_model(path, None, dtype=torch.float32, progress=False) as hybrid:
        ref = hybrid(input_ids=ids).logits
        streamer = PrefillStreamer("cpu", threshold=8, buffer_bytes=1 << 40, bytes_per_expert=1000,
                                   num_experts=spec.num_experts)
        assert streamer.chunk == spec.num_experts  # not 2**40 / 2000 slots
        for block in hybrid.blocks.values():
            block.prefill_streamer = streamer
        assert torch.equal(hybrid(input_ids=ids).logits, ref)
    assert streamer._buffers[1] is None  # one chunk per layer: the second buffer is never needed
    assert streamer._buffers[0].tensors[0].shape[0] == spec.num_experts
