"""The LM head is one contiguous 2-D matmul over the rows that are sampled (issue 22).

transformers hands the head a strided [1, 1, D] slice when a prompt has more than one token (`logits_to_keep=1`);
torch computes a Linear on it as a bmm that, in bf16 on the CPU, first copies the whole [D, V] weight (a 2-token
prompt took 3.3 s against 49 ms for one token at Qwen3's vocabulary). The profiler shows the copy; no timing.
"""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHS, load_reference
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM

from tiermoe.config import CPUConfig
from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import SamplingParams
from tiermoe.experts.kernels import supported_isa
from tiermoe.layers.quantized_linear import QuantizedLinear
from tiermoe.testing.presets import make_config

VOCAB = 16384  # with the tiny hidden size 64, a bf16 head of 2 MiB: a copy of it is above the 1 MB allowed
MAX_COPY_BYTES = 1 << 20
# The head as torch computes it (a CPU-only bf16 model packs it by default, tiermoe.model.cpu_only; on a GPU and in
# fp32 it stays torch's): the tests below see its aten::linear.
TORCH_HEAD = CPUConfig(non_expert_dtype="none")
_ELEMENT_BYTES = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8, "int": 4}


def _large_vocab_checkpoint(arch: str, out, tied: bool = False):
    cfg = make_config(arch, initializer_range=0.1, vocab_size=VOCAB, tie_word_embeddings=tied)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(out)
    return out


def _profile(run) -> list:
    """The profiler's events while `run()` runs (ops of this thread: run one forward job at a time, as a single
    sequence's prefill or one batched decode does, so the engine does not hand it to its worker threads)."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        run()
    return prof.events()


def _large_copies(events) -> list[tuple[list, str]]:
    """(shape, dtype) of every `copy_` of more than MAX_COPY_BYTES."""
    large = []
    for event in events:
        if event.name != "aten::copy_" or not event.input_shapes or not event.input_shapes[0]:
            continue
        shape, dtype = event.input_shapes[0], event.input_dtypes[0]
        if torch.Size(shape).numel() * _ELEMENT_BYTES.get(dtype, 8) > MAX_COPY_BYTES:
            large.append((shape, dtype))
    return large


def _head_inputs(events) -> list[list[int]]:
    """Shapes of the hidden rows the LM head's Linear was given (so a test cannot pass by not seeing the head)."""
    return [e.input_shapes[0] for e in events
            if e.name == "aten::linear" and len(e.input_shapes) > 1 and e.input_shapes[1] == [VOCAB, 64]]


@pytest.mark.parametrize("arch, tied", [(arch, False) for arch in ARCHS] + [("qwen3_moe", True)])
def test_a_two_token_prefill_copies_no_weight(arch, tied, tmp_path):
    with LLM(_large_vocab_checkpoint(arch, tmp_path, tied), cpu=TORCH_HEAD, progress=False) as llm:
        assert llm.hybrid.model.lm_head.weight.dtype == torch.bfloat16
        one = SamplingParams(max_tokens=1)
        llm.generate([3, 4], one)  # warm up: the first pass's one-time allocations are not the point
        events = _profile(lambda: llm.generate([8, 9], one))
        assert _large_copies(events) == []
        assert _head_inputs(events) == [[1, 64]]  # the sampled row alone, as a contiguous 2-D matrix
        events = _profile(lambda: llm.generate([13, 14, 15], SamplingParams(max_tokens=1, prompt_logprobs=1)))
        assert _large_copies(events) == []
        assert _head_inputs(events) == [[3, 64]]  # every prompt row is scored


@pytest.mark.skipif(supported_isa() is None, reason="the kernel library is unavailable")
def test_the_packed_head_of_a_cpu_only_run_copies_no_weight_either(tmp_path):
    with LLM(_large_vocab_checkpoint("qwen3_moe", tmp_path), progress=False) as llm:
        head = llm.hybrid.model.get_output_embeddings()
        assert isinstance(head, QuantizedLinear) and head.fmt == "bf16"
        llm.generate([3, 4], SamplingParams(max_tokens=1))
        rows = []
        hook = head.register_forward_pre_hook(lambda _, args: rows.append(tuple(args[0].shape)))
        events = _profile(lambda: llm.generate([8, 9], SamplingParams(max_tokens=1)))
        hook.remove()
        assert _large_copies(events) == [] and rows == [(1, 1, 64)]


def test_a_batched_decode_runs_the_head_once_on_its_rows(tmp_path):
    with LLM(_large_vocab_checkpoint("qwen3_moe", tmp_path), cpu=TORCH_HEAD, progress=False) as llm:
        seqs = [llm.engine.add(p, SamplingParams(max_tokens=3, ignore_eos=True)) for p in ([3, 4], [5, 6, 7])]
        llm.engine.step()  # the two prefills
        events = _profile(llm.engine.step)  # one batched decode: one forward for both
        assert all(len(s.output_ids) == 2 for s in seqs)
        assert _large_copies(events) == []
        assert _head_inputs(events) == [[2, 64]]


@pytest.mark.exactness
@pytest.mark.parametrize("arch", ARCHS)
def test_last_row_logits_equal_transformers(arch, tiny_dir):
    """The head on the last row of a 3-token prompt (a strided slice) and on every row: transformers' logits."""
    path = tiny_dir(arch)
    ids = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        ref = load_reference(path)(input_ids=ids).logits
    with LLM(path, dtype=torch.float32, progress=False) as llm:
        last = llm.hybrid(input_ids=ids, logits_to_keep=1).logits
        every = llm.hybrid(input_ids=ids, logits_to_keep=0).logits
    assert last.shape == (1, 1, ref.shape[-1])
    torch.testing.assert_close(last, ref[:, -1:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(every, ref, rtol=1e-5, atol=1e-5)


def test_the_head_keeps_its_parameter_names_and_its_tie(tmp_path):
    with LLM(_large_vocab_checkpoint("qwen3_moe", tmp_path, tied=True), cpu=TORCH_HEAD, progress=False) as llm:
        model = llm.hybrid.model
        assert "lm_head.weight" in dict(model.named_parameters(remove_duplicate=False))
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_chunks_that_do_not_end_the_prompt_run_no_lm_head_row(arch, tiny_dir):
    """A 10-token prompt in chunks of 4: the head runs on one row (the last chunk's last), not on one per chunk;
    the tokens equal an unchunked prefill's, for every architecture."""
    greedy = SamplingParams(max_tokens=3, ignore_eos=True)
    with LLM(tiny_dir(arch), dtype=torch.float32, progress=False) as llm:
        whole = llm.generate(list(range(5, 15)), greedy)[0]
    with LLM(tiny_dir(arch), dtype=torch.float32, prefill_chunk=4, progress=False) as llm:
        head_rows = []
        handle = llm.hybrid.model.get_output_embeddings().register_forward_hook(
            lambda module, args, out: head_rows.append(args[0].shape[:-1].numel()))
        out = llm.generate(list(range(5, 15)), greedy)[0]
        handle.remove()
        assert head_rows == [0, 0, 1, 1, 1] and out.token_ids == whole.token_ids
        scored = llm.generate(list(range(5, 15)), SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=0))[0]
        assert scored.token_ids == whole.token_ids and len(scored.prompt_logprobs) == 9
