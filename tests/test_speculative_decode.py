"""Speculative decoding in the engine: drafts verified in one forward give exactly the plain tokens (greedy), for
every architecture kind the engine pages (GQA, MLA, sliding windows with sinks, Mixtral's block, Qwen3-Next's
linear attention), batched and alone, with fixed and adaptive draft lengths, across preemptions; rejected
positions' K/V and linear-attention states are never read; stop conditions hold mid-draft."""

from __future__ import annotations

import pytest
import torch
from conftest import save_char_tokenizer, save_tiny

from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import SamplingParams
from tiermoe.engine.sequence import Sequence
from tiermoe.engine.speculative_config import SpeculativeConfig
from tiermoe.engine.speculative_drafting import Drafter, step_cost_of
from tiermoe.testing.forced_drafts import ForcedAcceptanceDrafter

# repetitive prompts, so n-gram lookup finds drafts from the first decode step on (a random model's greedy output
# then drifts away from them: both accepted and rejected drafts happen)
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [20, 21, 20, 21, 20], [30, 31, 32, 33, 34, 30, 31], [40, 41, 40]]
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)


def drafter_of(llm: LLM, k: int, adaptive: bool) -> Drafter:
    return Drafter(SpeculativeConfig(num_draft_tokens=k, adaptive=adaptive), step_cost_of(llm.hybrid),
                   llm.engine.max_context)


def tokens(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [r.token_ids for r in llm.generate(prompts, params)]


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "gpt_oss", "mixtral"])
def test_greedy_tokens_with_speculation_equal_plain_decode_batched_and_alone(arch, tiny_dir):
    # max_running 3: the 4th prompt waits and joins later; chunks of 6 split the longer prompts
    with LLM(tiny_dir(arch), dtype=torch.float32, max_running=3, prefill_chunk=6, progress=False,
             speculative=SpeculativeConfig()) as llm:
        engine = llm.engine
        speculating, engine.drafter = engine.drafter, None
        plain = tokens(llm, PROMPTS)
        for k, adaptive in [(1, False), (2, False), (3, False), (4, False), (4, True)]:
            engine.drafter = drafter = drafter_of(llm, k, adaptive)
            assert tokens(llm, PROMPTS) == plain, (k, adaptive)
            assert [tokens(llm, p)[0] for p in PROMPTS] == plain, (k, adaptive)
            assert 0 < drafter.accepted_tokens < drafter.drafted_tokens, (k, adaptive)  # both outcomes ran
        assert speculating.cost.model.expert_share > 0  # the engine builds a measured cost on the bytes model
        assert engine.pool.used_pages()[None] == 0  # every page back, rejected positions' pages included


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_greedy_speculation_across_preemptions_gives_the_plain_tokens(arch, tiny_dir):
    prompts = [[5, 6, 5, 6, 5, 6, 5], [6, 7, 8], [9, 10, 9, 10, 9]]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    with LLM(tiny_dir(arch), dtype=torch.float32, progress=False) as llm:
        plain = tokens(llm, prompts, params)
    # 5 pages of 4 tokens: the three sequences (17, 13 and 15 tokens at the end, and drafts beyond) cannot all stay
    with LLM(tiny_dir(arch), dtype=torch.float32, max_total_tokens=20, page_size=4, progress=False,
             speculative=SpeculativeConfig(num_draft_tokens=4, adaptive=False)) as llm:
        engine = llm.engine
        seqs = [engine.add(p, params) for p in prompts]
        engine.run_to_completion()
        assert engine.pool.used_pages()[None] == 0
        assert sum(s.preemptions for s in seqs) >= 1 and engine.drafter.drafted_tokens > 0
    assert [s.output_ids for s in seqs] == plain


def poison_unfed_slots(engine, value: float = 1e4, positions=None) -> None:
    """Write `value` into every K/V slot a running sequence holds a page for but has not fed (positions >=
    num_fed: where rejected drafts were written), in every layer; or at `positions` (seq, position) only."""
    pool = engine.pool
    size = pool.page_size
    with torch.inference_mode():
        for layer, (k_slots, v_slots) in pool.pages._slots.items():
            window = pool.pages._windows[layer]
            for seq in engine.running:
                table = seq.pages.tables[window]
                wanted = range(seq.num_fed, len(table) * size) if positions is None else \
                    [p for s, p in positions if s is seq]
                for position in wanted:
                    page = table[position // size]
                    if page >= 0:
                        k_slots[page * size + position % size] = value
                        v_slots[page * size + position % size] = value


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_rejected_positions_kv_is_never_read(arch, tiny_dir):
    with LLM(tiny_dir(arch), dtype=torch.float32, page_size=4, progress=False,
             speculative=SpeculativeConfig(num_draft_tokens=4, adaptive=False)) as llm:
        engine = llm.engine
        drafter, engine.drafter = engine.drafter, None
        plain = tokens(llm, PROMPTS[:3])
        engine.drafter = drafter

        def poisoned_run(poison) -> list[list[int]]:
            seqs = [engine.add(p, GREEDY) for p in PROMPTS[:3]]
            while engine.has_work():
                engine.step()
                # a rejected draft's pages go back at once: no sequence holds pages beyond its next token's
                assert all(len(s.pages.tables[None]) <= -(-(s.num_fed + 1) // 4) for s in engine.running)
                poison()
            return [s.output_ids for s in seqs]

        assert poisoned_run(lambda: poison_unfed_slots(engine)) == plain
        assert 0 < drafter.accepted_tokens < drafter.drafted_tokens
        # the check can fail: the same poison on a position a sequence did feed changes its tokens
        hit = []

        def poison_a_fed_position():
            if not hit and engine.running and engine.running[0].num_fed > 8:
                hit.append(engine.running[0])
                poison_unfed_slots(engine, positions=[(hit[0], 2)])

        assert poisoned_run(poison_a_fed_position) != plain


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    path = save_tiny("qwen3_moe", tmp_path_factory.mktemp("spec_chat"))
    save_char_tokenizer(path)
    return path


def test_stops_max_tokens_penalties_and_logprobs_hold_mid_draft(chat_model):
    prompt = "abcabcabcabc xyzxyz abcabc"
    with LLM(chat_model, dtype=torch.float32, progress=False,
             speculative=SpeculativeConfig(num_draft_tokens=4, adaptive=False)) as llm:
        engine = llm.engine
        drafter, engine.drafter = engine.drafter, None
        base = llm.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True))[0]
        text, ids = base.text, base.token_ids
        cases = [
            SamplingParams(max_tokens=24, ignore_eos=True),
            SamplingParams(max_tokens=7, ignore_eos=True),
            SamplingParams(max_tokens=24, stop_token_ids=(ids[9],)),
            SamplingParams(max_tokens=24, stop_token_ids=(ids[9],), min_tokens=12),
            SamplingParams(max_tokens=24, stop=(text[11:13],)),
            SamplingParams(max_tokens=24, ignore_eos=True, frequency_penalty=0.5, repetition_penalty=1.3),
            SamplingParams(max_tokens=24, ignore_eos=True, logprobs=2),
        ]
        plain = [llm.generate(prompt, params)[0] for params in cases]
        engine.drafter = drafter
        spec = [llm.generate(prompt, params)[0] for params in cases]
        assert drafter.drafted_tokens > 0 and drafter.accepted_tokens > 0
    for params, a, b in zip(cases, plain, spec, strict=True):
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason), params
        if params.logprobs is not None:
            assert len(b.logprobs) == len(a.logprobs)
            for x, y in zip(a.logprobs, b.logprobs, strict=True):
                assert x.logprob == pytest.approx(y.logprob, abs=1e-4)


def test_seeded_sampling_with_speculation_is_reproducible_and_ends_right(tiny_dir):
    params = [SamplingParams(max_tokens=12, temperature=0.8, seed=s, ignore_eos=True) for s in (1, 2)]
    with LLM(tiny_dir("qwen3_moe"), dtype=torch.float32, progress=False,
             speculative=SpeculativeConfig(num_draft_tokens=4, adaptive=False)) as llm:
        runs = [[r.token_ids for r in llm.generate(PROMPTS[:2], p)] for p in params for _ in range(2)]
    assert runs[0] == runs[1] and runs[2] == runs[3] and runs[0] != runs[2]
    assert all(len(ids) == 12 for run in runs for ids in run)


def test_a_sequence_with_a_grammar_or_no_room_left_drafts_nothing():
    drafter = Drafter(SpeculativeConfig(num_draft_tokens=4), None, max_context=20)
    seq = Sequence(0, [1, 2, 1, 2, 1], SamplingParams(max_tokens=8), torch.Generator(), output_ids=[2])
    seq.num_fed = seq.num_tokens - 1
    assert drafter.room(seq) == 4
    seq.grammar = object()  # any grammar state: its masks would need every drafted prefix's
    assert drafter.room(seq) == 0
    seq.grammar = None
    seq.output_ids += [1] * 5  # 6 of 8 tokens out: one more may be drafted, the verify step samples the last
    seq.num_fed = seq.num_tokens - 1
    assert drafter.room(seq) == 1
    long = Sequence(1, [1, 2] * 9, SamplingParams(max_tokens=100), torch.Generator(), output_ids=[1])
    long.num_fed = long.num_tokens - 1
    assert drafter.room(long) == 1  # the model's context (20) leaves positions for one draft


# Linear attention (Qwen3-Next: three gated-DeltaNet layers, then full attention). A random tiny model's greedy
# replies rarely repeat, so n-gram lookup seldom drafts: these drafts come from the plain run's tokens, each right
# with probability 0.6, so that rejected drafts (and rolled-back states) happen in most verify steps.
LINEAR_GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


def forced_drafter(llm: LLM, plain: dict, k: int, adaptive: bool, acceptance: float = 0.6) -> Drafter:
    return ForcedAcceptanceDrafter(SpeculativeConfig(num_draft_tokens=k, adaptive=adaptive), step_cost_of(llm.hybrid),
                                   llm.engine.max_context, plain, acceptance, llm.engine.vocab_size, seed=k)


@pytest.fixture(scope="module")
def linear_llm(tiny_dir):
    """The tiny Qwen3-Next, fp32, 3 sequences at once, chunks of 6; and its plain greedy tokens of PROMPTS."""
    with LLM(tiny_dir("qwen3_next"), dtype=torch.float32, max_running=3, prefill_chunk=6, progress=False,
             speculative=SpeculativeConfig()) as llm:
        llm.engine.drafter = None
        yield llm, {tuple(p): ids for p, ids in zip(PROMPTS, tokens(llm, PROMPTS, LINEAR_GREEDY), strict=True)}


def test_greedy_speculation_on_linear_attention_rolls_states_back_to_the_plain_tokens(linear_llm):
    llm, plain = linear_llm
    for k, adaptive in [(1, False), (2, False), (3, False), (4, False), (4, True)]:
        llm.engine.drafter = drafter = forced_drafter(llm, plain, k, adaptive)
        assert tokens(llm, PROMPTS, LINEAR_GREEDY) == list(plain.values()), (k, adaptive)
        assert [tokens(llm, p, LINEAR_GREEDY)[0] for p in PROMPTS] == list(plain.values()), (k, adaptive)
        assert 0 < drafter.accepted_tokens < drafter.drafted_tokens, (k, adaptive)
    assert llm.engine.pool.linear.verified == {}  # a finished sequence's kept states go with its slot
    llm.engine.drafter = None


def poison_rejected_states(engine, kept_one: bool = False) -> int:
    """Overwrite, for each running sequence whose last step verified drafts, every linear-attention state its next
    step must not read: the committed banks' (the state after the whole segment) where it kept fewer positions,
    and the kept per-position states but the last kept one's; or (`kept_one`) that one only. Returns how many
    sequences it poisoned."""
    linear, hit = engine.pool.linear, 0
    with torch.inference_mode():
        for seq in engine.running:
            slot = seq.pages.slot
            verified = linear.verified.get(slot)
            if verified is None:
                continue
            kept, length = seq.num_fed - verified.start, verified.length
            if kept_one and kept == length:
                continue
            bank = 2 * slot + linear.bank[slot]
            for layer in verified.recurrent:
                for i, (conv, recurrent) in enumerate(zip(verified.conv[layer], verified.recurrent[layer])):
                    if (i == kept - 1) == kept_one:
                        conv.fill_(1e4), recurrent.fill_(1e4)
                if kept < length and not kept_one:
                    linear.conv[layer][bank].fill_(1e4), linear.recurrent[layer][bank].fill_(1e4)
            hit += 1
    return hit


def test_rejected_positions_linear_states_are_never_read(linear_llm):
    llm, plain = linear_llm
    engine = llm.engine

    def poisoned_run(kept_one: bool) -> list[list[int]]:
        seqs = [engine.add(p, LINEAR_GREEDY) for p in PROMPTS[:3]]
        hits = 0
        while engine.has_work():
            engine.step()
            hits += poison_rejected_states(engine, kept_one)
        assert hits > 0
        return [s.output_ids for s in seqs]

    engine.drafter = forced_drafter(llm, plain, 3, False)
    assert poisoned_run(kept_one=False) == list(plain.values())[:3]
    # the check can fail: the same poison on the state the next step continues from changes the tokens
    engine.drafter = forced_drafter(llm, plain, 3, False)
    assert poisoned_run(kept_one=True) != list(plain.values())[:3]
    engine.drafter = None


def test_greedy_speculation_on_linear_attention_across_preemptions(tiny_dir, linear_llm):
    _, plain = linear_llm
    prompts = PROMPTS[:3]
    # 5 pages of 4 tokens: the three sequences (and their drafts) cannot all stay
    with LLM(tiny_dir("qwen3_next"), dtype=torch.float32, max_total_tokens=20, page_size=4, progress=False,
             speculative=SpeculativeConfig()) as llm:
        engine = llm.engine
        engine.drafter = forced_drafter(llm, plain, 4, False)
        seqs = [engine.add(p, LINEAR_GREEDY) for p in prompts]
        engine.run_to_completion()
        assert engine.pool.used_pages()[None] == 0
        assert sum(s.preemptions for s in seqs) >= 1 and engine.drafter.drafted_tokens > 0
    assert [s.output_ids for s in seqs] == [plain[tuple(p)] for p in prompts]
