"""tiermoe generate's run: load, stream one reply to stdout, then one speed line on stderr (llama.cpp's habit),
so a pipe of the reply stays clean. `--verbose` adds the load time and where the experts are."""

from __future__ import annotations

import sys
import time

from tiermoe.arch import detect, load_config
from tiermoe.bundled import resolve_model
from tiermoe.cli.cpu_flags import cpu_from_args
from tiermoe.cli.lora_args import lora_from_args
from tiermoe.cli.placement_args import check_fit_from_args, plan_from_args
from tiermoe.cli.placement_flags import dynamic_from_args
from tiermoe.cli.prompt_input import prompt_from
from tiermoe.cli.recorder_args import recorder_from_args
from tiermoe.cli.speculative_args import speculative_from_args
from tiermoe.cli.speed_line import speed_line
from tiermoe.config import check_device
from tiermoe.engine.llm import LLM
from tiermoe.engine.text_stream import TextStream
from tiermoe.layers.decode_attention import check_attention_backend
from tiermoe.stats.io import dump_recorder_files


def run(args) -> int:
    text = prompt_from(args.prompt_words, args.prompt, sys.stdin)  # before anything loads: a missing prompt is quick
    check_attention_backend(args.attention_backend)
    dynamic = dynamic_from_args(args)  # contradicting placement flags fail before anything loads
    device = check_device(args.gpu_device)
    recorder = recorder_from_args(args, detect(load_config(resolve_model(args.model))))
    lora = lora_from_args(args)
    started = time.perf_counter()
    plan = plan_from_args(args, device)
    check_fit_from_args(args, plan, device)
    llm = LLM(args.model, gpu_device=device, placement=plan, dynamic=dynamic, recorder=recorder,
              cpu=cpu_from_args(args), lora=lora, attention_backend=args.attention_backend,
              speculative=speculative_from_args(args))
    load_s = time.perf_counter() - started
    lora = None  # merged into the weights now: its factors (GBs for a large model) need not stay
    with llm:
        if args.verbose:
            print(f"loaded {llm.model_dir} in {load_s:.2f} s; {placement_line(llm, device)}", file=sys.stderr)
        # what the flags leave out comes from the checkpoint's generation_config.json, as in vLLM and SGLang
        sampling = llm.default_sampling(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                        top_k=args.top_k, seed=args.seed)
        use_chat = not args.raw and llm.tokenizer is not None and getattr(llm.tokenizer, "chat_template", None)
        if use_chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            prompt = llm.chat_prompt_ids(messages + [{"role": "user", "content": text}])
        else:
            prompt = text
        streams: dict[int, TextStream] = {}
        first_token_at: list[float] = []  # when the first generated token came back

        def stream(produced):
            for seq in produced:
                if seq.output_ids and not first_token_at:
                    first_token_at.append(time.perf_counter())
                if llm.tokenizer is None:
                    continue
                shown = streams.get(seq.seq_id) or streams.setdefault(
                    seq.seq_id, TextStream(llm.engine.decoded_text(seq), sampling.stop))
                sys.stdout.write(shown.delta(seq.output_ids, seq.finished, seq.stop_text_end))  # a few ids decoded
                sys.stdout.flush()

        asked = time.perf_counter()
        result = llm.generate(prompt, sampling, on_step=stream)[0]
        done = time.perf_counter()
        if llm.tokenizer is None:
            print(" ".join(map(str, result.token_ids)), end="")
        print(flush=True)
    first = first_token_at[0] if first_token_at else done
    print(speed_line(len(result.prompt_token_ids), first - asked, max(0, len(result.token_ids) - 1), done - first),
          file=sys.stderr, flush=True)
    if recorder.enabled:
        print(f"expert distribution written to {' and '.join(map(str, dump_recorder_files(recorder)))}",
              file=sys.stderr)
    return 0


def placement_line(llm: LLM, device: str) -> str:
    """Where the routed experts are and what each tier holds, e.g. "GPU tier (cpu) 12 of 96 routed experts,
    1.2 MB; CPU tier 84, 8.4 MB; non-expert weights 20.1 MB"."""
    spec, mask = llm.hybrid.spec, llm.placement
    total = len(spec.moe_layers) * spec.num_experts
    gpu = int(mask.sum())
    held = llm.hybrid.tier_bytes()
    return (f"GPU tier ({device}) {gpu} of {total} routed experts, {held.gpu_experts / 1e6:,.1f} MB; CPU tier "
            f"{total - gpu}, {held.cpu_experts / 1e6:,.1f} MB; non-expert weights {held.non_expert / 1e6:,.1f} MB")
