"""MTP drafting (`nextn`) on tiny DeepSeek-V3 and GLM-4.5 models with an MTP layer: greedy tokens equal plain
decode (fixed and adaptive lengths, batched and alone, across preemptions); the layer's drafts equal transformers'
MtpModel run over the whole sequence at every step, across rejected drafts and preemptions (its K/V kept as the
target's); an FP8 checkpoint's MTP layer loads; an MTP layer that predicts
the model has every draft accepted, one that is always wrong drafts nothing once the adaptive length learns it;
a checkpoint without MTP weights is refused in one line."""

from __future__ import annotations

import pytest
import torch
from conftest import save_tiny

from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import SamplingParams
from tiermoe.engine.speculative_config import SpeculativeConfig
from tiermoe.engine.speculative_drafting import step_cost_of
from tiermoe.engine.speculative_mtp import MTPDrafter
from tiermoe.errors import TiermoeError
from tiermoe.testing.fp8_write import write_fp8_checkpoint
from tiermoe.testing.mtp_checkpoint import (
    add_exact_mtp_layer,
    add_mtp_layer,
    exact_mtp_config,
)

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [20, 21, 20, 21, 20], [30, 31, 32, 33, 34, 30, 31], [40, 41, 40]]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def mtp_dirs(tmp_path_factory):
    """mtp_dirs(arch) -> a tiny checkpoint of `arch` with a random MTP layer whose head is the model's LM head
    (stored without one)."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            cache[arch] = add_mtp_layer(save_tiny(arch, tmp_path_factory.mktemp(f"mtp_{arch}")), head=False)
        return cache[arch]

    return get


def nextn(k: int, adaptive: bool) -> SpeculativeConfig:
    return SpeculativeConfig(algorithm="nextn", num_draft_tokens=k, adaptive=adaptive)


def tokens(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [r.token_ids for r in llm.generate(prompts, params)]


def use_drafter(llm: LLM, module, config: SpeculativeConfig | None) -> MTPDrafter | None:
    """The engine's drafter replaced by a fresh one of `config` on the MTP layer `module` (None: plain decode)."""
    engine = llm.engine
    if engine.drafter is not None:
        engine.drafter.close()
    engine.drafter = None
    if config is not None:
        engine.drafter = MTPDrafter(config, step_cost_of(llm.hybrid), engine.max_context, llm.hybrid, module)
        engine.drafter.attach(engine.pool)
    return engine.drafter


def test_greedy_tokens_with_mtp_drafts_equal_plain_decode_batched_and_alone(mtp_dirs):
    with LLM(mtp_dirs("deepseek_v3"), dtype=torch.float32, max_running=3, prefill_chunk=6, progress=False,
             speculative=nextn(4, True)) as llm:
        module = llm.engine.drafter.module
        use_drafter(llm, module, None)
        plain = tokens(llm, PROMPTS)
        # batched with k = 1 and adaptive, alone with k = 2 (k = 3 fixed: the reference test below)
        for k, adaptive in [(1, False), (2, False), (3, True)]:
            drafter = use_drafter(llm, module, nextn(k, adaptive))
            if k == 2:
                assert [tokens(llm, p)[0] for p in PROMPTS[:2]] == plain[:2]
            else:
                assert tokens(llm, PROMPTS) == plain, (k, adaptive)
            assert drafter.drafted_tokens > 0
        assert llm.engine.pool.used_pages()[None] == 0  # every page back, the rounds' ones included


def reference_mtp(path):
    """transformers' reference: the model and its MtpModel (DeepseekV3 names only layer 61 as MTP weights; the tiny
    checkpoint's is layer 3)."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{model.config.num_hidden_layers}\..*"]
    return model, MtpModel.from_pretrained(model, device_map={"": "cpu"}).eval()


def reference_draft_logits(model, mtp, ids: list[int]) -> torch.Tensor:
    """[V]: the MTP layer's logits for the token after the one after `ids`, run over the whole sequence (the
    target's hidden states at 0..L-2, the tokens at 1..L-1): a sequence's first draft when its last token is
    the one it feeds next."""
    from transformers.cache_utils import MtpCache

    ids_1L = torch.tensor([ids])
    with torch.no_grad():
        hidden = model.model(ids_1L).last_hidden_state
        _, logits, _ = mtp(input_ids=ids_1L[:, 1:], last_hidden_states=hidden[:, :-1], attention_mask=None,
                           position_ids=torch.arange(1, len(ids))[None],
                           mtp_cache=MtpCache(config=model.config.get_mtp_config()))
    return logits[0, -1]


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_mtp_drafts_equal_the_reference_layer_over_the_whole_sequence_across_rejections_and_preemptions(arch,
                                                                                                       mtp_dirs):
    path = mtp_dirs(arch)
    model, mtp = reference_mtp(path)
    prompts = [[5, 6, 5, 6, 5, 6, 5], [6, 7, 8], [9, 10, 9, 10, 9]]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    with LLM(path, dtype=torch.float32, progress=False) as llm:
        plain = tokens(llm, prompts, params)
    # 5 pages of 4 tokens: the three sequences cannot all stay (as in the n-gram preemption test)
    with LLM(path, dtype=torch.float32, max_total_tokens=20, page_size=4, progress=False,
             speculative=nextn(3, False)) as llm:
        engine, drafter = llm.engine, llm.engine.drafter
        seqs = [engine.add(p, params) for p in prompts]
        checked = 0
        while engine.has_work():
            engine.step()
            for seq in engine.running:
                start = drafter.starts.get(seq.seq_id)
                if start is not None and start.fed == seq.num_fed:
                    expected = reference_draft_logits(model, mtp, seq.known_ids)
                    got = drafter.module.logits(start.hidden_D[None])[0]
                    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)
                    assert start.token == int(expected.argmax())
                    checked += 1
        assert sum(s.preemptions for s in seqs) >= 1 and checked >= 12
        assert drafter.drafted_tokens > drafter.accepted_tokens  # rejected drafts happened before the checks
    assert [s.output_ids for s in seqs] == plain


@pytest.fixture(scope="module")
def exact_dirs(tmp_path_factory):
    """shift -> a one-layer model whose MTP layer drafts its next token (0) or the token after it (1: never)."""
    return {shift: add_exact_mtp_layer(save_tiny("deepseek_v3", tmp_path_factory.mktemp(f"exact{shift}"),
                                                 sizes=exact_mtp_config()), shift) for shift in (0, 1)}


def test_an_mtp_layer_that_predicts_the_model_has_every_draft_accepted(exact_dirs):
    with LLM(exact_dirs[0], dtype=torch.float32, max_running=3, prefill_chunk=6, progress=False,
             speculative=nextn(3, False)) as llm:
        module = llm.engine.drafter.module
        use_drafter(llm, module, None)
        plain = tokens(llm, PROMPTS)
        for k, adaptive in [(3, False), (3, True)]:
            drafter = use_drafter(llm, module, nextn(k, adaptive))
            assert tokens(llm, PROMPTS) == plain
            assert drafter.drafted_tokens == drafter.accepted_tokens > len(PROMPTS) * 4, (k, adaptive)


def test_an_fp8_checkpoints_mtp_layer_loads_dequantised_and_drafts(exact_dirs, tmp_path):
    fp8_dir = write_fp8_checkpoint(exact_dirs[0], tmp_path / "fp8", block=(16, 16))  # eh_proj and the head too
    with LLM(fp8_dir, dtype=torch.float32, progress=False, speculative=nextn(3, False)) as llm:
        module = llm.engine.drafter.module
        assert module.eh_proj.weight.dtype == torch.float32
        use_drafter(llm, module, None)
        plain = tokens(llm, PROMPTS[:2])
        drafter = use_drafter(llm, module, nextn(3, False))
        assert tokens(llm, PROMPTS[:2]) == plain
        # the model computes FP8 linears as stored, the MTP layer their dequantised weights: nearly every draft taken
        assert drafter.accepted_tokens > 0.7 * drafter.drafted_tokens > 0


def modelled_seconds(shape) -> float:
    """A step's seconds on a made-up machine (tests count work, never time it): a drafted row costs 0.3 of a plain
    step, so a draft pays only where most of it is taken."""
    return 1.0 + 0.1 * shape.sequences + 0.3 * shape.verifying + 0.3 * shape.drafted


def drafts_per_step(path, max_tokens: int) -> tuple[list[int], int]:
    """Tokens drafted in each step of one greedy sequence with adaptive nextn drafts of up to 3, the measured cost
    fed modelled_seconds; and the drafted tokens that were not accepted."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    with LLM(path, dtype=torch.float32, progress=False) as llm:
        plain = tokens(llm, PROMPTS[:1], params)
    with LLM(path, dtype=torch.float32, progress=False, speculative=nextn(3, True)) as llm:
        engine, drafter = llm.engine, llm.engine.drafter
        drafter.observe = lambda shape, seconds: drafter.cost.observe(shape, modelled_seconds(shape))
        seq = engine.add(PROMPTS[0], params)
        drafted = []
        while engine.has_work():
            before = drafter.drafted_tokens
            engine.step()
            drafted.append(drafter.drafted_tokens - before)
        assert seq.output_ids == plain[0]
    return drafted, drafter.drafted_tokens - drafter.accepted_tokens


def test_an_mtp_layer_that_is_always_wrong_makes_the_adaptive_length_fall_to_zero(exact_dirs):
    (right, right_rejected), (wrong, _) = drafts_per_step(exact_dirs[0], 40), drafts_per_step(exact_dirs[1], 40)
    assert all(right[1:]) and right_rejected == 0  # the same costs: drafts taken pay on every step (not the prefill)
    # drafted at first, then only a step trying again after EXPLORE_AFTER steps without a draft
    assert sum(wrong) > 0 and sum(map(bool, wrong[len(wrong) // 2:])) <= 1 and 4 * sum(wrong) < sum(right)


def test_nextn_is_refused_in_one_line_without_mtp_weights_or_for_another_family(tiny_dir):
    for arch, message in [("deepseek_v3", "has no 'model.layers.3.eh_proj.weight'"), ("qwen3_moe", "qwen3_moe model")]:
        with pytest.raises(TiermoeError, match=message) as err:
            LLM(tiny_dir(arch), dtype=torch.float32, progress=False, speculative=nextn(2, True))
        assert "\n" not in str(err.value)
