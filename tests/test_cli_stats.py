"""`tiermoe record` and `tiermoe stats`, and statistics files: tiermoe's feed the placement planner, SGLang's and
KTransformers' load too, several merge, another model's are refused with one clear error."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import save_char_tokenizer, save_tiny

from tiermoe.cli.main import main
from tiermoe.errors import TiermoeError
from tiermoe.routing.summary import snapshot_check, total_variation
from tiermoe.stats.io import load_counts, load_stats, recorder_output_dir, save_stats

# tiny qwen3_moe: 3 layers (layer 1 dense), 8 experts, top-2
L, E, MOE = 3, 8, (0, 2)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = save_tiny("qwen3_moe", tmp_path_factory.mktemp("model"))
    save_char_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    lines = [{"messages": [{"role": "user", "content": f"Question {i}: what is {i} plus {i + 1}?"}]} for i in range(8)]
    lines += [{"prompt": "x" * 400}]  # longer than the tiny model's context: skipped
    path.write_text("\n".join(json.dumps(x) for x in lines))
    return path


def cli(capsys, *args) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def recorded(model, prompts_file, tmp_path_factory):
    """One `tiermoe record` run shared by the tests that only read its file."""
    out = tmp_path_factory.mktemp("rec") / "stats.pt"
    code = main(["record", "--model", str(model), "--dataset", str(prompts_file), "--num-prompts", "9",
                 "--max-tokens", "5", "--batch-size", "3", "--ignore-eos", "--no-progress", "--out", str(out)])
    assert code == 0
    return out


def test_record_writes_sglang_logical_count_with_metadata(recorded):
    data = torch.load(recorded, weights_only=True)
    assert data["logical_count"].shape[1:] == (L, E) and data["logical_count"].dtype == torch.int32
    assert data["logical_count"].shape[0] == data["num_passes"] and data["average_utilization_rate_over_window"] is None
    assert int(data["logical_count"][:, 1].sum()) == 0  # the dense layer
    assert (data["model_type"], data["num_layers"], data["num_experts"], data["top_k"]) == ("qwen3_moe", L, E, 2)
    assert data["moe_layers"] == list(MOE) and data["tiermoe_version"] and data["mode"] == "stat"
    assert data["run"]["num_prompts"] == 8 and len(data["run"]["prompt_ids"]) == 8  # the long prompt skipped
    tokens = data["num_prefill_tokens"] + data["num_decode_tokens"]
    assert data["num_decode_tokens"] == 8 * 4
    assert int(data["logical_count"].sum()) == tokens * 2 * len(MOE)


def test_a_recorded_file_feeds_init_expert_location(capsys, model, recorded, tmp_path):
    code, out, err = cli(capsys, "place", "--model", model, "--strategy", "frequency", "--init-expert-location",
                         recorded, "--num-gpu-experts", "2", "--json", "--out", tmp_path / "plan.json")
    assert code == 0, err
    result = json.loads(out)
    counts = load_counts(recorded, L, E)
    # frequency = the global top-4 (2 per MoE layer x 2 layers) of the recorded counts
    assert result["expected_hit_rate"] == pytest.approx(float(counts.flatten().sort().values[-4:].sum() / counts.sum()))
    assert result["expected_hit_rate"] > 0.25  # 4 of 16 routed experts: above a uniform share


def test_stats_reports_layers_split_and_strategy_hit_rates(capsys, recorded, tmp_path):
    code, out, err = cli(capsys, "stats", recorded, "--json", "--plot", tmp_path / "stats.png")
    assert code == 0, err
    r = json.loads(out)
    assert [row["layer"] for row in r["layers"]] == list(MOE)
    for row in r["layers"]:
        assert 0 <= row["gini"] < 1 and 0 < row["top10_share"] <= row["top20_share"] <= 1
        assert {"prefill_gini", "decode_gini", "prefill_decode_tv", "dead_experts"} <= set(row)
    assert r["routed_per_token_per_layer"] == pytest.approx(2.0)
    rates = r["hit_rates"]["strategies"]
    assert set(rates) == {"uniform", "front-loading", "random", "frequency", "balanced"}
    assert r["hit_rates"]["ratios"] == pytest.approx([0.1 * i for i in range(1, 10)])
    # in-sample, frequency placement is the best possible mask of its size
    assert all(rates["frequency"][i] >= max(v[i] for v in rates.values()) - 1e-12 for i in range(9))
    assert (tmp_path / "stats.png").stat().st_size > 10_000
    code, table, _ = cli(capsys, "stats", recorded)
    assert "gini" in table and "frequency" in table and "TV prefill/decode" in table


def sglang_dump(path, counts_BLE):
    """What SGLang's stat recorder writes on /dump_expert_distribution_record (rank 0)."""
    torch.save({"rank": 0, "logical_count": counts_BLE.to(torch.int32),
                "average_utilization_rate_over_window": None}, path)
    return path


def test_sglang_and_ktransformers_files_load_and_merge(capsys, model, tmp_path):
    counts = torch.zeros(4, L, E, dtype=torch.int64)  # a circular buffer of 4 passes, one still empty
    counts[0, 0, :3] = torch.tensor([5, 1, 0])
    counts[1, 2, 7] = 9
    counts[2, 0, 0] = 2
    sglang = sglang_dump(tmp_path / "expert_distribution_recorder_1730000000.0.pt", counts)
    kt = tmp_path / "activation_stats.pt"
    activation = torch.arange(L * E, dtype=torch.int64).reshape(L, E) * torch.tensor([1, 0, 1])[:, None]
    torch.save({"activation_counts": activation, "logical_count": activation[None], "num_layers": L,
                "num_experts": E, "num_samples": 10}, kt)

    one = load_stats(sglang, L, E)
    assert one.counts_LE.tolist() == counts.sum(0).double().tolist() and one.moe_layers == (0, 2)
    assert one.kinds == ("sglang stat",) and not one.has_split
    both = load_stats([sglang, kt], L, E)
    assert torch.equal(both.counts_LE, counts.sum(0).double() + activation.double())
    assert both.kinds == ("sglang stat", "ktransformers activation_stats")
    code, out, err = cli(capsys, "stats", sglang, kt, "--json")
    assert code == 0, err
    assert json.loads(out)["routed"] == float(both.counts_LE.sum())
    code, out, err = cli(capsys, "place", "--model", model, "--strategy", "frequency", "--init-expert-location",
                         sglang, "--num-gpu-experts", "1", "--json")
    assert code == 0, err
    assert json.loads(out)["plan"]["assignment"][0][0] == 0 and json.loads(out)["plan"]["assignment"][2][7] == 0


def test_a_stats_file_from_another_model_is_one_clear_error(capsys, model, recorded, tmp_path):
    other = sglang_dump(tmp_path / "other.pt", torch.ones(2, 5, 4))
    with pytest.raises(TiermoeError) as err:
        load_stats(other, L, E)
    assert "[buf, 5, 4]" in str(err.value) and f"[buf, {L}, {E}]" in str(err.value)
    code, _, stderr = cli(capsys, "stats", recorded, other)
    assert code == 2 and stderr.count("\n") == 1 and "[buf, 5, 4]" in stderr and f"[buf, {L}, {E}]" in stderr
    code, _, stderr = cli(capsys, "place", "--model", model, "--strategy", "frequency", "--num-gpu-experts", "1",
                          "--init-expert-location", other)
    assert code == 2 and stderr.startswith("error:") and "[2, 5, 4]" in stderr


@pytest.mark.parametrize("dataset, fragment", [
    ("broken.jsonl", "line 1 is not valid JSON"),
    ("sharegtp", "unknown dataset 'sharegtp'"),
])
def test_record_bad_dataset_is_one_line_error(capsys, model, tmp_path, dataset, fragment):
    (tmp_path / "broken.jsonl").write_text('{"prompt": \n')
    arg = tmp_path / dataset if dataset.endswith(".jsonl") else dataset
    code, _, err = cli(capsys, "record", "--model", model, "--dataset", arg, "--num-prompts", "2", "--no-progress")
    assert code == 2 and err.startswith("error:") and fragment in err and err.count("\n") == 1


def test_dump_goes_to_the_recorder_dir(capsys, model, prompts_file, tmp_path, monkeypatch):
    assert recorder_output_dir({"TIERMOE_EXPERT_DISTRIBUTION_RECORDER_DIR": "/a",
                                "SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR": "/b"}) == type(tmp_path)("/a")
    assert recorder_output_dir({"SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR": "/b"}) == type(tmp_path)("/b")
    assert recorder_output_dir({}) == type(tmp_path)("/tmp")  # SGLang's default
    monkeypatch.delenv("TIERMOE_EXPERT_DISTRIBUTION_RECORDER_DIR", raising=False)
    monkeypatch.setenv("SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR", str(tmp_path / "sglang"))
    code, out, err = cli(capsys, "record", "--model", model, "--dataset", prompts_file, "--num-prompts", "2",
                         "--max-tokens", "2", "--mode", "per_pass", "--no-progress")
    assert code == 0, err
    written = list((tmp_path / "sglang").glob("expert_distribution_recorder_*.pt"))
    assert len(written) == 1 and str(written[0]) in out and written[0].name.endswith("_0.pt")  # SGLang: _{rank}
    data = torch.load(written[0], weights_only=True)
    assert data["mode"] == "per_pass" and len(data["records"]) == data["num_passes"]
    stats = load_stats(written[0], L, E)  # per_pass: the split comes from the passes that are wholly one phase
    assert stats.has_split and float(stats.counts_LE.sum()) == data["num_tokens"] * 2 * len(MOE)


def test_heldout_evaluation_and_gpu_snapshot_check(capsys, model, prompts_file, tmp_path):
    common = ["record", "--model", model, "--dataset", prompts_file, "--max-tokens", "3", "--no-progress",
              "--heldout-fraction", "0.5"]
    assert cli(capsys, *common, "--split", "train", "--num-prompts", "8", "--out", tmp_path / "train.pt")[0] == 0
    assert cli(capsys, *common, "--split", "heldout", "--num-prompts", "8", "--out", tmp_path / "held.pt")[0] == 0
    train = torch.load(tmp_path / "train.pt", weights_only=True)["run"]["prompt_ids"]
    held = torch.load(tmp_path / "held.pt", weights_only=True)["run"]["prompt_ids"]
    assert train and held and not set(train) & set(held)
    code, out, err = cli(capsys, "stats", tmp_path / "train.pt", "--eval", tmp_path / "held.pt", "--json")
    assert code == 0, err
    assert json.loads(out)["hit_rates"]["evaluated_on"] == [str(tmp_path / "held.pt")]

    assert cli(capsys, "place", "--model", model, "--num-gpu-experts", "3", "--out", tmp_path / "plan.json")[0] == 0
    code, _, err = cli(capsys, *common, "--num-prompts", "2", "--plan", tmp_path / "plan.json",
                       "--record-kt-gpu-expert-distribution", "--out", tmp_path / "run.pt")
    assert code == 0, err
    code, out, err = cli(capsys, "stats", tmp_path / "run.pt", "--plan", tmp_path / "plan.json", "--json")
    assert code == 0, err
    check = json.loads(out)["gpu_masks"]["plan_check"]
    assert check["passes"] > 0 and check["matching"] == check["passes"]


def test_snapshot_check_names_the_first_mismatch_and_tv_distance():
    plan = torch.zeros(2, 4, dtype=torch.bool)
    plan[1, 0] = True
    masks = plan[None].repeat(3, 1, 1)
    masks[2, 1, 3] = True
    check = snapshot_check(masks, plan)
    assert check["matching"] == 2 and check["first_mismatch"] == {
        "pass": 2, "layer": 1, "recorded_gpu_experts": [0, 3], "planned_gpu_experts": [0]}
    assert total_variation(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 3.0])) == 1.0
    assert total_variation(torch.tensor([2.0, 2.0]), torch.tensor([1.0, 1.0])) == 0.0


def test_save_stats_refuses_a_non_dump(tmp_path):
    with pytest.raises(ValueError):
        save_stats({"counts": torch.zeros(2, 2)}, tmp_path / "x.pt")
