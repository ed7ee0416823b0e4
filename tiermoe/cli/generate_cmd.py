"""tiermoe generate: one prompt through a hybrid model, streamed to the terminal."""

from __future__ import annotations

import argparse
import sys

from tiermoe.arch import detect, load_config
from tiermoe.cli.cpu_flags import add_cpu_flags, cpu_from_args
from tiermoe.cli.flags import (
    add_command,
    non_negative_float,
    non_negative_int,
    positive_int,
    seed_int,
    unit_float,
)
from tiermoe.cli.lora_flag import add_lora_flag, lora_from_args
from tiermoe.cli.placement_flags import (
    add_dynamic_flags,
    add_placement_flags,
    check_fit_from_args,
    dynamic_from_args,
    plan_from_args,
)
from tiermoe.cli.recorder_flags import add_recorder_flags, recorder_from_args
from tiermoe.config import check_device
from tiermoe.engine.llm import LLM
from tiermoe.engine.text_stream import TextStream
from tiermoe.errors import TiermoeError
from tiermoe.layers.decode_attention import ATTENTION_BACKENDS, check_attention_backend
from tiermoe.models import resolve_model
from tiermoe.stats.io import dump_recorder_files


def add_parser(sub) -> None:
    p = add_command(
        sub, "generate",
        "Generate a reply to one prompt with a hybrid model and stream it. Chat models get their chat template "
        "applied (disable with --raw). Without --model, the bundled demo model.",
        'tiermoe generate --prompt "Hello"',
        'tiermoe generate --model /models/Qwen3-30B-A3B --gpu-device cuda:0 --prompt "Explain MoE" --max-tokens 200',
        'tiermoe generate --prompt "Once upon a time" --raw --temperature 0.8 --top-p 0.9 --seed 1',
        'tiermoe generate --prompt "Hi" --kt-num-gpu-experts 4 --kt-expert-placement-strategy uniform',
        'tiermoe generate --prompt "Hi" --plan plan.json',
        'tiermoe generate --prompt "Hi" --cpu-expert-dtype int4 --cpu-threads 2',
        'tiermoe generate --prompt "Hi" --cpu-expert-dtype int4 --non-expert-dtype int4 --head-dtype int8',
        'tiermoe generate --prompt "Hi" --lora runs/sft/adapter',
        'tiermoe generate --prompt "Hi" --kt-gpu-experts-ratio 0.25 --placement-policy adaptive '
        '--no-adaptive-cross-layer --adaptive-prompt-evidence',
    )
    add_model_flags(p)
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--raw", action="store_true", help="feed the prompt as plain text, without the chat template")
    p.add_argument("--system", help="system message (chat template only)")
    add_sampling_flags(p)
    add_placement_flags(p)
    add_dynamic_flags(p)
    add_cpu_flags(p)
    add_recorder_flags(p)


def add_model_flags(p) -> None:
    p.add_argument("--model", "--model-path", dest="model", default=None,
                   help="checkpoint directory (default: the bundled demo model)")
    p.add_argument("--gpu-device", "--kt-gpu-device", dest="gpu_device", default="cpu",
                   help="device of the GPU tier and non-expert weights: cuda, cuda:N or cpu (default cpu)")
    p.add_argument("--attention-backend", type=attention_backend, default="auto", metavar="NAME",
                   help=f"how attention reads the KV pool in place: {', '.join(ATTENTION_BACKENDS)} (default auto: "
                        "the CPU's native kernel; on CUDA the Triton kernel when triton is installed); triton on a "
                        "CPU runs only under TRITON_INTERPRET=1; torch gathers each step's pages. SGLang's names are "
                        "taken (torch_native; its other kernels as auto)")
    add_lora_flag(p)


def attention_backend(value: str) -> str:
    try:
        check_attention_backend(value)
    except TiermoeError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return value


def add_sampling_flags(p) -> None:
    p.add_argument("--max-tokens", type=positive_int, default=128, help="tokens to generate at most (default 128)")
    p.add_argument("--temperature", type=non_negative_float, default=None,
                   help="0 = greedy (default: the model's generation_config.json, else greedy)")
    p.add_argument("--top-p", type=unit_float, default=None,
                   help="nucleus sampling mass, (0, 1] (default: generation_config.json, else 1 = off)")
    p.add_argument("--top-k", type=non_negative_int, default=None,
                   help="sample among the k likeliest (default: generation_config.json, else 0 = off)")
    p.add_argument("--seed", type=seed_int, default=None, help="random seed for reproducible sampling")


def run(args) -> int:
    dynamic = dynamic_from_args(args)  # contradicting placement flags fail before anything loads
    device = check_device(args.gpu_device)
    recorder = recorder_from_args(args, detect(load_config(resolve_model(args.model))))
    lora = lora_from_args(args)
    plan = plan_from_args(args, device)
    check_fit_from_args(args, plan, device)
    llm = LLM(args.model, gpu_device=device, placement=plan, dynamic=dynamic, recorder=recorder,
              cpu=cpu_from_args(args), lora=lora, attention_backend=args.attention_backend)
    lora = None  # merged into the weights now: its factors (GBs for a large model) need not stay
    with llm:
        # what the flags leave out comes from the checkpoint's generation_config.json, as in vLLM and SGLang
        sampling = llm.default_sampling(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                        top_k=args.top_k, seed=args.seed)
        use_chat = not args.raw and llm.tokenizer is not None and getattr(llm.tokenizer, "chat_template", None)
        if use_chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            prompt = llm.chat_prompt_ids(messages + [{"role": "user", "content": args.prompt}])
        else:
            prompt = args.prompt
        streams: dict[int, TextStream] = {}

        def stream(produced):
            for seq in produced:
                if llm.tokenizer is None:
                    continue
                text = streams.get(seq.seq_id) or streams.setdefault(
                    seq.seq_id, TextStream(llm.engine.decoded_text(seq), sampling.stop))
                sys.stdout.write(text.delta(seq.output_ids, seq.finished, seq.stop_text_end))  # a few ids decoded
                sys.stdout.flush()

        result = llm.generate(prompt, sampling, on_step=stream)[0]
        if llm.tokenizer is None:
            print(" ".join(map(str, result.token_ids)), end="")
        print()
    if recorder.enabled:
        print(f"expert distribution written to {' and '.join(map(str, dump_recorder_files(recorder)))}",
              file=sys.stderr)
    return 0
