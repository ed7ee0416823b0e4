"""The values flags accept, for parsers that must not import torch or transformers.

`tiermoe CMD --help` builds only CMD's parser, and a parser that imported the library modules these values live in
would load torch and transformers (seconds) to print a page of text. So the parsers read copies kept here, and
tests/test_cli_startup.py checks that every copy equals the library's value, so they cannot drift apart.
"""

from __future__ import annotations

# compute dtypes a --dtype flag names (tiermoe.cli.flags.dtype_flag turns a name into the torch dtype)
DTYPE_NAMES = ("bf16", "fp32", "fp16")

# tiermoe.stats.recorders: the recorder modes and SGLang's default circular buffer (passes)
RECORDER_MODES = ("stat", "stat_approx", "per_pass", "per_token")
SGLANG_DEFAULT_BUFFER_SIZE = 1000

# tiermoe.layers.decode_attention.ATTENTION_BACKENDS: what --attention-backend names (SGLang's names are taken too,
# checked when the command runs)
ATTENTION_BACKENDS = ("auto", "native", "triton", "torch")

# tiermoe.arch.SUPPORTED_MODEL_TYPES: the tuned families, which make-model builds
TUNED_MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "qwen3_next", "mixtral", "deepseek_v2", "deepseek_v3", "glm4_moe",
                     "olmoe", "gpt_oss")

# tiermoe.testing.presets.PRESETS: each make-model preset and the model_type it is
MODEL_PRESETS = {
    "qwen3-30b-a3b": "qwen3_moe",
    "qwen2-57b-a14b": "qwen2_moe",
    "qwen3-next-80b-a3b": "qwen3_next",
    "mixtral-8x7b": "mixtral",
    "deepseek-v2-lite": "deepseek_v2",
    "deepseek-v3": "deepseek_v3",
    "glm-4.5-air": "glm4_moe",
    "olmoe-1b-7b": "olmoe",
    "gpt-oss-20b": "gpt_oss",
}

# tiermoe.analysis.placement_traffic.BENCH_STRATEGIES and tiermoe.placement.cache_policies.DEFAULT_COPY_BUDGET
BENCH_STRATEGIES = ("random", "uniform", "front-loading", "frequency", "balanced", "time-balanced", "dynamic",
                    "adaptive")
DEFAULT_COPY_BUDGET = 4

# tiermoe.training.finetune.DEFAULT_MAX_LENGTH and tiermoe.training.lora.MAX_RANK
FINETUNE_MAX_LENGTH = 512
MAX_LORA_RANK = 4096

# tiermoe.layers.routed_autograd.DEFAULT_CHUNK (fit --train and finetune --expert-chunk) and
# tiermoe.training.kt_env.MAX_SEQUENCE (tokens in one training sequence: finetune --expert-chunk's bound)
DEFAULT_EXPERT_CHUNK = 4096
MAX_TRAINING_SEQUENCE = 1 << 24

# tiermoe.routing.presets.PRESETS (trace generate --preset) and tiermoe.routing.trace_import.LAYOUTS
ROUTING_PRESETS = ("esft-deepseek-v2-lite", "qwen3-30b-a3b")
TRACE_LAYOUTS = ("esft-trace", "esft-counts", "route-trace", "heat", "sglang", "tiermoe")

# tiermoe.distributed.group.DEFAULT_DIST_TIMEOUT_S: serve's --dist-timeout default, seconds
DEFAULT_DIST_TIMEOUT_S = 300.0

# tiermoe.engine.speculative_config: the drafting algorithms and the bounds of a draft and an n-gram
SPECULATIVE_ALGORITHMS = ("ngram", "nextn")
MAX_DRAFT_TOKENS = 16
MAX_NGRAM = 16

# tiermoe.model.served_adapters: adapters served per request at once (serve --max-loras-per-batch), default and most
DEFAULT_LOADED_ADAPTERS = 8
MAX_LOADED_ADAPTERS = 64
