"""`tiermoe trace convert`: the published layouts (ESFT, BigMoeOnEdge route traces, mbolt heat) and SGLang's
per_token dump become trace / heat CSVs holding exactly the routing of the source."""

from __future__ import annotations

from pathlib import Path

import torch

from tiermoe.analysis.trace_replay import trace_passes
from tiermoe.cli.main import main
from tiermoe.routing.trace_convert import convert
from tiermoe.stats.io import load_counts, load_trace

DATA = Path(__file__).parent / "data" / "routing"
ALPH = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz-_"


def test_esft_trace_becomes_decode_tokens_of_the_moe_layers(tmp_path):
    convert(DATA / "esft_law_slice.txt", tmp_path / "law.csv")
    trace = load_trace(tmp_path / "law.csv")
    first = next(x for x in (DATA / "esft_law_slice.txt").read_text().splitlines() if not x.startswith("#"))
    groups = first.split()[2:]
    assert trace["moe_layers"] == list(range(1, 27)) and trace["num_layers"] == 27 and trace["top_k"] == 6
    assert trace["topk_ids"][0].tolist() == [[ALPH.index(c) for c in g] for g in groups]
    assert trace["token_request"].tolist() == [0] * 24 + [1] * 16
    assert trace["token_position"].tolist() == list(range(24)) + list(range(16))
    assert not trace["token_is_prefill"].any()
    assert trace_passes(trace).num_passes == 40  # one token a step


def test_prompt_share_marks_the_first_part_of_each_request_as_one_prefill_pass(tmp_path):
    assert main(["trace", "convert", str(DATA / "esft_law_slice.txt"), str(tmp_path / "law.csv"),
                 "--prompt-share", "0.3"]) == 0
    trace = load_trace(tmp_path / "law.csv")
    # requests of 24 and 16 tokens: prompts of ceil(7.2) = 8 and ceil(4.8) = 5 tokens
    assert trace["token_is_prefill"].tolist() == [True] * 8 + [False] * 16 + [True] * 5 + [False] * 11
    assert trace_passes(trace).tokens_P.tolist() == [8] + [1] * 16 + [5] + [1] * 11
    assert main(["trace", "convert", str(DATA / "esft_law_slice.txt"), str(tmp_path / "all.csv"),
                 "--prompt-share", "0"]) == 0
    assert not load_trace(tmp_path / "all.csv")["token_is_prefill"].any()


def test_route_trace_keeps_prefill_as_one_pass_slot_order_and_gaps(tmp_path):
    done = convert(DATA / "qwen_route_slice.csv", tmp_path / "q.csv")
    assert (done.layout, done.tokens, done.num_layers, done.num_experts) == ("route-trace", 8, 48, 128)
    trace = load_trace(tmp_path / "q.csv")
    assert trace["topk_ids"][0, 0].tolist() == [49, 19, 58, 29, 16, 70]  # slots 0..5 of step 0, layer 0
    assert trace["token_is_prefill"].tolist() == [True] * 4 + [False] * 4
    assert trace["token_position"].tolist() == [0, 1, 2, 3, 28, 29, 30, 31]
    assert trace_passes(trace).tokens_P.tolist() == [4, 1, 1, 1, 1]
    rows = [x for x in (DATA / "qwen_route_slice.csv").read_text().splitlines()[1:] if x and not x[0] == "#"][1:]
    logged = {(int(r.split(",")[2]), int(r.split(",")[3])) for r in rows}
    assert int((trace["topk_ids"] >= 0).all(-1).sum()) == len(logged) == 8 * 48 - done.missing_rows


def test_heat_files_convert_and_load_as_counts(tmp_path):
    convert(DATA / "heat_qwen3_slice.csv", tmp_path / "h.csv")
    counts = load_counts(tmp_path / "h.csv", 4, 128)
    source = (DATA / "heat_qwen3_slice.csv").read_text().splitlines()
    assert counts[2].tolist() == [float(x) for x in source[3].split(",")[1:]]


def sglang_dump() -> dict:
    """SGLang's per_token dump: 3 layers (layer 0 dense), 8 logical experts on 10 physical slots (2 replicas),
    topk padded to 8 columns; pass 0 prefills two requests (3 and 2 tokens), pass 1 decodes both."""
    physical_to_logical = torch.tensor([list(range(8)) + [0, 1]] * 3)

    def record(pass_id, positions, lens, ids_TLK):
        topk = torch.full((3, len(positions), 8), -1, dtype=torch.int32)
        topk[1:, :, :2] = torch.tensor(ids_TLK, dtype=torch.int32).permute(1, 0, 2)
        return {"forward_pass_id": pass_id, "rank": 0, "gatherer_key": "primary", "input_ids": [5] * len(positions),
                "positions": positions, "extend_seq_lens": lens, "forward_mode": 1 if lens else 2,
                "topk_ids_of_layer": topk, "misc_objects": [], "global_physical_count": torch.zeros(3, 10)}

    prefill = [[[0, 1], [2, 3]], [[8, 2], [4, 5]], [[3, 4], [9, 0]], [[6, 7], [1, 2]], [[5, 6], [7, 8]]]
    decode = [[[1, 8], [0, 2]], [[3, 5], [6, 7]]]  # request 1's token first: rows need not keep their order
    return {"records": [record(1, [2, 3], None, decode), record(0, [0, 1, 2, 0, 1], [3, 2], prefill)],
            "last_physical_to_logical_map": physical_to_logical}


def test_sglang_per_token_dump_maps_physical_ids_and_links_requests(tmp_path, capsys):
    torch.save(sglang_dump(), tmp_path / "expert_distribution_recorder_1.0_0.pt")
    assert main(["trace", "convert", str(tmp_path / "expert_distribution_recorder_1.0_0.pt"),
                 str(tmp_path / "s.csv")]) == 0
    assert "trace of 7 tokens" in capsys.readouterr().out
    trace = load_trace(tmp_path / "s.csv")
    assert trace["moe_layers"] == [1, 2] and trace["num_layers"] == 3 and trace["top_k"] == 2
    assert trace["token_request"].tolist() == [0, 0, 0, 1, 1, 1, 0]  # positions 2 and 3 continue requests 1, 0
    assert trace["token_position"].tolist() == [0, 1, 2, 0, 1, 2, 3]
    assert trace["token_is_prefill"].tolist() == [True] * 5 + [False] * 2
    assert trace["topk_ids"][2].tolist() == [[3, 4], [1, 0]]  # physical 8 and 9 are replicas of 0 and 1
    assert trace["topk_ids"][5].tolist() == [[1, 0], [0, 2]]
    assert trace_passes(trace).tokens_P.tolist() == [5, 2]


def test_convert_errors_are_one_line(tmp_path, capsys):
    (tmp_path / "x.txt").write_text("hello\n")
    assert main(["trace", "convert", str(tmp_path / "x.txt"), str(tmp_path / "o.csv")]) == 2
    err = capsys.readouterr().err
    assert "cannot tell the layout" in err and len(err.strip().splitlines()) == 1
    assert main(["trace", "convert", "--from", "route-trace", str(DATA / "esft_law_slice.txt"),
                 str(tmp_path / "o.csv")]) == 2
    err = capsys.readouterr().err
    assert "not a route_trace v1 file" in err and len(err.strip().splitlines()) == 1
    assert main(["trace", "convert", str(DATA / "esft_counts_law.csv"), str(tmp_path / "o.csv"),
                 "--prompt-share", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "marks prompts in a per-token trace" in err and len(err.strip().splitlines()) == 1
