"""Routing as text: trace CSVs and heat-matrix CSVs are statistics files everywhere `.pt` ones are (stats, place
--init-expert-location, bench dynamic), round-trip tiermoe's own traces, and bad files are one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tiermoe.analysis.trace_replay import trace_passes
from tiermoe.cli.main import main
from tiermoe.errors import TiermoeError
from tiermoe.routing.trace_convert import convert
from tiermoe.stats.heat_csv import write_heat_csv
from tiermoe.stats.io import load_counts, load_stats, load_trace
from tiermoe.stats.trace_csv import write_trace_csv

DATA = Path(__file__).parent / "data" / "routing"


def per_token_trace(passes) -> dict:
    """A small per_token dump: 4 layers (layers 1 and 3 MoE), 8 experts, top-2; each pass a list of (request,
    tokens, prefill) rows."""
    gen = torch.Generator().manual_seed(0)
    rows, pos = [], {}
    for p, batch in enumerate(passes):
        for req, n, prefill in batch:
            for _ in range(n):
                rows.append((p, req, pos.get(req, 0), prefill))
                pos[req] = pos.get(req, 0) + 1
    n = len(rows)
    ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(2 * n)]).view(n, 2, 2)
    trace = {"format": "tiermoe-expert-distribution", "mode": "per_token", "num_layers": 4, "num_experts": 8,
             "top_k": 2, "moe_layers": [1, 3], "model_type": "qwen3_moe",
             "token_pass": torch.tensor([r[0] for r in rows], dtype=torch.int32),
             "token_request": torch.tensor([r[1] for r in rows], dtype=torch.int32),
             "token_position": torch.tensor([r[2] for r in rows], dtype=torch.int32),
             "token_is_prefill": torch.tensor([r[3] for r in rows]), "topk_ids": ids.to(torch.int16)}
    return trace


def cli(capsys, *args) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_trace_round_trips_through_csv_with_its_passes(tmp_path):
    # two prompts prefilled together, then three decode steps batching both requests
    trace = per_token_trace([[(0, 3, True), (1, 2, True)]] + [[(0, 1, False), (1, 1, False)]] * 3)
    write_trace_csv(trace, tmp_path / "t.csv")
    assert (tmp_path / "t.csv").read_text().splitlines()[2] == "seq,pos,layer,experts,prefill,pass"
    back = load_trace(tmp_path / "t.csv")
    assert torch.equal(back["topk_ids"].long(), trace["topk_ids"].long())
    for key in ("token_request", "token_position", "token_is_prefill"):
        assert torch.equal(back[key], trace[key]), key
    assert (back["num_layers"], back["num_experts"], back["top_k"], back["moe_layers"]) == (4, 8, 2, [1, 3])
    a, b = trace_passes(back), trace_passes({**trace, "num_layers": 4, "num_experts": 8})
    assert torch.equal(a.counts_PME, b.counts_PME) and torch.equal(a.tokens_P, b.tokens_P)
    stats = load_stats(tmp_path / "t.csv")
    assert a.tokens_P.tolist() == [5, 2, 2, 2]
    assert stats.kinds == ("trace csv",) and stats.moe_layers == (1, 3) and stats.num_prefill_tokens == 5
    assert torch.equal(stats.prefill_LE + stats.decode_LE, stats.counts_LE)


def test_without_a_pass_column_requests_run_one_at_a_time(tmp_path):
    (tmp_path / "t.csv").write_text("seq,pos,layer,experts,prefill\n" + "".join(
        f"{s},{p},0,{p % 4} {4 + s},{int(p < 2)}\n" for s in (0, 1) for p in range(4)))
    passes = trace_passes(load_trace(tmp_path / "t.csv"))
    # each request: its 2 prompt tokens as one prefill pass, then one pass per decode token
    assert passes.tokens_P.tolist() == [2, 1, 1, 2, 1, 1]
    assert passes.prefill_P.tolist() == [True, False, False, True, False, False]
    assert passes.num_layers == 1 and passes.num_experts == 6  # no metadata: the largest id + 1


def test_heat_and_trace_csv_feed_stats_place_and_agree_on_real_esft_data(capsys, tmp_path):
    trace = convert(DATA / "esft_law_slice.txt", tmp_path / "law.csv")
    heat = convert(DATA / "esft_counts_law.csv", tmp_path / "counts.csv")
    assert (trace.kind, trace.tokens, trace.num_layers, trace.num_experts) == ("trace", 40, 27, 64)
    assert (heat.kind, heat.num_layers, heat.num_experts) == ("heat", 27, 64)
    counts = load_counts(tmp_path / "counts.csv", 27, 64)
    assert counts[0].sum() == 0 and int(counts[1:].sum()) == 1299012  # layer 0 is DeepSeek-V2-Lite's dense one
    assert torch.equal(counts[1:].sum(1), torch.full((26,), 8327.0 * 6, dtype=torch.float64))  # 8327 tokens x top-6
    code, out, err = cli(capsys, "stats", tmp_path / "counts.csv", "--eval", tmp_path / "law.csv", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert (report["num_layers"], report["kinds"], report["hit_rates"]["evaluated_on"]) == (
        27, ["heat csv"], [str(tmp_path / "law.csv")])
    # the whole task's hot set on 40 of its tokens: better than uniform at a quarter of the experts
    rates = report["hit_rates"]["strategies"]
    assert rates["frequency"][2] > rates["uniform"][2]
    code, out, err = cli(capsys, "place", "--num-layers", 27, "--num-experts", 64, "--first-k-dense", 1,
                         "--strategy", "frequency", "--init-expert-location", tmp_path / "counts.csv",
                         "--gpu-experts-ratio", 0.25, "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["expected_hit_rate"] > 0.25 + 0.1  # the law task's own hot set, skewed (Gini ~0.3)
    code, _, err = cli(capsys, "place", "--num-layers", 26, "--num-experts", 64, "--strategy", "frequency",
                       "--init-expert-location", tmp_path / "counts.csv", "--gpu-experts-ratio", 0.25)
    assert code == 2 and "[26, 64]" in err and len(err.strip().splitlines()) == 1


def test_a_pt_statistics_file_converts_to_a_heat_matrix_that_loads_the_same(tmp_path):
    counts = torch.zeros(1, 4, 8, dtype=torch.int64)
    counts[0, 1] = torch.arange(8)
    counts[0, 3] = 7 - torch.arange(8)
    torch.save({"logical_count": counts}, tmp_path / "s.pt")
    assert convert(tmp_path / "s.pt", tmp_path / "h.csv").kind == "heat"
    assert torch.equal(load_counts(tmp_path / "h.csv", 4, 8), counts[0].double())
    write_heat_csv(counts[0].double() / 3, tmp_path / "f.csv")  # fractional heat stays fractional
    assert torch.allclose(load_counts(tmp_path / "f.csv", 4, 8), counts[0].double() / 3, rtol=1e-5)


BAD_FILES = [
    ("seq,pos,experts\n0,0,1 2\n", "must name seq,pos,layer,experts"),
    ("seq,pos,layer,experts\n0,0,1\n", "line 2: 3 fields"),
    ("seq,pos,layer,experts\n0,0,1,1 x\n", "line 2"),
    ("seq,pos,layer,experts\n0,0,1,1 2\n0,1,1,1 2 3\n", "line 3: 3 experts, expected top_k=2"),
    ("seq,pos,layer,experts\n0,0,1,1 1\n", "distinct"),
    ("seq,pos,layer,experts\n0,0,1,1 2\n0,0,1,3 4\n", "two rows for one layer"),
    ("# num_experts=4\nseq,pos,layer,experts\n0,0,1,1 5\n", "num_experts=4"),
    ("seq,pos,layer,experts\n", "no trace rows"),
    ("layer,e0,e1\n0,1,-2\n", "negative"),
    ("layer,e0,e2\n0,1,2\n", "layer,e0,e1"),
    ("layer,e0,e1\n0,1\n", "1 counts, the header names 2"),
    ("hello,world\n1,2\n", "neither a routing trace"),
    ("# x\n# ALPH=0123\n0 0 01 23\n", "tiermoe trace convert --from esft-trace"),
]


@pytest.mark.parametrize("text,fragment", BAD_FILES)
def test_bad_text_files_are_one_line_errors_naming_the_problem(capsys, tmp_path, text, fragment):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(TiermoeError, match=None) as err:
        load_stats(path)
    assert fragment in str(err.value) and "\n" not in str(err.value)
    code, _, stderr = cli(capsys, "stats", path)
    assert code == 2 and fragment in stderr and len(stderr.strip().splitlines()) == 1


def test_a_heat_matrix_is_not_a_trace_to_replay(tmp_path):
    (tmp_path / "h.csv").write_text("layer,e0,e1\n0,1,2\n")
    with pytest.raises(TiermoeError, match="heat matrix .* not a per-token trace"):
        load_trace(tmp_path / "h.csv")


def test_bench_dynamic_costs_a_csv_trace_with_a_config_json_alone(capsys, tmp_path):
    from tiermoe.testing.presets import make_config

    make_config("deepseek_v2", "deepseek-v2-lite").to_json_file(tmp_path / "config.json")
    convert(DATA / "esft_law_slice.txt", tmp_path / "law.csv")
    convert(DATA / "esft_counts_law.csv", tmp_path / "heat.csv")
    code, out, err = cli(capsys, "bench", "dynamic", "--trace", tmp_path / "law.csv", "--calibration",
                         tmp_path / "heat.csv", "--model", tmp_path / "config.json", "--ratios", "0.25", "--json")
    assert code == 0, err
    rows = {r["policy"]: r for r in json.loads(out)["rows"]}
    expert_bytes = 3 * 2048 * 1408 * 2  # DeepSeek-V2-Lite: gate, up, down of 2048 x 1408 in bf16
    assert rows["frequency"]["cpu_bytes"] > 0 and rows["frequency"]["cpu_bytes"] % expert_bytes == 0
    assert rows["frequency"]["output_tokens"] == 40
    code, _, err = cli(capsys, "bench", "dynamic", "--trace", tmp_path / "law.csv", "--model", DATA / "README.md")
    assert code == 2 and len(err.strip().splitlines()) == 1
