"""Qwen3-Next's linear attention decoding in place (tiermoe.layers.gated_delta_decode, csrc/gated_delta.cpp).

References: transformers' own one-token rule (torch_recurrent_gated_delta_rule) for the native kernel, and the
module's original forward over the pool's slots (the path the engine took before, equal to transformers' model
in tests/test_engine_kv_pool.py) for the whole decode layer. fp32 within 1e-5 relative (sums in another order);
bf16 outputs within 2 bf16 steps; recurrent states are fp32 in both dtypes.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import rel_err
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet, torch_recurrent_gated_delta_rule

from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import SamplingParams
from tiermoe.experts.kernels import ISA_NAMES, ThreadTeam, load_kernels
from tiermoe.layers import decode_attention as decode_module
from tiermoe.layers.decode_attention import DecodeAttention
from tiermoe.layers.gated_delta_decode import decode_rows, decodes_in_place
from tiermoe.layers.linear_attention_slots import LinearStateSlots, SlotStates, use_ragged_linear_attention
from tiermoe.testing.op_counter import OpCounter
from tiermoe.testing.presets import make_config

pytestmark = pytest.mark.exactness  # transformers' own gated delta rule is the reference

KERNELS = load_kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="the CPU kernels are not built here")
BF16_STEPS = 2 * 2 ** -8  # two bf16 steps, relative to the largest value


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    if got.dtype == torch.float32:
        return rel_err(got, want) <= 1e-5
    return (got.float() - want.float()).abs().max() <= BF16_STEPS * want.float().abs().max()


def _rule_case(dtype, dk: int, dv: int, seed: int = 0):
    """Three rows with grouped values (4 value heads on 2 key heads) over 4 slots' states in 2 banks; the last
    row writes the slot it reads (in place)."""
    g = torch.Generator().manual_seed(seed)
    B, Hk, Hv = 3, 2, 4
    qkv = torch.randn(B, 2 * Hk * dk + Hv * dv, generator=g).to(dtype)
    log_decay = -torch.rand(B, Hv, generator=g) * 2
    beta = torch.rand(B, Hv, generator=g).to(dtype)
    states = torch.randn(8, Hv, dk, dv, generator=g) * 0.3
    read, write = torch.tensor([5, 0, 2]), torch.tensor([4, 1, 2])
    return qkv, (Hk, Hv, dk, dv), log_decay, beta, states, read, write


def _check_rule(kernels, team, dtype, dk, dv, seed=0) -> None:
    qkv, (Hk, Hv, dk, dv), log_decay, beta, states, read, write = _rule_case(dtype, dk, dv, seed)
    B = qkv.shape[0]
    q, k, v = torch.split(qkv, [Hk * dk, Hk * dk, Hv * dv], dim=-1)
    want_out, want_state = torch_recurrent_gated_delta_rule(
        q.reshape(B, 1, Hk, dk), k.reshape(B, 1, Hk, dk), v.reshape(B, 1, Hv, dv), g=log_decay[:, None],
        beta=beta[:, None], initial_state=states[read].clone(), output_final_state=True, use_qk_l2norm_in_kernel=True)
    before = states.clone()
    out = torch.empty(B, Hv, dv, dtype=dtype)
    DecodeAttention(kernels, team).gated_delta(qkv, Hk, dk, log_decay, beta, states, read, write, out)
    assert _close(out, want_out[:, 0]), (dtype, dk, dv)
    assert rel_err(states[write], want_state) <= 1e-5, (dtype, dk, dv)
    untouched = [s for s in range(states.shape[0]) if s not in write.tolist()]
    assert torch.equal(states[untouched], before[untouched])  # slot 5 was read, not written


@needs_kernels
@pytest.mark.parametrize("isa", ISA_NAMES[:KERNELS.isa + 1] if KERNELS else [])
def test_every_isa_updates_the_states_as_transformers_rule_does(isa):
    kernels = load_kernels(isa=isa)
    for dtype in (torch.float32, torch.bfloat16):
        for dk, dv in ((16, 16), (128, 128), (72, 40)):
            _check_rule(kernels, None, dtype, dk, dv, seed=dk + dv)


@needs_kernels
def test_the_team_splits_rows_and_heads_with_the_same_result(monkeypatch):
    monkeypatch.setattr(decode_module, "TEAM_MIN_WORK", 0)
    threads = ThreadTeam(KERNELS, 2)
    for dtype in (torch.float32, torch.bfloat16):
        _check_rule(KERNELS, lambda: threads, dtype, 32, 32)
    threads.close()


def _prefilled_layer(dtype):
    """A gated DeltaNet layer of the tiny Qwen3-Next and pool slots where three sequences have prefilled 2, 5
    and 9 tokens through the original forward (the path the engine takes for prompts)."""
    torch.manual_seed(0)
    config = make_config("qwen3_next")
    layer = next(i for i, kind in enumerate(config.layer_types) if kind == "linear_attention")
    module = Qwen3NextGatedDeltaNet(config, layer).to(dtype).eval().requires_grad_(False)
    slots = LinearStateSlots(4, torch.device("cpu"))
    for slot, n in ((0, 2), (1, 5), (3, 9)):
        read, write = slots.indices([slot])
        states = SlotStates(slots, [slot], torch.tensor(read), torch.tensor(write))
        module(torch.randn(1, n, config.hidden_size).to(dtype), cache=states)
        states.finish(layer)
        slots.commit([slot])
    return module, slots, config.hidden_size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("native", [True, False] if KERNELS else [False])
def test_decode_rows_equal_the_original_forward_over_the_slots(dtype, native):
    module, slots, hidden = _prefilled_layer(dtype)
    rows = [3, 0, 1]
    x = torch.randn(len(rows), hidden).to(dtype)
    read, write = (torch.tensor(i) for i in slots.indices(rows))
    reference = copy.deepcopy(slots)
    states = SlotStates(reference, rows, read, write)
    want = module(x[:, None], cache=states)[:, 0]
    states.finish(module.layer_idx)
    layer = module.layer_idx
    got = decode_rows(module, x, slots.conv[layer], slots.recurrent[layer], read, write,
                      DecodeAttention(KERNELS, lambda: None) if native else None)
    assert _close(got, want)
    assert torch.equal(slots.conv[layer], reference.conv[layer])  # the window, copied as transformers keeps it
    assert rel_err(slots.recurrent[layer], reference.recurrent[layer]) <= 1e-5


@needs_kernels
def test_a_decode_step_neither_convolves_nor_gathers_recurrent_states(tiny_dir):
    """A decode step of the tiny Qwen3-Next: no convolution (torch's CPU slow path loops over channel groups per
    row), and per linear-attention layer one gather (the conv window), not two; tokens as transformers' (the
    engine tests check them against the unmodified model)."""
    with LLM(tiny_dir("qwen3_next"), dtype=torch.float32, progress=False) as llm:
        engine = llm.engine
        seqs = [engine.add(list(range(3, 3 + n)), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
                for n in (4, 9, 17)]
        engine.step()
        ops = OpCounter()
        with ops:
            engine.step()
        engine.run_to_completion()
        linear = sum(kind == "linear_attention" for kind in llm.engine.model.config.layer_types)
    assert all(len(s.output_ids) == 4 for s in seqs)
    assert ops.names["conv1d"] == 0
    assert ops.names["index_select"] == linear


class _RescaledGatedDeltaNet(Qwen3NextGatedDeltaNet):
    """Laid out as Qwen3-Next's gated DeltaNet (the same projections and parameters), computing something else."""

    def forward(self, hidden_states, *args, **kwargs):
        return 2 * super().forward(hidden_states, *args, **kwargs)


def test_the_in_place_decode_takes_qwen3_nexts_code_not_its_layout():
    config = make_config("qwen3_next")
    for cls, in_place in ((Qwen3NextGatedDeltaNet, True), (_RescaledGatedDeltaNet, False)):
        module = cls(config, 0)
        assert decodes_in_place(module) is in_place
        assert use_ragged_linear_attention(module) == 1  # its class swapped as the engine swaps it
        assert decodes_in_place(module) is in_place, cls
