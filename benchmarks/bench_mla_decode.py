"""Decode speed of one MLA sequence at several past lengths: tiermoe's latent attention against transformers'.

Builds a DeepSeek-V2-Lite-shaped `make-model` checkpoint (its real attention shapes: 16 heads, kv_lora_rank 512,
rope 64; the first `--layers` layers; max_position_embeddings raised to fit the longest past), loads it twice,
with tiermoe's MLAAttention (absorbed: reads the cached latent as it is) and with transformers' own attention
(which caches and reads per-head K/V, expanded from the latent), prefills one sequence to each past length in
turn and times `--tokens` single-token forwards there (after one untimed). Also prints the bytes the KV pool
holds per token.

    python benchmarks/bench_mla_decode.py --dir scratch/v2lite-2l
    python benchmarks/bench_mla_decode.py --dir scratch/v2lite-2l --past 16 1024 4096 --tokens 8 --threads 1
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from unittest import mock

import torch

import tiermoe.model.loader as loader
from tiermoe.engine.llm import LLM
from tiermoe.testing.make_model import make_model

PREFILL_CHUNK = 512


def decode_rates(path: Path, past: list[int], tokens: int, dtype: torch.dtype) -> tuple[list[float], float]:
    """(tokens/s at each past length, cache bytes per token at the end) for one load of `path`."""
    rates = []
    with LLM(path, dtype=dtype, progress=False) as llm:
        engine, fed = llm.engine, 0
        seq = engine.new_sequence()
        for length in past:
            while fed < length:  # prefill up to this past length, in chunks as the engine does
                n = min(PREFILL_CHUNK, length - fed)
                engine.feed([seq], [[3 + (fed + i) % 200 for i in range(n)]], rows=["none"])
                fed += n
            engine.feed([seq], [[4]])  # warm-up step, not timed
            start = time.perf_counter()
            for i in range(tokens):
                engine.feed([seq], [[5 + i]])
            rates.append(tokens / (time.perf_counter() - start))
            fed += tokens + 1
        return rates, engine.pool.pages.bytes_per_token()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--dir", required=True, help="where the checkpoint is (written there when missing)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (default 2: one dense, one MoE)")
    parser.add_argument("--past", type=int, nargs="+", default=[16, 1024, 4096])
    parser.add_argument("--tokens", type=int, default=4, help="decode steps timed at each past length")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--out", help="also write the table (markdown) here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    path = Path(args.dir)
    if not (path / "config.json").exists():
        longest = max(args.past) + (args.tokens + 1) * len(args.past) + 1
        make_model("deepseek_v2", path, "deepseek-v2-lite", args.layers, dtype=dtype,
                   config_overrides=dict(max_position_embeddings=max(longest, 16384)))
    ours, ours_bytes = decode_rates(path, args.past, args.tokens, dtype)
    with mock.patch.object(loader, "replace_mla_attention", lambda layers: 0):  # transformers' own attention
        theirs, theirs_bytes = decode_rates(path, args.past, args.tokens, dtype)
    lines = [f"DeepSeek-V2-Lite-shaped, {args.layers} layers, {args.dtype}, {torch.get_num_threads()} threads: "
             f"decode tokens/s of one sequence ({args.tokens} steps per past length)", "",
             "| past tokens | transformers' attention (per-head K/V) | tiermoe (absorbed, from the latent) | "
             "speed-up |", "|---|---|---|---|"]
    for length, t, o in zip(args.past, theirs, ours):
        lines.append(f"| {length} | {t:.2f} | {o:.2f} | {o / t:.1f}x |")
    lines += ["", f"cache bytes per token: transformers {theirs_bytes:,.0f}, tiermoe {ours_bytes:,.0f}"]
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")


if __name__ == "__main__":
    main()
