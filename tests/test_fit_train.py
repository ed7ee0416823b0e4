"""`tiermoe fit --train`: the longest LoRA training context in a host-memory budget, printed with its terms. The
terms themselves are measured by tiermoe.training.context_memory (checked against a real step's allocations in
tests/test_training_memory.py); here the command's arithmetic, what it passes on, and its one-line errors."""

from __future__ import annotations

import json
import shlex

import pytest
import torch
from conftest import run_cli

from tiermoe.cli import fit_train_run
from tiermoe.cli.main import build_parser
from tiermoe.fit import model_bytes
from tiermoe.training.context_memory import ADAPTER_BYTES_PER_PARAM, ContextMemory

GIB = 1 << 30


def _terms(**kw) -> ContextMemory:
    return ContextMemory(**{"baseline": GIB // 2, "tiers": 4 * GIB, "adapter_params": 1_000_000,
                            "per_token_layer": 1000.0, "per_token_rest": 50_000.0, "layers": 2,
                            "span_per_token": 100.0, "expert_chunk": 4096, "fixed_step": GIB // 4, **kw})


def test_the_longest_context_is_what_is_left_over_the_per_token_bytes():
    terms = _terms()
    fixed = GIB // 2 + 4 * GIB + 1_000_000 * ADAPTER_BYTES_PER_PARAM + GIB // 4 + 100 * 4096
    assert terms.per_token == 52_000 and terms.fixed == fixed
    assert terms.longest_context(24 * GIB) == (24 * GIB - fixed) // 52_000
    assert terms.longest_context(GIB) == 0  # the weights alone do not fit


def test_fit_train_prints_every_term_and_the_longest_context(tiny_dir, monkeypatch):
    path = tiny_dir("qwen3_moe")
    seen = {}

    def measured(cfg, tiers, dtype, cpu_format, rank, expert_chunk):
        seen.update(tiers=tiers, rank=rank, expert_chunk=expert_chunk)
        return _terms(tiers=tiers, expert_chunk=expert_chunk)

    monkeypatch.setattr(fit_train_run, "context_memory", measured)
    done = run_cli("fit", "--model", str(path), "--train", "--ram-gb", "24", "--lora-rank", "8", "--expert-chunk", "64")
    assert done.returncode == 0, done.stderr
    m = model_bytes(path)
    assert seen == {"tiers": m.non_expert + m.total_experts * m.cpu_bytes_per_expert + m.load_buffer, "rank": 8,
                    "expert_chunk": 64}
    longest = _terms(tiers=seen["tiers"], expert_chunk=64).longest_context(24 * GIB)
    for row in ("baseline", "tiers", "adapter + AdamW state", "CPU-tier spans", "per token"):
        assert f"train: {row}" in done.stdout
    lines = [line.split() for line in done.stdout.splitlines()]
    assert f"train: longest context   {longest:,} tokens in 24.00 GiB".split() in lines
    limit = json.loads((path / "config.json").read_text())["max_position_embeddings"]
    assert ("train: the model's own limit" in done.stdout) == (longest > limit)  # said when memory is not the bound
    # the finetune command that trains at the predicted length, as tiermoe finetune parses it
    command = next(line for line in done.stdout.splitlines() if line.startswith("train it with"))
    argv = shlex.split(command.removeprefix("train it with").strip())
    assert argv[:2] == ["tiermoe", "finetune"] and argv[argv.index("--steps") + 1] == "N"  # the user's choices
    argv[argv.index("--steps") + 1] = "100"
    args = build_parser("finetune").parse_args(argv[1:])
    assert (args.model, args.lora_rank, args.batch_size, args.max_length, args.num_gpu_experts) == \
        (str(path), 8, 1, min(longest, limit), 0)
    assert args.gradient_checkpointing is True and args.expert_chunk == 64 and args.dtype == torch.float32


@pytest.mark.parametrize("args, fragment", [
    (("--lora-rank", "8"), "give --train too"),
    (("--expert-chunk", "8"), "give --train too"),
    (("--train", "--lora-rank", "0"), "positive integer"),
    (("--train", "--expert-chunk", "-1"), ">= 0"),
    (("--train", "--expert-chunk", "100000000"), "between 0 and 16,777,216 tokens"),  # finetune's bound too
    (("--train", "--lora-rank", "100000"), "largest rank"),
])
def test_bad_training_flags_are_one_line_errors(tiny_dir, args, fragment):
    done = run_cli("fit", "--model", str(tiny_dir("qwen3_moe")), *args)
    assert done.returncode != 0
    error = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(error) == 1 and fragment in error[0], done.stderr
