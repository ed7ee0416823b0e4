"""`tiermoe finetune` on a tiny make-model checkpoint: what it writes, a resumed run identical to an uninterrupted
one, gradient checkpointing and the CPU tier's span as the flags set them, KT's variables under the flags, and
one-line errors for bad values."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from safetensors.torch import load_file
from test_cli_bad_input import assert_one_line_error

from tiermoe.cli.finetune_run import config_from_args
from tiermoe.cli.main import build_parser
from tiermoe.config import PlacementConfig
from tiermoe.errors import TiermoeError
from tiermoe.layers.hybrid_moe import HybridMoE
from tiermoe.testing.make_model import make_model
from tiermoe.training import finetune
from tiermoe.training.finetune import FinetuneConfig, FinetuneHooks, run_finetune
from tiermoe.training.sft_loop import train_steps


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model dir, dataset file): a tiny qwen3_moe with a byte-level ChatML tokenizer, 24 arithmetic chats."""
    root = tmp_path_factory.mktemp("finetune")
    model = make_model("qwen3_moe", root / "model", dtype=torch.float32, progress=False, tokenizer=True)
    rows = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"what is {i} plus {i}?"},
                                         {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}]}
            for i in range(24)]
    data = root / "chats.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return model, data


def adapter_tensors(out: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(out.glob("*.safetensors")):
        tensors.update({f"{path.name}:{k}": v for k, v in load_file(path).items()})
    assert tensors
    return tensors


def config(tiny, out: Path, **changes) -> FinetuneConfig:
    model, data = tiny
    settings = {"dataset": str(data), "out_dir": out, "steps": 4, "lora_rank": 4, "model": model, "batch_size": 3,
                "max_length": 48, "save_every": 2, "progress": False}
    return FinetuneConfig(**{**settings, **changes})


# LoRA on attention, the routers and every routed expert; and attention only, with dropout (random every step)
RUNS = {"all-linear": {}, "dropout": {"lora_dropout": 0.2, "lora_targets": ("q_proj", "k_proj", "v_proj", "o_proj"),
                                      "expert_lora": False}}


@pytest.mark.parametrize("run", RUNS)
def test_a_resumed_run_equals_the_uninterrupted_one(tiny, tmp_path, run):
    straight = run_finetune(config(tiny, tmp_path / "straight", **RUNS[run]))

    def stop_at_step_3(record):
        if record.step == 3:  # checkpoint 2 is on disk, step 3's update is lost
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        run_finetune(config(tiny, tmp_path / "stopped", **RUNS[run]), FinetuneHooks(step=stop_at_step_3))
    resumed = run_finetune(config(tiny, tmp_path / "stopped", resume=True, **RUNS[run]))

    assert resumed.resumed_from == 2
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in straight.history]  # dropout too
    assert resumed.heldout_before == straight.heldout_before and resumed.heldout_after == straight.heldout_after
    ours, theirs = adapter_tensors(tmp_path / "stopped"), adapter_tensors(tmp_path / "straight")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert straight.history[-1]["loss"] != straight.history[0]["loss"]  # it trained


def test_resume_needs_the_same_settings_and_a_checkpoint(tiny, tmp_path):
    run_finetune(config(tiny, tmp_path / "run", steps=1))
    with pytest.raises(TiermoeError, match="already holds checkpoints"):
        run_finetune(config(tiny, tmp_path / "run", steps=1))
    with pytest.raises(TiermoeError, match="made with lora_rank 4, this run has 8"):
        run_finetune(config(tiny, tmp_path / "run", steps=3, lora_rank=8, resume=True))
    with pytest.raises(TiermoeError, match="at step 1; --steps 1 leaves nothing to do"):
        run_finetune(config(tiny, tmp_path / "run", steps=1, resume=True))
    with pytest.raises(TiermoeError, match="holds no checkpoint"):
        run_finetune(config(tiny, tmp_path / "empty", resume=True))
    said = []  # memory settings may change on resume: they change memory and time, not the adapter
    run_finetune(config(tiny, tmp_path / "run", steps=2, resume=True, gradient_checkpointing=True, expert_chunk=16),
                 FinetuneHooks(message=said.append))
    assert any("resuming with gradient_checkpointing True (the checkpoint's run had False)" in m for m in said)
    settings = json.loads((tmp_path / "run" / "metrics.json").read_text())["settings"]
    assert (settings["gradient_checkpointing"], settings["expert_chunk"]) == (True, 16)


def test_the_command_writes_adapter_checkpoints_metrics_and_plot(tiny, tmp_path):
    model, data = tiny
    out = tmp_path / "out"
    result = run_cli("finetune", "--model", str(model), "--dataset", str(data), "--lora-rank", "2", "--steps", "3",
                     "--save-every", "1", "--keep-checkpoints", "2", "--eval-every", "2", "--max-length", "40",
                     "--batch-size", "2", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "held-out loss on reply tokens (1 held-out conversations of the dataset):" in result.stdout
    assert "finetune" in result.stderr and "tok_s=" in result.stderr  # the progress bar
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-0000002", "checkpoint-0000003"]
    metrics = json.loads((out / "metrics.json").read_text())
    assert [e["step"] for e in metrics["evals"]] == [0, 2, 3] and len(metrics["history"]) == 3
    assert metrics["settings"]["lora_alpha"] == 4.0  # 2 x rank
    assert (out / "loss_curve.png").stat().st_size > 1000
    assert (out / "adapter_config.json").is_file() and (out / "checkpoint-0000003" / "adapter_config.json").is_file()
    adapter_tensors(out)
    served = run_cli("generate", "--model", str(model), "--lora", str(out), "--prompt", "what is 2 plus 2?",
                     "--max-tokens", "3", "--temperature", "0")
    assert served.returncode == 0, served.stderr


def parse(*argv: str):
    return build_parser("finetune").parse_args(["finetune", *argv])


def one_step_seen(tiny, out: Path, monkeypatch, *flags: str) -> dict:
    """One optimizer step of the run the flags describe: its loss, the adapters' gradients (no clipping), each MoE
    block's calls during the step and the CPU tier's span the blocks use."""
    model, data = tiny
    cfg, _, _ = config_from_args(parse("--model", str(model), "--dataset", str(data), "--steps", "1", "--out",
                                       str(out), "--lora-rank", "4", "--batch-size", "3", "--max-length", "48",
                                       "--max-grad-norm", "0", *flags))
    seen = {"calls": 0}

    def observed_steps(model, *args, **kwargs):
        blocks = [m for m in model.modules() if isinstance(m, HybridMoE)]
        hooks = [b.register_forward_pre_hook(lambda *a: seen.update(calls=seen["calls"] + 1)) for b in blocks]
        seen["chunks"] = {b.expert_chunk for b in blocks}
        train_steps(model, *args, **kwargs)
        for h in hooks:
            h.remove()
        seen["grads"] = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        seen["blocks"] = len(blocks)

    monkeypatch.setattr(finetune, "train_steps", observed_steps)
    result = run_finetune(dataclasses.replace(cfg, progress=False))
    seen["loss"] = result.history[0]["loss"]
    return seen


def test_gradient_checkpointing_and_the_expert_chunk_are_what_the_flags_say(tiny, tmp_path, monkeypatch):
    """--gradient-checkpointing recomputes every MoE block in backward (each is called twice in the step) and gives
    the loss and every adapter gradient of the run without it (fp32, 1e-6 per tensor); --expert-chunk is the span
    every block computes its CPU tier in."""
    plain = one_step_seen(tiny, tmp_path / "plain", monkeypatch, "--expert-chunk", "8")
    checkpointed = one_step_seen(tiny, tmp_path / "ckpt", monkeypatch, "--expert-chunk", "8",
                                 "--gradient-checkpointing")
    assert plain["blocks"] > 0 and plain["calls"] == plain["blocks"] and checkpointed["calls"] == 2 * plain["calls"]
    assert plain["chunks"] == checkpointed["chunks"] == {8}
    assert abs(checkpointed["loss"] - plain["loss"]) <= 1e-6 * abs(plain["loss"])
    grads = plain["grads"]
    assert any("lora_experts" in n for n in grads) and grads.keys() == checkpointed["grads"].keys()
    for n, g in grads.items():
        assert (checkpointed["grads"][n] - g).norm() <= 1e-6 * g.norm(), n


def test_kt_variables_fill_what_the_flags_leave(tiny, monkeypatch):
    model, data = tiny
    base = ("--model", str(model), "--dataset", str(data), "--steps", "5", "--out", "x")
    monkeypatch.setenv("ACCELERATE_KT_LORA_RANK", "6")
    monkeypatch.setenv("ACCELERATE_KT_NUM_GPU_EXPERTS", "2")
    monkeypatch.setenv("ACCELERATE_KT_EXPERT_WEIGHT_FORMAT", "int8")
    monkeypatch.setenv("ACCELERATE_KT_MODEL_MAX_LENGTH", "100")
    monkeypatch.setenv("ACCELERATE_KT_MAX_CACHE_DEPTH", "2")
    cfg, notes, _ = config_from_args(parse(*base))
    assert (cfg.lora_rank, cfg.alpha, cfg.max_length, cfg.cpu.expert_dtype) == (6, 12.0, 100, "int8")
    assert cfg.placement == PlacementConfig(strategy="uniform", num_gpu_experts=2)  # KT: first n of each layer
    assert len(notes) == 1 and "MAX_CACHE_DEPTH" in notes[0]
    cfg, _, _ = config_from_args(parse(*base, "--lora-rank", "3", "--num-gpu-experts", "1", "--cpu-expert-dtype",
                                       "bf16", "--max-length", "50", "--init-expert-location", "s.pt"))
    assert (cfg.lora_rank, cfg.alpha, cfg.max_length, cfg.cpu.expert_dtype) == (3, 6.0, 50, "bf16")
    assert cfg.placement.strategy == "frequency" and cfg.placement.num_gpu_experts == 1
    cfg, _, _ = config_from_args(parse(*base, "--num-gpu-experts", "0"))  # the flag's 0 wins over KT's 2
    assert cfg.placement == PlacementConfig(num_gpu_experts=0)
    assert (cfg.gradient_checkpointing, cfg.expert_chunk) == (False, 4096)  # the defaults
    # KT's activation policy: gpu=recompute is gradient checkpointing; cpu=retain has nothing to act on here
    monkeypatch.setenv("ACCELERATE_KT_ACTIVATION_POLICY", '{"cpu": "retain", "gpu": "recompute"}')
    cfg, notes, _ = config_from_args(parse(*base))
    assert cfg.gradient_checkpointing and any("cpu=retain" in n and "no effect" in n for n in notes)
    cfg, _, _ = config_from_args(parse(*base, "--no-gradient-checkpointing"))  # the flag wins
    assert not cfg.gradient_checkpointing
    monkeypatch.setenv("ACCELERATE_KT_ACTIVATION_POLICY", '{"cpu": "recompute", "gpu": "retain"}')
    cfg, notes, _ = config_from_args(parse(*base, "--expert-chunk", "0"))
    assert not cfg.gradient_checkpointing and cfg.expert_chunk == 0
    assert not any("ACTIVATION_POLICY" in n for n in notes)


@pytest.mark.parametrize("argv, env, fragment", [
    (("--steps", "0"), {}, "expected a positive integer"),
    (("--steps", "100000000"), {}, "expected optimizer steps between 1 and 10,000,000"),
    (("--batch-size", "5000"), {}, "expected conversations per step between 1 and 4,096"),
    (("--lora-rank", "0"), {}, "expected a positive integer"),
    (("--lora-rank", "5000"), {}, "expected a LoRA rank between 1 and 4,096"),
    (("--lora-dropout", "1"), {}, "expected a dropout probability in [0, 1)"),
    (("--lr", "2"), {}, "expected a learning rate in (0, 1]"),
    (("--lr", "nan"), {}, "expected a finite number"),
    (("--cpu-threads", "100000"), {}, "this machine has"),
    (("--max-length", "100000"), {}, "beyond the model's"),
    (("--num-gpus", "2"), {}, "--num-gpus must be 1"),
    (("--lora-dropout", "0.1"), {}, "LoRA dropout does not go with LoRA on the routed experts"),
    (("--lora-dropout", "0.1", "--no-expert-lora", ""), {}, "LoRA dropout needs module targets"),
    ((), {"ACCELERATE_KT_TRAIN_MODE": "full"}, "full-weight training is not implemented"),
    ((), {"ACCELERATE_KT_LORA_RANK": "x"}, "ACCELERATE_KT_LORA_RANK='x': expected an integer"),
    ((), {"ACCELERATE_KT_NUM_GPU_EXPERT": "2"}, "unknown KTransformers setting ACCELERATE_KT_NUM_GPU_EXPERT"),
    (("--dataset", "alpaca"), {}, "unknown dataset 'alpaca'"),
    (("--expert-chunk", "-1"), {}, "expected an integer >= 0"),
    (("--expert-chunk", "2e3"), {}, "'2e3' is not an integer"),
    (("--expert-chunk", "100000000"), {}, "expected an expert chunk between 0 and 16,777,216 tokens"),
    ((), {"ACCELERATE_KT_ACTIVATION_POLICY": "recompute"},
     "ACCELERATE_KT_ACTIVATION_POLICY='recompute': expected a JSON object with exactly the keys cpu and gpu"),
    ((), {"ACCELERATE_KT_ACTIVATION_POLICY": '{"cpu": "retain", "gpu": "keep"}'}, '"retain" or "recompute"'),
])
def test_bad_values_are_one_line_errors(tiny, tmp_path, monkeypatch, argv, env, fragment):
    model, data = tiny
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    flags = {"--model": str(model), "--dataset": str(data), "--steps": "2", "--out": str(tmp_path / "o"),
             "--lora-rank": "2"}
    for i in range(0, len(argv), 2):
        flags[argv[i]] = argv[i + 1]
    if "ACCELERATE_KT_LORA_RANK" in env:
        del flags["--lora-rank"]
    assert_one_line_error(run_cli("finetune", *[x for kv in flags.items() for x in kv if x]), fragment)  # "": a switch


def test_the_lora_rank_is_required(tiny, tmp_path):
    model, data = tiny
    result = run_cli("finetune", "--model", str(model), "--dataset", str(data), "--steps", "2", "--out",
                     str(tmp_path / "o"))
    assert_one_line_error(result, "--lora-rank is required (or set ACCELERATE_KT_LORA_RANK)")
