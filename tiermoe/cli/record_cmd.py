"""tiermoe record: run dataset prompts through a hybrid model and write expert activation statistics."""

from __future__ import annotations

import sys
import time

from tiermoe.arch import detect, load_config
from tiermoe.cli.cpu_flags import add_cpu_flags, cpu_from_args
from tiermoe.cli.flags import (
    add_command,
    dtype_flag,
    fraction,
    non_negative_float,
    non_negative_int,
    output_file_new_dirs,
    positive_int,
    running_count,
    seed_int,
)
from tiermoe.cli.placement_flags import add_placement_flags, placement_from_args
from tiermoe.cli.recorder_flags import add_recorder_flags, recorder_from_args
from tiermoe.config import check_device
from tiermoe.data import load_prompts, select
from tiermoe.data.prompts import SPLITS
from tiermoe.data.registry import DATASETS
from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import SamplingParams
from tiermoe.errors import TiermoeError
from tiermoe.fit import check_running_kv
from tiermoe.models import resolve_model
from tiermoe.stats.io import dump_recorder_files


def add_parser(sub) -> None:
    p = add_command(
        sub, "record",
        "Run prompts from a dataset through a hybrid model (batched, chat template applied when the tokenizer has "
        "one) and record which experts every MoE layer routes to. The file feeds `tiermoe place "
        "--init-expert-location` (SGLang's logical_count format) and `tiermoe stats`. Datasets: "
        + ", ".join(DATASETS) + ", or a .json/.jsonl file. Without --out the file goes to "
        "$TIERMOE_EXPERT_DISTRIBUTION_RECORDER_DIR (else $SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR, else /tmp), in "
        "SGLang's layout for the mode; GPU-tier snapshots go beside it as gpu_expert_distribution_*.pt.",
        "tiermoe record --dataset sharegpt --num-prompts 200 --out stats.pt",
        "tiermoe record --model /models/Qwen3-30B-A3B --gpu-device cuda:0 --dataset gsm8k --num-prompts 500 "
        "--max-tokens 256 --out gsm8k.pt",
        "tiermoe record --dataset sharegpt --split train --num-prompts 500 --out train.pt && "
        "tiermoe record --dataset sharegpt --split heldout --num-prompts 100 --out heldout.pt && "
        "tiermoe stats train.pt --eval heldout.pt",
        "tiermoe record --dataset prompts.jsonl --num-prompts 50 --mode per_token --out trace.pt",
        "tiermoe record --dataset gpqa --num-prompts 20 --plan plan.json --record-kt-gpu-expert-distribution "
        "--out run.pt",
    )
    p.add_argument("--model", "--model-path", dest="model", default=None,
                   help="checkpoint directory (default: the bundled demo model)")
    p.add_argument("--gpu-device", "--kt-gpu-device", dest="gpu_device", default="cpu",
                   help="device of the GPU tier and non-expert weights: cuda, cuda:N or cpu (default cpu)")
    p.add_argument("--dtype", type=dtype_flag, default=None, help="bf16, fp32 or fp16 (default: the checkpoint's)")
    p.add_argument("--dataset", required=True, help=f"{', '.join(DATASETS)}, or a .json / .jsonl file")
    p.add_argument("--num-prompts", type=positive_int, required=True, help="prompts to run")
    p.add_argument("--max-tokens", type=positive_int, default=128, help="tokens to generate per prompt (default 128)")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the prompt sample and split (default 0)")
    p.add_argument("--split", choices=SPLITS, default="all",
                   help="all prompts (default), or the train / heldout part of a seeded split by conversation")
    p.add_argument("--heldout-fraction", type=fraction, default=0.1,
                   help="share of conversations in the heldout part (default 0.1)")
    p.add_argument("--min-chars", type=non_negative_int, default=1, help="skip prompts shorter than this")
    p.add_argument("--max-chars", type=positive_int, default=None, help="skip prompts longer than this")
    p.add_argument("--max-prompt-tokens", type=positive_int, default=None,
                   help="skip prompts with more tokens (default: the context length less --max-tokens; at most "
                        "the context length less one)")
    p.add_argument("--batch-size", "--max-running", dest="batch_size", type=running_count, default=16,
                   help="sequences advanced together in one step (default 16; at most 4096, and as many as the "
                        "device's free memory holds 2 tokens of KV cache each)")
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    p.add_argument("--raw", action="store_true", help="feed prompts as plain text, without the chat template")
    p.add_argument("--prefix-cache", action="store_true",
                   help="reuse the KV pages of prompt prefixes earlier prompts computed (off by default, so every "
                        "routed token is recorded once; the dump's run info says which)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.add_argument("--out", type=output_file_new_dirs,
                   help="the statistics file to write (.pt; missing directories are created)")
    add_recorder_flags(p, mode_flags=("--mode",), default_mode="stat", default_buffer_size=-1)
    add_placement_flags(p)
    add_cpu_flags(p)


def run(args) -> int:
    device = check_device(args.gpu_device)
    model_dir = resolve_model(args.model)
    config = load_config(model_dir)
    spec = detect(config)
    check_running_kv(args.batch_size, "--batch-size", config, args.dtype or spec.dtype, device)
    candidates = select(load_prompts(args.dataset), None, args.seed, args.min_chars, args.max_chars, args.split,
                        args.heldout_fraction)
    recorder = recorder_from_args(args, spec)
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                              ignore_eos=args.ignore_eos)
    with LLM(model_dir, gpu_device=device, placement=placement_from_args(args), dtype=args.dtype,
             max_running=args.batch_size, recorder=recorder, progress=args.progress, cpu=cpu_from_args(args),
             prefix_cache=args.prefix_cache) as llm:
        context = llm.engine.max_context or 10**9
        # the engine refuses prompts that fill the context; by default leave room for --max-tokens as well
        limit = max(1, context - args.max_tokens)
        if args.max_prompt_tokens:
            limit = min(args.max_prompt_tokens, context - 1)
        chosen, prompt_ids, skipped = encode_prompts(llm, candidates, args.num_prompts, limit, args.raw)
        if not prompt_ids:
            raise TiermoeError(f"no prompt of '{args.dataset}' ({args.split}) fits in {limit} tokens "
                               f"(of {len(candidates)} after the length filter)")
        if len(prompt_ids) < args.num_prompts:
            print(f"warning: only {len(prompt_ids)} prompts of '{args.dataset}' are usable "
                  f"({skipped} longer than {limit} tokens)", file=sys.stderr)
        outputs = run_prompts(llm, prompt_ids, sampling, args.progress)
    run_info = {"dataset": args.dataset, "split": args.split, "heldout_fraction": args.heldout_fraction,
                "seed": args.seed, "num_prompts": len(prompt_ids), "max_tokens": args.max_tokens,
                "prompt_ids": [p.id for p in chosen], "model_dir": str(model_dir),
                "generated_tokens": sum(len(o.token_ids) for o in outputs),
                "prefix_cache": args.prefix_cache, "prefix_hit_tokens": llm.engine.prefix_hit_tokens}
    path, *masks = dump_recorder_files(recorder, args.out, run_info)
    print(f"wrote {path.resolve()}" + "".join(f" and {m.resolve()}" for m in masks) + ": mode {args.recorder_mode}, {len(prompt_ids)} prompts, "
          f"{sum(len(ids) for ids in prompt_ids)} prompt + {run_info['generated_tokens']} generated tokens"
          + (f" ({skipped} prompts skipped as too long)" if skipped else ""))
    return 0


def encode_prompts(llm, candidates, num: int, max_tokens: int, raw: bool):
    """The first `num` candidates that fit in `max_tokens`: (prompts, their token ids, how many were skipped)."""

    if llm.tokenizer is None:
        raise TiermoeError(f"{llm.model_dir} has no tokenizer; `tiermoe record` needs one to encode prompts")
    use_chat = not raw and bool(getattr(llm.tokenizer, "chat_template", None))
    chosen, ids_list, skipped = [], [], 0
    for prompt in candidates:
        if len(chosen) == num:
            break
        ids = llm.chat_prompt_ids(prompt.chat_messages()) if use_chat and prompt.is_chat else llm.encode(
            prompt.plain_text())
        if not ids or len(ids) > max_tokens:
            skipped += 1
            continue
        chosen.append(prompt)
        ids_list.append(ids)
    return chosen, ids_list, skipped


def run_prompts(llm, prompt_ids: list[list[int]], sampling, progress: bool = True):
    """Generate for all prompts (the engine batches them) with a progress bar: prompts done, tokens/s."""
    from tqdm import tqdm

    bar = tqdm(total=len(prompt_ids), unit="prompt", desc="record", disable=not progress, file=sys.stderr)
    start, tokens = time.perf_counter(), 0

    def on_step(produced) -> None:
        nonlocal tokens
        for seq in produced:
            # a sequence's first output token means its whole prompt went through the model
            tokens += 1 + (len(seq.prompt_ids) if len(seq.output_ids) == 1 else 0)
        done = sum(seq.finished for seq in produced)
        if done:
            bar.update(done)
        bar.set_postfix_str(f"{tokens / max(1e-9, time.perf_counter() - start):.0f} tok/s", refresh=False)

    try:
        return llm.generate(prompt_ids, sampling, on_step=on_step)
    finally:
        bar.close()
