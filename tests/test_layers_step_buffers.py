"""A step's metadata in buffers reserved once (tiermoe.layers.step_buffers): every decode step writes its page tables,
positions and indices where the one before did, the addresses a CUDA graph of the step would capture.

The outputs through the buffers are checked by tests/test_engine_kv_pool.py and tests/test_layers_decode_attention.py
(unchanged, every step goes through the buffers); here, in addition: sequences joining and leaving a batch get the
tokens they get alone.
"""

from __future__ import annotations

import pytest
import torch

from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import SamplingParams
from tiermoe.errors import TiermoeError
from tiermoe.layers.paged_attention import STEP_KWARG
from tiermoe.layers.ragged_step import RaggedStep, SeqFeed
from tiermoe.layers.step_buffers import StepBuffers, StepLimits


def _prompt(n: int, salt: int) -> list[int]:
    return [3 + (5 * i + 13 * salt) % 200 for i in range(n)]


def _metadata(kwargs: dict) -> dict[str, torch.Tensor]:
    """Every tensor of step metadata one engine forward is given (the model's keyword arguments and its step's)."""
    step = kwargs[STEP_KWARG]
    found = {"input_ids": kwargs["input_ids"], "position_ids": kwargs["position_ids"],
             "logits_to_keep": kwargs["logits_to_keep"], "decode_pos": step.decode_pos,
             "state_read": step.state_read, "state_write": step.state_write}
    for window, group in step.groups.items():
        found[f"write_index {window}"] = group.write_index
        found[f"read_pages {window}"] = group.read_pages
        if group.decode is not None:
            found[f"tables {window}"] = group.decode.tables
            found[f"lo {window}"] = group.decode.lo
    return {name: t for name, t in found.items() if t is not None}


def _watch(engine, on_forward) -> object:
    """Call on_forward(model kwargs) before every forward of the engine's model; returns the hook's handle."""
    return engine.model.register_forward_pre_hook(lambda module, args, kwargs: on_forward(kwargs), with_kwargs=True)


# gpt_oss: a sliding window beside full attention; qwen3_next: linear-attention state slots; deepseek_v3: MLA, whose
# decode rows attend gathered pages (no in-place decode attention)
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "qwen3_next", "deepseek_v3"])
def test_decode_steps_write_their_metadata_at_the_same_addresses(arch, tiny_dir):
    with LLM(tiny_dir(arch), dtype=torch.float32, max_running=3, prefill_chunk=8, page_size=4,
             progress=False) as llm:
        engine = llm.engine
        decode_steps = []  # the tensors themselves: kept alive, so no freed address can come back by chance
        handle = _watch(engine, lambda kwargs: decode_steps.append(_metadata(kwargs))
                        if kwargs[STEP_KWARG].num_decode == len(kwargs[STEP_KWARG].feeds) else None)
        for salt, (n, max_tokens) in enumerate([(5, 7), (9, 3), (3, 10)]):
            engine.add(_prompt(n, salt), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        for _ in range(4):
            engine.step()
        engine.add(_prompt(6, 3), SamplingParams(max_tokens=4, ignore_eos=True))  # joins while the others decode
        engine.run_to_completion()
        handle.remove()
        buffers = engine.pool.step_buffers
        rows = {s["position_ids"].shape[1] for s in decode_steps}
        assert len(decode_steps) >= 6 and len(rows) >= 2, rows  # sequences joined and left between them
        names = set().union(*decode_steps)
        in_place = arch != "deepseek_v3"
        assert ("tables None" in names) == in_place and ("state_read" in names) == (arch == "qwen3_next")
        for name in sorted(names):
            assert len({s[name].data_ptr() for s in decode_steps}) == 1, name
            assert all(buffers.holds(s[name]) for s in decode_steps), name


def test_sequences_joining_and_leaving_get_the_tokens_they_get_alone(tiny_dir):
    prompts = [_prompt(n, salt) for salt, n in enumerate([7, 2, 12, 5])]
    lengths = [6, 2, 4, 5]
    with LLM(tiny_dir("gpt_oss"), dtype=torch.float32, max_running=2, prefill_chunk=8, page_size=4,
             prefix_cache=False, progress=False) as llm:
        engine = llm.engine
        together = [engine.add(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in zip(prompts, lengths)]
        engine.run_to_completion()
        for prompt, n, seq in zip(prompts, lengths, together):
            alone = engine.add(prompt, SamplingParams(max_tokens=n, ignore_eos=True))
            engine.run_to_completion()
            assert seq.output_ids == alone.output_ids and len(alone.output_ids) == n


def test_the_scheduler_builds_no_step_beyond_the_buffers_and_a_hand_fed_one_is_refused(tiny_dir):
    with LLM(tiny_dir("qwen3_moe"), dtype=torch.float32, max_running=2, prefill_chunk=8, page_size=4,
             prefix_cache=False, progress=False) as llm:
        engine = llm.engine
        limits = engine.pool.step_buffers.limits
        assert (limits.tokens, limits.rows) == (2 + 8, 2)
        sizes = []
        handle = _watch(engine, lambda kwargs: sizes.append((len(kwargs[STEP_KWARG].feeds),
                                                             kwargs["input_ids"].shape[1])))
        llm.generate([_prompt(13, salt) for salt in range(5)], SamplingParams(max_tokens=4, ignore_eos=True))
        handle.remove()
        assert max(rows for rows, _ in sizes) == 2 and max(tokens for _, tokens in sizes) <= limits.tokens
        seqs = [engine.new_sequence() for _ in range(3)]
        with pytest.raises(TiermoeError, match=r"3 sequences.*hold 2 \(max_running\)"):
            engine.feed(seqs, [[5], [6], [7]])
        with pytest.raises(TiermoeError, match=r"11 tokens.*hold 10 \(max_running \+ prefill_chunk\)"):
            engine.feed(seqs[:1], [list(range(3, 14))])
        for seq in seqs:
            engine.release(seq)


def test_a_step_writes_prefixes_of_its_buffers_and_a_wider_table_is_refused():
    buffers = StepBuffers(StepLimits(tokens=6, rows=2, pages=3), [None], torch.device("cpu"))
    feeds = [SeqFeed(9, 1, {None: [2, 5, 6]}), SeqFeed(2, 1, {None: [4]})]
    step = RaggedStep(feeds, 4, {0: None}, torch.device("cpu"), torch.float32, decode_attention=object(),
                      buffers=buffers)
    decode = step.groups[None].decode
    assert decode.tables.tolist() == [[2, 5, 6], [4, 0, 0]] and decode.lo.tolist() == [0, 0]
    assert step.decode_pos.tolist() == [9, 2] and step.position_ids.tolist() == [[9, 2]]
    again = RaggedStep(feeds[1:], 4, {0: None}, torch.device("cpu"), torch.float32, decode_attention=object(),
                       buffers=buffers)
    assert again.groups[None].decode.tables.tolist() == [[4]]
    assert again.groups[None].decode.tables.data_ptr() == decode.tables.data_ptr()
    with pytest.raises(TiermoeError, match="pages"):  # a table of 4 pages: the buffers hold 2 rows of 3
        RaggedStep([SeqFeed(12, 1, {None: [2, 5, 6, 7]}), feeds[1]], 4, {0: None}, torch.device("cpu"),
                   torch.float32, decode_attention=object(), buffers=buffers)
