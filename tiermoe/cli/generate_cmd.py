"""tiermoe generate's flags: one prompt through a hybrid model, streamed to the terminal (run: generate_run).

The prompt comes as llama.cpp and Ollama users type it: words after the command, `-p/--prompt`, or stdin
(`echo hi | tiermoe generate`).
"""

from __future__ import annotations

from tiermoe.cli.choices import ATTENTION_BACKENDS
from tiermoe.cli.cpu_flags import add_cpu_flags
from tiermoe.cli.flags import (
    add_command,
    non_negative_float,
    non_negative_int,
    positive_int,
    seed_int,
    unit_float,
)
from tiermoe.cli.lora_flag import add_lora_flag, add_served_lora_flags
from tiermoe.cli.placement_flags import add_dynamic_flags, add_placement_flags
from tiermoe.cli.recorder_flags import add_recorder_flags
from tiermoe.cli.speculative_flags import add_speculative_flags


def add_parser(sub) -> None:
    p = add_command(
        sub, "generate",
        "Generate a reply to one prompt with a hybrid model and stream it. Chat models get their chat template "
        "applied (disable with --raw). Without --model, the bundled demo model.",
        'tiermoe generate "Hello"',
        'echo "Summarise this" | tiermoe generate --max-tokens 64',
        'tiermoe generate -p "Hello" --verbose',
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
    p.add_argument("prompt_words", nargs="*", metavar="PROMPT",
                   help="the prompt (several words are joined with spaces); else --prompt, else stdin when it is not "
                        "a terminal")
    p.add_argument("-p", "--prompt", help="the prompt text, as a flag")
    p.add_argument("--verbose", "-v", action="store_true",
                   help="also print the load time and where the experts are, on stderr, beside the speed line "
                        "(prompt tokens, time to first token, decode tokens/s) printed after every reply")
    p.add_argument("--raw", action="store_true", help="feed the prompt as plain text, without the chat template")
    p.add_argument("--system", help="system message (chat template only)")
    add_sampling_flags(p)
    add_placement_flags(p)
    add_dynamic_flags(p)
    add_cpu_flags(p)
    add_recorder_flags(p)
    add_speculative_flags(p)


def add_model_flags(p, serving: bool = False) -> None:
    p.add_argument("--model", "--model-path", dest="model", default=None,
                   help="checkpoint directory (default: the bundled demo model)")
    p.add_argument("--gpu-device", "--kt-gpu-device", dest="gpu_device", default="cpu",
                   help="device of the GPU tier and non-expert weights: cuda, cuda:N or cpu (default cpu)")
    p.add_argument("--attention-backend", default="auto", metavar="NAME",
                   help=f"how attention reads the KV pool in place: {', '.join(ATTENTION_BACKENDS)} (default auto: "
                        "the CPU's native kernel; on CUDA the Triton kernel when triton is installed); triton on a "
                        "CPU runs only under TRITON_INTERPRET=1; torch gathers each step's pages. SGLang's names are "
                        "taken (torch_native; its other kernels as auto)")
    (add_served_lora_flags if serving else add_lora_flag)(p)


def add_sampling_flags(p) -> None:
    p.add_argument("--max-tokens", type=positive_int, default=128, help="tokens to generate at most (default 128)")
    p.add_argument("--temperature", type=non_negative_float, default=None,
                   help="0 = greedy (default: the model's generation_config.json, else greedy)")
    p.add_argument("--top-p", type=unit_float, default=None,
                   help="nucleus sampling mass, (0, 1] (default: generation_config.json, else 1 = off)")
    p.add_argument("--top-k", type=non_negative_int, default=None,
                   help="sample among the k likeliest (default: generation_config.json, else 0 = off)")
    p.add_argument("--seed", type=seed_int, default=None, help="random seed for reproducible sampling")
