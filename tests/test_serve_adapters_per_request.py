"""LoRA adapters served per request (tiermoe.model.served_adapters): several loaded unmerged at once, each sequence
with its own adapter or none, all in the same steps, routed experts' LoRA on both tiers (a GPU tier on the CPU
device, fp32). Each sequence gives the greedy tokens it gives alone and PEFT's model gives; prompt logits equal
PEFT's; the prefix cache never hands one adapter's pages to another; the server picks the adapter by `lora_path`
and by `model`, answers 400 for one not loaded, loads and unloads them (an unload waits for the requests running
with it); bad serve flags are one line."""

from __future__ import annotations

import argparse
import logging
import threading
import time

import httpx
import pytest
import torch
from conftest import load_reference, make_mask, rel_err, run_cli, save_char_tokenizer, save_tiny
from server_thread import server_thread
from training_reference import (
    lora_config,
    one_torch_thread,  # noqa: F401 (an autouse fixture)
    peft_reference,
)

from tiermoe.arch import detect, load_config
from tiermoe.cli.lora_args import MERGED_NOTE, adapter_reader
from tiermoe.cli.serve_flags import add_serve_flags
from tiermoe.cli.serve_http import build_state
from tiermoe.config import CPUConfig
from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import SamplingParams
from tiermoe.errors import TiermoeError
from tiermoe.layers.fused_decode_layer import FusedDecodeLayer
from tiermoe.training.adapter_merge import merged_lora

pytest.importorskip("peft")

NAMES = ("a", "b", "c")
TOKENS = 6
# 8 sequences over 3 adapters and none; sequences 0 and 4 share a prompt with different adapters (the prefix cache
# must keep their pages apart); prompts of several lengths, so prompt chunks and decode rows share steps
PROMPTS = [[(7 * i + 3 * j) % 200 + 3 for j in range(9 + i)] for i in range(8)]
PROMPTS[4] = list(PROMPTS[0])  # two full pages of 4
WHICH = ["a", "b", "c", None, "b", "a", "c", None]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(model dir with a character tokenizer, {name: adapter dir}, {name: PEFT reference}, base reference)."""
    root = tmp_path_factory.mktemp("served")
    model = save_tiny("qwen3_moe", root / "model")
    save_char_tokenizer(model)
    dirs, refs = {}, {}
    for seed, name in enumerate(NAMES, start=1):
        refs[name] = peft_reference(model, lora_config(), seed=seed).eval()  # attention, routers, experts
        dirs[name] = root / name
        refs[name].save_pretrained(dirs[name])
    return model, dirs, refs, load_reference(model)


def _greedy(model, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        return model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=TOKENS, do_sample=False,
                              pad_token_id=0)[0, len(prompt):].tolist()


def _llm(model, prefill_chunk: int = 16, **kwargs) -> LLM:
    mask = make_mask("random_half", detect(load_config(model)))
    assert mask.any() and not mask.all()  # routed experts on both tiers
    return LLM(model, dtype=torch.float32, placement=mask, progress=False, max_running=8,
               prefill_chunk=prefill_chunk, page_size=4, **kwargs)


def _serving(llm: LLM, dirs) -> LLM:
    adapters = llm.engine.serve_adapters()
    for name in NAMES:
        adapters.load(name, merged_lora(dirs[name], llm.model_dir), str(dirs[name]))
    return llm


def test_eight_sequences_over_three_adapters_give_their_tokens_alone_and_peft_s(served):
    model, dirs, refs, base = served
    params = [SamplingParams(max_tokens=TOKENS, adapter=name) for name in WHICH]
    with _serving(_llm(model), dirs) as llm:
        together = [out.token_ids for out in llm.generate(PROMPTS, params)]
        alone = [llm.generate([prompt], [p])[0].token_ids for prompt, p in zip(PROMPTS, params)]
        assert llm.engine.prefix_hit_tokens > 0  # the same prompt and adapter again: its pages were reused
    expected = [_greedy(refs[name] if name else base, prompt) for prompt, name in zip(PROMPTS, WHICH)]
    assert together == alone == expected
    assert together[0] != together[4]  # one prompt, two adapters: two answers (no page of one reached the other)
    for name in NAMES:  # the same tokens as the adapter merged into the weights (`--lora DIR`)
        with _llm(model, lora=merged_lora(dirs[name], model)) as merged:
            rows = [i for i, which in enumerate(WHICH) if which == name]
            got = merged.generate([PROMPTS[i] for i in rows], SamplingParams(max_tokens=TOKENS))
            assert [out.token_ids for out in got] == [together[i] for i in rows]


def test_prompt_logits_of_a_mixed_step_are_peft_s(served):
    """Every position's logits, the 8 prompts fed in ONE forward: attention, router and expert LoRA per row."""
    model, dirs, refs, base = served
    with _serving(_llm(model, prefill_chunk=128), dirs) as llm:
        logits = _prompt_logits(llm)
    for got, prompt, name in zip(logits, PROMPTS, WHICH):
        with torch.no_grad():
            want = (refs[name] if name else base)(input_ids=torch.tensor([prompt])).logits[0]
        assert rel_err(got, want) <= 1e-5, name


def _prompt_logits(llm: LLM, which=WHICH) -> list[torch.Tensor]:
    engine = llm.engine
    seqs = [engine.new_sequence() for _ in PROMPTS]
    for seq, name in zip(seqs, which):
        seq.adapter = engine.adapters.get(name) if name else None
    logits = engine.feed(seqs, PROMPTS, rows=["all"] * len(seqs))
    for seq in seqs:
        engine.release(seq)
    return logits


@pytest.mark.parametrize("fmt, dtype", [("int8", torch.float32), ("bf16", torch.float32), ("bf16", torch.bfloat16)])
def test_the_native_cpu_tier_adds_each_row_s_lora_in_its_one_layer_call(served, fmt, dtype):
    """The native CPU tier computes adapter rows in one call per layer (csrc/moe_layer.cpp, tm_moe_lora_forward):
    the same logits as expert by expert with the tier's own products (int8 weights with fp32 activations take the
    exact kernels both ways: 1e-5; bf16 weights round the activations to bf16 for the kernels and not for torch, and
    in bf16 the factors are held in bf16 too: within a tenth of what the adapters change), and each sequence's greedy
    tokens batched are its tokens alone."""
    model, dirs, _, _ = served
    cpu = CPUConfig(backend="native", expert_dtype=fmt)
    with _serving(LLM(model, dtype=dtype, cpu=cpu, progress=False, max_running=8, prefill_chunk=128), dirs) as llm:
        tiers = [block.cpu_tier for block in llm.hybrid.blocks.values()]
        if not getattr(tiers[0], "_blocked", False):
            pytest.skip("the native kernels are not built here")
        native = _prompt_logits(llm)
        params = [SamplingParams(max_tokens=TOKENS, adapter=name) for name in WHICH]
        if dtype == torch.float32:
            together = [out.token_ids for out in llm.generate(PROMPTS, params)]
            assert together == [llm.generate([p], [q])[0].token_ids for p, q in zip(PROMPTS, params)]
        for tier in tiers:
            tier.lora_forward = lambda *args: None  # the tier declines: expert by expert instead
        by_expert = _prompt_logits(llm)
        base = _prompt_logits(llm, [None] * len(WHICH))
    for got, want, plain, name in zip(native, by_expert, base, WHICH):
        tol = 1e-5 if fmt == "int8" else 0.1 * rel_err(want, plain)
        assert rel_err(got, want) <= tol, name


def test_a_decode_step_of_adapter_rows_takes_the_whole_layer_native_call(served, monkeypatch):
    """CPU-only bf16 runs decode a layer in one native call (tiermoe.layers.fused_decode_layer; short prompts too):
    with adapter rows it takes each row's updates of q, k, v, o, the router and the experts, giving the per-op
    path's logits (within bf16's roundings, far below what the adapters change)."""
    model, dirs, _, _ = served
    _fused_adapter_rows_match_per_op(model, dirs, monkeypatch)


@pytest.fixture(scope="module")
def served_gpt_oss(tmp_path_factory):
    """(GPT-OSS model dir (experts of a kernel shape, a character tokenizer), {name: adapter dir}): PEFT's
    "all-linear" adapts GPT-OSS's attention (its q, k, v and o have biases, added before the updates)."""
    root = tmp_path_factory.mktemp("served_gpt_oss")
    model = save_tiny("gpt_oss", root / "model", sizes={"intermediate_size": 64})
    save_char_tokenizer(model)
    dirs = {}
    for seed, name in enumerate(NAMES, start=1):
        dirs[name] = root / name
        peft_reference(model, lora_config(), seed=seed).save_pretrained(dirs[name])
    return model, dirs


def test_gpt_oss_adapter_rows_take_the_whole_layer_native_call_too(served_gpt_oss, monkeypatch):
    _fused_adapter_rows_match_per_op(*served_gpt_oss, monkeypatch)


def _fused_adapter_rows_match_per_op(model, dirs, monkeypatch) -> None:
    cpu = CPUConfig(backend="native", expert_dtype="bf16")
    with _serving(LLM(model, dtype=torch.bfloat16, cpu=cpu, progress=False, max_running=8), dirs) as llm:
        layers = [m for m in llm.hybrid.model.modules() if isinstance(m, FusedDecodeLayer)]
        if not layers:
            pytest.skip("the native kernels are not built here")
        taken = []
        monkeypatch.setattr(FusedDecodeLayer, "_lora", lambda self: taken.append(1) or real_lora(self))

        def decode_step(which, per_op: bool) -> list[torch.Tensor]:
            for block in llm.hybrid.blocks.values():  # per_op: the whole-layer call declines the step
                block.cpu_only_shortcut = not per_op
            engine = llm.engine
            seqs = [engine.new_sequence() for _ in PROMPTS]
            for seq, name in zip(seqs, which):
                seq.adapter = engine.adapters.get(name) if name else None
            engine.feed(seqs, [p[:5] for p in PROMPTS])
            logits = engine.feed(seqs, [[9]] * len(seqs))
            for seq in seqs:
                engine.release(seq)
            return logits

        fused = decode_step(WHICH, per_op=False)
        assert len(taken) == 2 * len(layers)  # the prompt rows' step and the decode step: the native call
        per_op = decode_step(WHICH, per_op=True)
        base = decode_step([None] * len(WHICH), per_op=True)
    for got, want, plain, name in zip(fused, per_op, base, WHICH):
        assert rel_err(got, want) <= 2e-2 * (rel_err(want, plain) if name else 1), name


real_lora = FusedDecodeLayer._lora


def test_unknown_adapters_and_names_are_refused_in_one_line(served):
    model, dirs, _, _ = served
    with _serving(_llm(model), dirs) as llm:
        adapters = llm.engine.adapters
        with pytest.raises(TiermoeError, match=r"no LoRA adapter 'zzz' on this server \(loaded: a, b, c\)"):
            llm.generate([[3, 4]], SamplingParams(max_tokens=1, adapter="zzz"))
        for name, says in (("a", "loaded already"), ("latest", "base model"), ("bad name", "not usable")):
            with pytest.raises(TiermoeError, match=says):
                adapters.load(name, merged_lora(dirs["a"], model))
        retired = adapters.retire("c")  # unloaded at once: nothing runs with it
        llm.engine.free_unused_adapters()
        assert retired.freed and adapters.names == {"a", "b"}
        with pytest.raises(TiermoeError, match="loaded: a, b"):
            llm.generate([[3, 4]], SamplingParams(max_tokens=1, adapter="c"))


@pytest.fixture(scope="module")
def server(served, tmp_path_factory):
    model, dirs, _, _ = served
    with server_thread(tmp_path_factory.mktemp("srv"), step_sleep=0.02, model_dir=model) as (url, state):
        _serving(state.llm, dirs)
        state.adapter_reader = adapter_reader(state.llm.model_dir)
        yield url, state


def _generate(url: str, ids: list[list[int]], lora, tokens: int = TOKENS, **sampling) -> list[list[int]]:
    r = httpx.post(f"{url}/generate", json={"input_ids": ids, "lora_path": lora, "sampling_params": {
        "max_new_tokens": tokens, "temperature": 0, **sampling}}, timeout=120)
    assert r.status_code == 200, r.text
    return [item["output_ids"] for item in r.json()]


def test_the_server_picks_each_prompt_s_adapter_by_lora_path_and_by_model(server, served):
    url, state = server
    _, _, refs, base = served
    got = _generate(url, PROMPTS, list(WHICH))
    assert got == [_greedy(refs[name] if name else base, prompt) for prompt, name in zip(PROMPTS, WHICH)]
    for model_name in ("tiny:b", "b"):  # SGLang's "<served name>:NAME", vLLM's "NAME"
        r = httpx.post(f"{url}/v1/completions", json={"model": model_name, "prompt": PROMPTS[1],
                                                      "max_tokens": TOKENS, "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == state.llm.tokenizer.decode(got[1], skip_special_tokens=True)
    listed = httpx.get(f"{url}/v1/models").json()["data"]
    assert [m["id"] for m in listed] == ["tiny", *NAMES] and {m.get("parent") for m in listed[1:]} == {"tiny"}
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny:zzz", "prompt": "x", "max_tokens": 1})
    assert r.status_code == 400 and "model: there is no LoRA adapter 'zzz' on this server (loaded: a, b, c)" in r.text
    r = httpx.post(f"{url}/generate", json={"input_ids": [3, 4], "lora_path": "zzz"})
    assert r.status_code == 400 and "lora_path: there is no LoRA adapter 'zzz'" in r.text


def test_load_and_unload_endpoints(server, served):
    url, _ = server
    dirs = served[1]
    before = _generate(url, [PROMPTS[2]], "c")
    r = httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "c"}, timeout=60)
    assert r.status_code == 200 and r.json()["success"] and set(r.json()["loaded_adapters"]) == {"a", "b"}
    r = httpx.post(f"{url}/generate", json={"input_ids": [3, 4], "lora_path": "c"})
    assert r.status_code == 400 and "loaded: a, b" in r.text
    for body, says in (({"lora_name": "c", "lora_path": str(dirs["c"] / "missing")}, "does not exist"),
                       ({"lora_name": "a", "lora_path": str(dirs["a"])}, "loaded already"),
                       ({"lora_name": "tiny", "lora_path": str(dirs["a"])}, "served model's name"),
                       ({"lora_name": "c"}, "lora_path")):
        r = httpx.post(f"{url}/load_lora_adapter", json=body, timeout=60)
        assert r.status_code == 400 and says in r.text, r.text
    r = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "c", "lora_path": str(dirs["c"])}, timeout=60)
    assert r.status_code == 200 and r.json()["loaded_adapters"]["c"] == str(dirs["c"])
    assert _generate(url, [PROMPTS[2]], "c") == before
    r = httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "zzz"})
    assert r.status_code == 400 and "'zzz'" in r.text


def test_unloading_an_adapter_in_use_waits_for_its_requests(server, served):
    url, state = server
    finished = {}

    def long_request():
        finished["tokens"] = _generate(url, [PROMPTS[1]], "b", tokens=40, ignore_eos=True)[0]
        finished["at"] = time.monotonic()

    runner = threading.Thread(target=long_request)
    runner.start()
    deadline = time.monotonic() + 30
    while not state.llm.engine.running and time.monotonic() < deadline:
        time.sleep(0.01)
    posted_at = time.monotonic()
    r = httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "b"}, timeout=120)
    # read as the unload returns: its request's sequence has left the engine (the client may still be reading the
    # reply, so the client's clock cannot order the two)
    running_when_unloaded = len(state.llm.engine.running)
    runner.join(timeout=120)
    assert r.status_code == 200 and set(r.json()["loaded_adapters"]) == {"a", "c"}
    assert len(finished["tokens"]) == 40  # the request ran to its end with its adapter...
    assert posted_at < finished["at"] and running_when_unloaded == 0  # ...which the unload waited for
    r = httpx.post(f"{url}/generate", json={"input_ids": [3, 4], "lora_path": "b"})
    assert r.status_code == 400  # gone for new requests from the moment the unload came
    r = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "b", "lora_path": str(served[1]["b"])}, timeout=60)
    assert r.status_code == 200, r.text


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    return parser.parse_args(list(argv))


def test_serve_flags_build_per_request_adapters_or_one_merged(served, caplog):
    model, dirs, _, _ = served
    args = _serve_args("--model", str(model), "--lora", f"a={dirs['a']}", "--lora-paths",
                       f"b={dirs['b']}", f'{{"lora_name": "c", "lora_path": "{dirs["c"]}"}}',
                       "--max-loras-per-batch", "4")
    state = build_state(args)
    try:
        assert state.adapters == set(NAMES) and state.adapter_reader is not None
        assert state.llm.engine.adapters.max_loaded == 4
    finally:
        state.llm.close()
    with caplog.at_level(logging.INFO, logger="tiermoe"):
        state = build_state(_serve_args("--model", str(model), "--lora", str(dirs["a"])))
    try:
        assert state.adapters == frozenset() and state.adapter_reader is None and state.llm.engine.adapters is None
        assert [r.getMessage() for r in caplog.records].count(MERGED_NOTE) == 1
    finally:
        state.llm.close()


@pytest.mark.parametrize("flags, says", [
    (("--lora", "bad name=x"), "not usable"),
    (("--lora", "a=x", "--lora", "a=y"), "given twice"),
    (("--lora", "a=x", "--lora-paths", "a=y"), "given twice"),
    (("--lora", "x", "--lora", "b=y"), "goes alone"),
    (("--lora", "a="), "no directory"),
    (("--lora-paths", "{bad json"), "not valid JSON"),
    (("--lora-paths", '{"lora_name": "a"}'), "lora_path"),
    (("--max-loras-per-batch", "0"), "positive integer"),
    (("--max-loras-per-batch", "65"), "at most 64"),
])
def test_bad_adapter_flags_are_one_line(flags, says):
    done = run_cli("serve", "--model", "/nonexistent/model", *flags)
    lines = [line for line in done.stderr.splitlines() if "error" in line]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert len(lines) == 1 and says in lines[0], done.stderr
