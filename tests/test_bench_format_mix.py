"""benchmarks/bench_format_mix.py's formats and layer rule (pure functions; no model is loaded)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_format_mix import (
    Q6_GROUP,
    down_format,
    more_bits_layers,
    round_trip,
    six_bit,
)

from tiermoe.experts.quant import dequantize, quantize


def test_the_layers_given_more_bits_are_llama_cpps_rule():
    # llama.cpp's use_more_bits: i < n/8, i >= 7n/8, or (i - n/8) % 3 == 2, in integer division
    assert more_bits_layers(4) == {2, 3}
    layers48 = more_bits_layers(48)
    assert set(range(6)) <= layers48 and set(range(42, 48)) <= layers48
    assert {8, 11, 38, 41} <= layers48 and not {6, 7, 9, 10, 39, 40} & layers48
    assert down_format("more-bits:q6/int4", 3, {2, 3}) == "q6"
    assert down_format("more-bits:q6/int4", 1, {2, 3}) == "int4"
    assert down_format("int8", 1, {2, 3}) == "int8"


def test_six_bits_are_integer_codes_times_8_bit_group_scales_and_each_weight_within_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(32, 4 * Q6_GROUP)
    out = six_bit(w)
    groups, back = w.reshape(32, -1, Q6_GROUP), out.reshape(32, -1, Q6_GROUP)
    largest = groups.abs().amax(-1)
    # half a step, plus what rounding the group's scale to 8 bits of its row's (at most half a unit, over 32 codes)
    unit = largest.amax(1, keepdim=True) / 31.5 / 127
    assert ((back - groups).abs().amax(-1) <= largest / 31.5 / 2 + 32 * unit / 2 + 1e-6).all()
    assert (back - groups).abs().amax() < 0.03 * groups.abs().amax()  # a 6-bit grid: about 1/63 of the range
    # the codes: integers in [-32, 31] times each group's scale, 8 bits (1-127) of its row's largest
    scale = (largest / 31.5 / unit).round().clamp(1, 127) * unit
    codes = back / scale[..., None]
    assert torch.allclose(codes, codes.round(), atol=1e-4) and codes.round().min() >= -32 and codes.round().max() <= 31


def test_a_packed_format_round_trips_through_tiermoes_own_codes_and_counts_their_bytes():
    torch.manual_seed(1)
    w = torch.randn(48, 96, dtype=torch.bfloat16)
    for fmt in ("int4", "int8"):
        back, nbytes = round_trip(w, fmt)
        q = quantize(w.float(), fmt)
        assert back.dtype == w.dtype and back.shape == w.shape
        assert torch.equal(back, dequantize(q, torch.float32)[:48, :96].to(w.dtype))
        assert nbytes == q.nbytes
    back, nbytes = round_trip(w, "q6")
    assert nbytes == w.numel() * 6 // 8 + w.numel() // Q6_GROUP + 4 * 48
    with pytest.raises(SystemExit, match="multiple of 16"):
        round_trip(torch.randn(4, 40), "q6")
