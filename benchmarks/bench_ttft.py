"""Time to first token of 1-, 2- and 16-token prompts through the engine (the best of 3 each, after one warm-up).

Builds, when `--dir` is empty, a one-layer Qwen3-MoE checkpoint with Qwen3's real vocabulary (151,936) and hidden
size 2048 in bf16, where the LM head dominates the time to first token. Run it once per source tree with
PYTHONPATH pointing at that tree to compare two commits side by side:

    python benchmarks/bench_ttft.py --dir scratch/tiermoe-bench/qwen3-vocab-1l
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import SamplingParams
from tiermoe.testing.make_model import make_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True, help="checkpoint directory (built when absent or empty)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1, 2, 16])
    args = parser.parse_args()
    if not args.dir.exists() or not any(args.dir.iterdir()):
        make_model("qwen3_moe", args.dir, progress=False, config_overrides=dict(
            vocab_size=151936, hidden_size=2048, num_hidden_layers=1, mlp_only_layers=[]))
    one_token = SamplingParams(max_tokens=1)
    with LLM(args.dir, progress=False) as llm:
        llm.generate([3], one_token)
        figures = []
        for n in args.lengths:
            times = []
            for k in range(3):
                start = time.perf_counter()
                llm.generate([list(range(3 + k, 3 + k + n))], one_token)
                times.append(time.perf_counter() - start)
            figures.append(f"{n}-token prompt: {min(times) * 1e3:.0f} ms")
    print(" | ".join(figures))


if __name__ == "__main__":
    main()
