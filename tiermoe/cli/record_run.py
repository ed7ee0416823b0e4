"""tiermoe record's run: prompts of a dataset through the model, batched, with the recorder on; the file it
writes feeds `tiermoe place --init-expert-location` and `tiermoe stats`."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

from tiermoe.arch import detect, load_config
from tiermoe.bundled import resolve_model
from tiermoe.cli.cpu_flags import cpu_from_args
from tiermoe.cli.extras import require_dataset_extra
from tiermoe.cli.placement_args import placement_from_args
from tiermoe.cli.recorder_args import recorder_from_args
from tiermoe.config import check_device
from tiermoe.data import load_prompts, select
from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import SamplingParams
from tiermoe.errors import TiermoeError
from tiermoe.fit import check_running_kv
from tiermoe.stats.io import dump_recorder_files


def run(args) -> int:
    require_dataset_extra(args.dataset, "tiermoe record")  # before a model loads, not after
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
    print(f"wrote {path.resolve()}" + "".join(f" and {m.resolve()}" for m in masks)
          + f": mode {args.recorder_mode}, {len(prompt_ids)} prompts, "
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
