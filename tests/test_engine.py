"""The engine: batched generation equals one-at-a-time generation equals transformers' greedy tokens."""

from __future__ import annotations

import pytest
import torch
from conftest import load_reference, save_char_tokenizer, save_tiny

from tiermoe.arch import detect, load_config
from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import SamplingParams, new_generator, sample
from tiermoe.errors import TiermoeError

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21], [30, 31, 32, 33, 34], [40]]


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens of the unmodified transformers model, recomputing the whole sequence every step."""
    ids, out = list(prompt), []
    for _ in range(n):
        with torch.no_grad():
            token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(token)
        out.append(token)
    return out


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    path = save_tiny("qwen3_moe", tmp_path_factory.mktemp("chat"))
    save_char_tokenizer(path)
    return path


@pytest.mark.exactness
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "gpt_oss", "qwen3_next"])
def test_batched_greedy_equals_alone_equals_transformers(arch, tiny_dir):
    path = tiny_dir(arch)
    spec = detect(load_config(path))
    mask = torch.rand(spec.num_layers, spec.num_experts, generator=torch.Generator().manual_seed(1)) < 0.5
    greedy = SamplingParams(max_tokens=10, ignore_eos=True)
    ref = load_reference(path)
    # 3 running at most, so the 4th prompt waits in the queue; chunks of 3 split the longer prompts
    with LLM(path, placement=mask, dtype=torch.float32, max_running=3, prefill_chunk=3, progress=False) as llm:
        batched = llm.generate(PROMPTS, greedy)
        for prompt, result in zip(PROMPTS, batched):
            alone = llm.generate(prompt, greedy)[0]
            assert result.token_ids == alone.token_ids == reference_greedy(ref, prompt, 10)
            assert result.finish_reason == "length"


def test_moe_blocks_run_once_per_step_for_the_whole_batch(tiny_dir):
    with LLM(tiny_dir("olmoe"), dtype=torch.float32, progress=False) as llm:
        calls = []
        block = llm.hybrid.blocks[0]
        original = block.forward_tokens
        block.forward_tokens = lambda h: (calls.append(h.shape[:-1].numel()), original(h))[1]
        llm.generate([[5, 6, 7], [8, 9], [10]], SamplingParams(max_tokens=3, ignore_eos=True))
        # step 1: all three prompts prefill together (3 + 2 + 1 tokens); then 2 decode steps of 3 tokens
        assert calls == [6, 3, 3]


def test_seeded_sampling_is_reproducible(tiny_dir):
    with LLM(tiny_dir("mixtral"), dtype=torch.float32, progress=False) as llm:
        params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
        first = llm.generate([[5, 6, 7], [8, 9]], params)
        again = llm.generate([[5, 6, 7], [8, 9]], params)
        other = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=12, temperature=1.0, seed=8, ignore_eos=True))
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    assert first[0].token_ids != other[0].token_ids


def test_stop_strings_and_max_tokens_are_exact(chat_model):
    with LLM(chat_model, dtype=torch.float32, progress=False) as llm:
        free = llm.generate("hello there", SamplingParams(max_tokens=24, ignore_eos=True))[0]
        assert len(free.token_ids) == 24 and free.finish_reason == "length"
        stop = free.text[10:13]
        cut = free.text.find(stop)
        stopped = llm.generate("hello there", SamplingParams(max_tokens=24, stop=[stop], ignore_eos=True))[0]
        assert stopped.text == free.text[:cut]
        assert stopped.finish_reason == "stop"
        assert stopped.token_ids == free.token_ids[:len(stopped.token_ids)]
        exact = llm.generate("hello", SamplingParams(max_tokens=5, ignore_eos=True))[0]
        assert len(exact.token_ids) == 5


def test_eos_stops_generation(chat_model):
    with LLM(chat_model, dtype=torch.float32, progress=False) as llm:
        free = llm.generate([40, 41, 42], SamplingParams(max_tokens=16, ignore_eos=True))[0]
        target = free.token_ids[3]
        stopped = llm.generate([40, 41, 42], SamplingParams(max_tokens=16, stop_token_ids=[target]))[0]
        assert stopped.token_ids == free.token_ids[:free.token_ids.index(target) + 1]
        assert stopped.finish_reason == "stop"


def test_chat_applies_the_template(chat_model):
    with LLM(chat_model, dtype=torch.float32, progress=False) as llm:
        messages = [{"role": "user", "content": "hi"}]
        via_chat = llm.chat(messages, SamplingParams(max_tokens=4, ignore_eos=True))[0]
        prompt = llm.tokenizer.encode("<s>user: hi</s><s>assistant: ", add_special_tokens=False)
        assert via_chat.prompt_token_ids == prompt
        assert via_chat.token_ids == llm.generate(prompt, SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids


def test_token_id_prompts_work_without_a_tokenizer(tiny_dir):
    with LLM(tiny_dir("olmoe"), dtype=torch.float32, progress=False) as llm:
        assert llm.tokenizer is None
        out = llm.generate([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))[0]
        assert len(out.token_ids) == 3 and out.text is None
        assert llm.placement.shape == (2, 8) and not llm.placement.any()
        with pytest.raises(TiermoeError, match="no tokenizer"):
            llm.generate("text", SamplingParams(max_tokens=3))
        with pytest.raises(TiermoeError, match="context"):
            llm.generate([5] * 300, SamplingParams(max_tokens=3))


def test_sampler_limits():
    logits = torch.tensor([0.1, 3.0, 0.2, 2.9])
    gen = new_generator(0)
    assert sample(logits, SamplingParams(temperature=0), gen) == 1
    assert all(sample(logits, SamplingParams(temperature=5.0, top_k=1), gen) == 1 for _ in range(20))
    assert all(sample(logits, SamplingParams(temperature=5.0, top_p=0.01), gen) == 1 for _ in range(20))
    drawn = {sample(logits, SamplingParams(temperature=1.0, top_k=2), gen) for _ in range(200)}
    assert drawn == {1, 3}


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(stop=[""]), "stop"),
])
def test_bad_sampling_params_are_refused(kwargs, message):
    with pytest.raises(TiermoeError, match=message):
        SamplingParams(**kwargs)


def test_a_long_prompt_is_prefilled_in_chunks_without_stalling_decodes(tiny_dir):
    with LLM(tiny_dir("qwen3_moe"), dtype=torch.float32, prefill_chunk=8, progress=False) as llm:
        engine = llm.engine
        decoding = [engine.add([5, 6, 7], SamplingParams(max_tokens=40, ignore_eos=True)) for _ in range(3)]
        while any(s.prefilling for s in decoding):
            engine.step()
        long_prompt = engine.add(list(range(3, 100)), SamplingParams(max_tokens=2, ignore_eos=True))
        steps = 0
        while long_prompt.prefilling:
            before = [len(s.output_ids) for s in decoding]
            fed_before = long_prompt.num_fed
            engine.step()
            steps += 1
            assert [len(s.output_ids) for s in decoding] == [b + 1 for b in before]  # every decode advanced
            assert long_prompt.num_fed - fed_before <= 8  # at most one chunk of prefill per step
        assert steps == -(-97 // 8)


@pytest.mark.exactness
@pytest.mark.parametrize("arch", ["olmoe", "qwen3_next"])
def test_a_full_pool_preempts_and_seeded_runs_give_the_unconstrained_tokens(arch, tiny_dir):
    prompts = [[5] * 7, [6, 7, 8], [9] * 5]
    sampled = [SamplingParams(max_tokens=8, temperature=0.9, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    with LLM(tiny_dir(arch), dtype=torch.float32, progress=False) as llm:
        free = [llm.engine.add(p, s) for p, s in zip(prompts, sampled)]
        llm.engine.run_to_completion()
    # 4 pages of 4 tokens: the three sequences (15 and 11 and 13 tokens at the end) cannot all hold their pages;
    # again with the attention CUDA takes (Triton, in place; run by its interpreter here): recomputes read in place
    for backend in ("auto", "triton"):
        with LLM(tiny_dir(arch), dtype=torch.float32, max_total_tokens=16, page_size=4, progress=False,
                 attention_backend=backend) as llm:
            engine = llm.engine
            tight = [engine.add(p, s) for p, s in zip(prompts, sampled)]
            engine.run_to_completion()
            assert engine.pool.used_pages()[None] == 0  # every page back
            with pytest.raises(TiermoeError, match="max_total_tokens"):
                engine.add([7] * 10, SamplingParams(max_tokens=10))
        assert sum(s.preemptions for s in tight) >= 1
        assert [s.output_ids for s in tight] == [s.output_ids for s in free], backend
