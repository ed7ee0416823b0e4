"""A decoder layer's decode step in one native call (tiermoe.layers.fused_decode_layer): bit for bit what the per-op
path computes (the fused norms, attention, packed linears and router, and the CPU tier, each called from Python),
for Qwen3-MoE, Mixtral and GPT-OSS in bf16 (and Qwen3-MoE with int4 non-experts: q and k / v in two products; GPT-OSS
with random biases and sinks and a sliding window the prompts outgrow; Mellum, whose classes have Qwen3-MoE's code),
one sequence and a ragged batch across pages;
a handful of torch ops per layer;
the recorder sees the same routing; and every step or model it does not take runs the per-op path unchanged."""

from __future__ import annotations

import pytest
import torch
from conftest import load_reference, make_mask, rel_err, save_tiny

import tiermoe.model.loader as loader
from tiermoe.arch import detect, load_config
from tiermoe.config import CPUConfig
from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import SamplingParams
from tiermoe.experts.kernels import supported_isa
from tiermoe.layers import fused_decode_layer
from tiermoe.layers.fused_decode_layer import FusedDecodeLayer
from tiermoe.stats.model_shape import ModelShape
from tiermoe.stats.stat_recorder import StatRecorder
from tiermoe.testing.op_counter import OpCounter

pytestmark = pytest.mark.skipif(supported_isa() is None, reason="the kernel library is unavailable")
PROMPTS = [[3 + (5 * i + 7 * s) % 200 for i in range(n)] for s, n in enumerate([4, 9, 13])]
# the kernels take bf16 experts whose sizes are multiples of 32 (the tiny Mixtral's are not)
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
SIZES = {"qwen3_moe": dict(moe_intermediate_size=64), "mixtral": dict(intermediate_size=64),
         "gpt_oss": dict(intermediate_size=64, sliding_window=8), "mellum": dict(moe_intermediate_size=64)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    made = {}

    def get(arch: str):
        if arch not in made:
            made[arch] = save_tiny(arch, tmp_path_factory.mktemp(arch), sizes=SIZES[arch])
            if arch == "gpt_oss":
                _random_biases(made[arch])
        return made[arch]

    return get


def _random_biases(path) -> None:
    """Every bias and sink of the checkpoint at `path` drawn at random (transformers initialises them to zero), so
    the call's additions of them are checked."""
    model = load_reference(path)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    model.save_pretrained(path)


class Calls:
    """Counts the fused layers' native calls."""

    def __init__(self, monkeypatch):
        self.n = 0
        decode = FusedDecodeLayer._decode

        def counted(layer, *args):
            self.n += 1
            return decode(layer, *args)

        monkeypatch.setattr(FusedDecodeLayer, "_decode", counted)


def decode_logits(path, steps: int = 4, **llm_kwargs) -> tuple[torch.Tensor, int, list[list[int]]]:
    """Logits [steps, sequences, vocab] of greedy decode steps of PROMPTS decoding together (each prompt fed alone
    first), with page size 4 so rows cross pages; and how many decoder layers are fused."""
    with LLM(path, dtype=torch.bfloat16, page_size=4, progress=False, **llm_kwargs) as llm:
        fused = sum(isinstance(layer, FusedDecodeLayer) for layer in llm.hybrid.model.model.layers)
        engine = llm.engine
        seqs = [engine.new_sequence() for _ in PROMPTS]
        tokens = [list(p) for p in PROMPTS]
        for i, (seq, prompt) in enumerate(zip(seqs, PROMPTS)):
            tokens[i].append(int(engine.feed([seq], [prompt])[0][-1].float().argmax()))
        steps_logits = []
        for step in range(steps):
            batch = seqs if step % 2 else seqs[:1]  # one row, then the ragged three
            rows = engine.feed(batch, [[tokens[seqs.index(s)][-1]] for s in batch])
            for seq, row in zip(batch, rows):
                tokens[seqs.index(seq)].append(int(row[-1].float().argmax()))
            steps_logits.append(torch.stack([row[-1] for row in rows]))
        return torch.cat(steps_logits), fused, tokens


def per_op(monkeypatch):
    monkeypatch.setattr(loader, "fuse_decode_layers", lambda model, kernels: 0)


@pytest.mark.exactness
# int4: q in int4 and k / v stacked in int8 (tiermoe.model.non_expert_quant.linear_format), two products
# GPT-OSS's 4-bit model: int4 experts with int6 downs beside int4 / int8 / int6 non-experts
@pytest.mark.parametrize("arch,non_experts", [("qwen3_moe", None), ("mixtral", None), ("qwen3_moe", "int4"),
                                              ("gpt_oss", None), ("gpt_oss", "int4"),
                                              ("mellum", None)])  # Qwen3-MoE's code under other class names
def test_a_fused_decode_step_is_bit_for_bit_the_per_op_path(arch, non_experts, checkpoint, monkeypatch):
    path = checkpoint(arch)
    cpu = CPUConfig(non_expert_dtype=non_experts, expert_dtype="int4" if (arch, non_experts) == ("gpt_oss", "int4")
                    else None)
    monkeypatch.setattr(fused_decode_layer, "PROMPT_ROWS", 0)  # prompts by the per-op path in both runs
    calls = Calls(monkeypatch)
    logits, fused, tokens = decode_logits(path, cpu=cpu)
    spec = detect(load_config(path))
    assert fused == len(spec.moe_layers) and calls.n == fused * 4  # every MoE layer, every decode step
    with monkeypatch.context() as m:
        per_op(m)
        want, none, want_tokens = decode_logits(path, cpu=cpu)
    assert none == 0 and torch.equal(logits, want) and tokens == want_tokens


def test_short_prompts_take_the_whole_layer_call_each_row_attending_in_place(checkpoint, monkeypatch):
    """Prompt rows attend like decode rows (RaggedStep.rows_in_place): the prompt step's logits equal the per-op
    path's (its decode rows and chunk rows in two calls) within bf16 rounding; a step mixing decode rows and a
    prompt chunk, too; a step of more than PROMPT_ROWS rows keeps the per-op path."""
    path = checkpoint("qwen3_moe")
    monkeypatch.setattr(fused_decode_layer, "PROMPT_ROWS", 16)
    rows = {}
    for fuse in (True, False):
        with monkeypatch.context() as m:
            if not fuse:
                per_op(m)
            calls = Calls(m)
            with LLM(path, dtype=torch.bfloat16, page_size=4, progress=False) as llm:
                engine = llm.engine
                first, second, third = (engine.new_sequence() for _ in range(3))
                prompt = engine.feed([first], [PROMPTS[2]])[0]  # 13 rows: fused
                taken = calls.n
                mixed = engine.feed([first, second], [[5], PROMPTS[1]])  # a decode row and 9 prompt rows
                taken = (taken, calls.n - taken)
                engine.feed([third], [list(range(3, 20))])  # 17 rows: beyond PROMPT_ROWS
                rows[fuse] = (prompt, mixed, taken, calls.n - sum(taken))
    (prompt, mixed, taken, long), (want_prompt, want_mixed, _, _) = rows[True], rows[False]
    assert taken == (2, 2) and long == 0  # each step through both MoE layers; the long prompt by the per-op path
    assert rel_err(prompt.float(), want_prompt.float()) < 2e-2  # bf16 rows, attention summed in another order
    with torch.no_grad():  # and transformers' fp32 model, within bf16 rounding (the per-op path: the same bound)
        reference = load_reference(path)(torch.tensor([PROMPTS[2]])).logits[0, -1]
    assert rel_err(prompt[-1].float(), reference) < 2e-2
    for got, want in zip(mixed, want_mixed):
        assert rel_err(got.float(), want.float()) < 2e-2


def test_a_fused_decode_step_dispatches_a_few_torch_ops_per_layer(checkpoint):
    with LLM(checkpoint("qwen3_moe"), dtype=torch.bfloat16, progress=False) as llm:
        layers = llm.hybrid.model.model.layers
        counts, started = [], []
        counter = OpCounter()
        for layer in layers:
            layer.register_forward_pre_hook(lambda *_: started.append(counter.ops))
            layer.register_forward_hook(lambda *_: counts.append(counter.ops - started.pop()))
        seq = llm.engine.new_sequence()
        llm.engine.feed([seq], [PROMPTS[1]])
        counts.clear()
        with counter:
            llm.engine.feed([seq], [[7]])
    fused = [c for layer, c in zip(layers, counts) if isinstance(layer, FusedDecodeLayer)]
    assert fused and max(fused) <= 4, counts  # the output, the routed ids; the per-op path dispatches about 60


def test_the_recorder_sees_the_routing_of_fused_steps(checkpoint, monkeypatch):
    path = checkpoint("qwen3_moe")
    shape = ModelShape.of(detect(load_config(path)))
    dumps, outputs = [], []
    for fuse in (True, False):
        with monkeypatch.context() as m:
            if not fuse:
                per_op(m)
            recorder = StatRecorder(shape)
            with LLM(path, dtype=torch.bfloat16, recorder=recorder, progress=False) as llm:
                outputs.append([o.token_ids for o in llm.generate(PROMPTS, GREEDY)])
            dumps.append(recorder.dump()["logical_count_decode"])
    assert dumps[0].sum() == 3 * 5 * shape.top_k * len(shape.moe_layers)  # 5 decode tokens of 3 sequences
    assert torch.equal(dumps[0], dumps[1]) and outputs[0] == outputs[1]


@pytest.mark.parametrize("case", ["gpu-tier experts", "as loaded", "fp32"])
def test_steps_and_models_it_does_not_take_run_the_per_op_path(case, checkpoint, monkeypatch):
    path = checkpoint("qwen3_moe")
    kwargs = {"gpu-tier experts": dict(placement=make_mask("random_half", detect(load_config(path)))),
              "as loaded": dict(cpu=CPUConfig(non_expert_dtype="none"))}.get(case, {})
    calls = Calls(monkeypatch)
    if case == "fp32":
        with LLM(path, dtype=torch.float32, progress=False) as llm:
            assert not any(isinstance(m, FusedDecodeLayer) for m in llm.hybrid.model.modules())
        return
    logits, fused, _ = decode_logits(path, **kwargs)
    assert calls.n == 0 and fused == (2 if case == "gpu-tier experts" else 0)
    per_op(monkeypatch)
    want, _, _ = decode_logits(path, **kwargs)
    assert torch.equal(logits, want)


def test_a_shared_expert_model_keeps_its_layers(tiny_dir):
    with LLM(tiny_dir("qwen2_moe"), dtype=torch.bfloat16, progress=False) as llm:
        assert not any(isinstance(m, FusedDecodeLayer) for m in llm.hybrid.model.modules())
        assert not any(fused_decode_layer.fusable(m) for m in llm.hybrid.model.model.layers)
