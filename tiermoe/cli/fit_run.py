"""tiermoe fit's run: the model's bytes from its headers (or its config alone) against the GPU and host memory
given; status 1 when something does not fit."""

from __future__ import annotations

from tiermoe.bundled import resolve_model
from tiermoe.cli.fit_train_run import run_train
from tiermoe.errors import TiermoeError
from tiermoe.fit import fit_report, model_bytes


def run(args) -> int:
    if not args.train and (args.lora_rank is not None or args.expert_chunk is not None):
        raise TiermoeError("--lora-rank and --expert-chunk size a training step: give --train too")
    if args.train:
        return run_train(args)
    if args.head_dtype is not None and args.non_expert_dtype is None:
        raise TiermoeError("--head-dtype counts a packed LM head: give --non-expert-dtype too")
    model = model_bytes(resolve_model(args.model), args.dtype, args.cpu_expert_dtype, args.non_expert_dtype,
                        args.head_dtype)
    report = fit_report(model, args.gpu_experts, args.max_total_tokens, args.gpu_prefill_buffer_gb,
                        args.gpu_memory_gb, args.ram_gb, args.max_running_requests)
    print(report.describe())
    return 0 if not report.problems() else 1
