"""One sequence's failure inside Engine.step ends that sequence with an error; the others run on, exactly.

The failing step is found again by re-running subsets of its sequences (a step writes only K/V its sequences have not
fed yet, so nothing needs rolling back), so this holds when a step is one model forward for all sequences
(asserted below).
"""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from tiermoe.engine import engine as engine_module
from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import SamplingParams, new_generator, sample
from tiermoe.engine.sequence import Sequence
from tiermoe.errors import TiermoeError

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21], [30, 31, 32, 33, 34], [40, 41, 42]]
VICTIM = 1  # index of the prompt whose sequence is made to fail
MARK = 4242  # the victim's seed: how the injected faults recognise it
POISON = 250  # a token id whose embedding lookup is made to fail


def greedy(seed=None) -> SamplingParams:
    return SamplingParams(max_tokens=8, ignore_eos=True, seed=seed)


@pytest.fixture(scope="module")
def llm(tiny_dir):
    with LLM(tiny_dir("qwen3_moe"), dtype=torch.float32, prefill_chunk=4, progress=False) as llm:
        yield llm


@pytest.fixture(scope="module")
def solo(llm):
    """Each prompt's greedy tokens, generated alone."""
    return [llm.generate(p, greedy())[0].token_ids for p in PROMPTS]


def poison(llm):
    """Make every forward whose input holds POISON raise in its last decoder layer (as an id outside the
    vocabulary would), after the earlier layers have appended the step's keys and values to the caches. Returns
    (the number of tokens of each forward that raised, the hooks' handles)."""
    failed_rows, local = [], threading.local()

    def look(module, args):
        local.rows = args[0].shape[-1] if bool((args[0] == POISON).any()) else 0

    def fail(module, args, kwargs):
        if getattr(local, "rows", 0):
            failed_rows.append(local.rows)
            raise ValueError("poisoned token")

    model = llm.hybrid.model
    return failed_rows, [model.get_input_embeddings().register_forward_pre_hook(look),
                         model.model.layers[-1].register_forward_pre_hook(fail, with_kwargs=True)]


def run(llm, victim_params: SamplingParams, prompts=PROMPTS):
    seqs = [llm.engine.add(p, victim_params if i == VICTIM else greedy()) for i, p in enumerate(prompts)]
    llm.engine.run_to_completion()
    assert not llm.engine.has_work()
    return seqs


def assert_others_are_exact(seqs, solo):
    for i, seq in enumerate(seqs):
        if i != VICTIM:
            assert (seq.finish_reason, seq.error, seq.output_ids) == ("length", None, solo[i])


def test_a_sequence_whose_sampling_fails_ends_with_an_error_and_the_others_run_on(llm, solo, monkeypatch):
    def failing_sample(logits_V, params, gen):
        if params.seed == MARK:
            failing_sample.count += 1
            if failing_sample.count == 3:
                raise RuntimeError("sampler broke")
        return sample(logits_V, params, gen)

    failing_sample.count = 0
    monkeypatch.setattr(engine_module, "sample", failing_sample)
    seqs = run(llm, greedy(seed=MARK))
    victim = seqs[VICTIM]
    assert victim.finish_reason == "error" and victim.error == "RuntimeError: sampler broke"
    assert victim.output_ids == solo[VICTIM][:2] and not any(victim.pages.tables.values())
    assert_others_are_exact(seqs, solo)


def run_with_a_poisoned_decode(llm, monkeypatch):
    """The victim's third token is POISON: the decode step that feeds it fails, and it is one forward for all
    four. Returns (the sequences, the rows of each forward that raised)."""
    def poisoning_sample(logits_V, params, gen):
        token = sample(logits_V, params, gen)
        if params.seed == MARK:
            poisoning_sample.count += 1
            return POISON if poisoning_sample.count == 3 else token
        return token

    poisoning_sample.count = 0
    monkeypatch.setattr(engine_module, "sample", poisoning_sample)
    failed_rows, handles = poison(llm)
    try:
        return run(llm, greedy(seed=MARK)), failed_rows
    finally:
        for h in handles:
            h.remove()


def test_a_decode_forward_that_fails_for_all_is_bisected_to_the_failing_sequence(llm, solo, monkeypatch):
    seqs, failed_rows = run_with_a_poisoned_decode(llm, monkeypatch)
    # one forward for all four (the prefill budget is shared, so the longest prompt's last chunk rides along with the
    # three decode rows); then the victim is found alone
    assert failed_rows[0] == len(PROMPTS) + 2 and failed_rows[-1] == 1
    victim = seqs[VICTIM]
    assert victim.finish_reason == "error" and victim.error == "ValueError: poisoned token"
    assert victim.output_ids == solo[VICTIM][:2] + [POISON] and not any(victim.pages.tables.values())
    assert_others_are_exact(seqs, solo)  # their re-runs wrote the step's K/V again, exactly


def test_a_prefill_chunk_that_fails_ends_only_its_sequence(llm, solo):
    failed_rows, handles = poison(llm)
    prompts = list(PROMPTS)
    prompts[VICTIM] = [20, 21, 22, 23, 24, POISON]  # its second prefill chunk fails, beside the others' chunks
    try:
        seqs = run(llm, greedy(), prompts)
    finally:
        for h in handles:
            h.remove()
    assert failed_rows  # the fault fired
    assert (seqs[VICTIM].finish_reason, seqs[VICTIM].output_ids) == ("error", [])
    assert_others_are_exact(seqs, solo)


def test_an_id_outside_the_vocabulary_that_reaches_a_step_ends_only_its_sequence(llm, solo):
    # Engine.add refuses it (below); a sequence queued past that check still fails alone, with the real error
    seqs = [llm.engine.add(p, greedy()) for p in PROMPTS]
    bad = Sequence(10_000, [7, 300, 8], greedy(), new_generator(None), pages=llm.engine.pool.new_share())
    llm.engine.waiting.insert(1, bad)
    llm.engine.run_to_completion()
    assert bad.finish_reason == "error" and bad.error.startswith("IndexError") and not any(bad.pages.tables.values())
    assert [s.output_ids for s in seqs] == solo and all(s.finish_reason == "length" for s in seqs)


@pytest.mark.parametrize("prompt, fragment", [
    ([7, 256, 8], "prompt: token id 256 at position 1 is outside the model's vocabulary (0 to 255)"),
    ([-1], "prompt: token id -1 at position 0 is outside the model's vocabulary (0 to 255)"),
    ([10 ** 5000], "prompt: token id beyond 64 bits at position 0 is outside"),
], ids=["above", "negative", "huge"])
def test_prompt_ids_outside_the_vocabulary_are_refused_when_added(llm, prompt, fragment):
    with pytest.raises(TiermoeError, match="^" + fragment.replace("(", r"\(").replace(")", r"\)")):
        llm.engine.add(prompt, greedy())
    assert not llm.engine.has_work()


@pytest.mark.parametrize("temperature", [1e-6, 1e-30, 1e-40, 5e-324])
def test_a_temperature_too_small_to_divide_by_is_greedy(llm, solo, temperature):
    tiny = SamplingParams(max_tokens=8, ignore_eos=True, temperature=temperature, seed=3)
    assert tiny.greedy
    seqs = run(llm, tiny)
    assert seqs[VICTIM].finish_reason == "length" and seqs[VICTIM].output_ids == solo[VICTIM]
    assert_others_are_exact(seqs, solo)


@pytest.mark.parametrize("top_p", [1e-50, 5e-324])
def test_a_top_p_smaller_than_any_probability_keeps_the_most_likely_token(llm, solo, top_p):
    seqs = run(llm, SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, top_p=top_p, seed=3))
    assert seqs[VICTIM].finish_reason == "length" and seqs[VICTIM].output_ids == solo[VICTIM]
    assert_others_are_exact(seqs, solo)


@pytest.mark.parametrize("field, value", [("temperature", float("inf")), ("temperature", float("nan")),
                                          ("top_p", float("nan"))])
def test_sampling_values_that_are_not_finite_are_refused_naming_the_field(field, value):
    with pytest.raises(TiermoeError, match=f"^{field} must be"):
        SamplingParams(**{field: value})


def test_the_sampler_always_keeps_the_most_likely_token():
    logits = torch.tensor([0.0, 3.0, 1.0])
    for top_p in (1e-300, 5e-324):
        assert sample(logits, SamplingParams(temperature=1.0, top_p=top_p), new_generator(0)) == 1


def test_the_python_api_reports_the_error_of_a_failed_sequence(llm, solo, monkeypatch):
    def failing_sample(logits_V, params, gen):
        if params.seed == MARK:
            raise RuntimeError("sampler broke")
        return sample(logits_V, params, gen)

    monkeypatch.setattr(engine_module, "sample", failing_sample)
    results = llm.generate(PROMPTS[:2], greedy(seed=MARK))
    assert [(r.finish_reason, r.error) for r in results] == [("error", "RuntimeError: sampler broke")] * 2


class RowsPerLayer:
    """Counts the rows each MoE layer records, and the passes that end."""

    enabled = True

    def __init__(self):
        self.rows, self.passes = {}, 0

    def begin_pass(self, info):
        pass

    def record(self, layer, ids_TK, gpu_mask_E):
        self.rows[layer] = self.rows.get(layer, 0) + ids_TK.shape[0]

    def end_pass(self):
        self.passes += 1


def test_a_failed_forward_and_its_failed_reruns_are_not_recorded(llm, solo, monkeypatch):
    counter = RowsPerLayer()
    llm.engine.set_recorder(counter)
    try:
        seqs, failed_rows = run_with_a_poisoned_decode(llm, monkeypatch)
    finally:
        llm.engine.set_recorder(engine_module.NO_RECORDER)
    assert len(failed_rows) >= 2  # the step failed, and so did a re-run part
    fed = sum(s.num_fed for s in seqs)  # the tokens that went through a forward that succeeded
    assert counter.rows == {layer: fed for layer in llm.hybrid.spec.moe_layers}
    assert_others_are_exact(seqs, solo)


def test_a_step_leaves_no_reference_cycle_holding_its_logits_or_sequences(llm):
    """Every step's logits and sequences are freed when the step is done, not when a garbage collection finds them
    in a cycle (the bisecting forward was a recursive closure: a cycle per step that held both)."""
    engine = llm.engine
    seqs = [engine.add(p, greedy()) for p in PROMPTS]
    engine.step()
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):
            engine.step()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        held = [o for o in gc.garbage if isinstance(o, (torch.Tensor, Sequence))]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    engine.run_to_completion()
    assert all(s.finished for s in seqs)
    assert not held, f"{len(held)} tensors or sequences freed only by the garbage collector"
