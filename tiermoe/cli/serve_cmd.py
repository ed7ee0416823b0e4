"""tiermoe serve's flags and help (light: `tiermoe serve --help` loads neither torch nor transformers); running
it is tiermoe.cli.serve_run, imported only then."""

from __future__ import annotations

from tiermoe.cli.flags import add_command
from tiermoe.cli.serve_flags import add_serve_flags


def add_parser(sub) -> None:
    p = add_command(
        sub, "serve",
        "Serve a hybrid model over HTTP: OpenAI /v1/chat/completions, /v1/completions, /v1/models; Ollama "
        "/api/chat, /api/generate, /api/tags, /api/show; /health, /metrics, /placement and SGLang's expert "
        "distribution recorder endpoints; GET / lists them. Concurrent requests share forward passes (continuous "
        "batching); every --decode-log-interval decode steps the log shows SGLang's decode-batch line (running and "
        "queued requests, KV use, tokens/s). LoRA adapters per request (--lora NAME=DIR; SGLang's /load_lora_adapter "
        "and /unload_lora_adapter), or one merged (--lora DIR). Without --model, the bundled demo model. SGLang-kt "
        "spellings "
        "(--model-path, --kt-gpu-device, --kt-...) are accepted.",
        "tiermoe serve",
        "tiermoe serve --decode-log-interval 10",
        "tiermoe serve --model /models/Qwen3-30B-A3B --gpu-device cuda:0 --kt-num-gpu-experts 32 --port 30000",
        "tiermoe serve --model-path /models/DeepSeek-V3 --kt-gpu-device cuda:0 --kt-expert-placement-strategy "
        "frequency --init-expert-location stats.pt --kt-gpu-experts-ratio 0.2 --api-key secret",
        "tiermoe serve --model /models/DeepSeek-V3 --gpu-device cuda --num-gpus 4 --kt-gpu-experts-ratio 0.3",
        "torchrun --nproc-per-node 4 -m tiermoe.serve --model /models/DeepSeek-V3 --gpu-device cuda --num-gpus 4 "
        "--plan plan.json",
        "tiermoe serve --model /models/Qwen3-30B-A3B --lora runs/sft/adapter --cpu-expert-dtype int8",
        "tiermoe serve --model /models/Qwen3-30B-A3B --lora sql=runs/sql --lora chat=runs/chat --enable-lora",
        "tiermoe serve --model /models/Qwen3-30B-A3B --gpu-device cuda:0 --kt-gpu-experts-ratio 0.25 "
        "--init-expert-location stats.pt --placement-policy adaptive --adaptive-swap-z 0 --adaptive-max-swaps 8",
    )
    add_serve_flags(p)
