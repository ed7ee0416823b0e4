"""The KV pool in numbers: decode speed at long pasts, bytes a step copies, batching gain, prefix reuse, memory.

Four parts (`--parts`, all by default), each a table:
- decode: one sequence's decode tokens/s at past lengths (default 16, 1k, 4k, 16k) on a Qwen3-30B-A3B-shaped and
  a DeepSeek-V2-Lite-shaped `make-model` checkpoint (`--layers` layers, bf16, max_position_embeddings >= 16k;
  written under --dir when missing), and per step the bytes copy_/cat write (the past is never copied: ~0, only
  the step's own activations), the K/V the step's gathers read, and that K/V as the pool's figure (past x bytes
  per token).
- mixed: 8 sequences of mixed past lengths decoding together (one forward per step) against each decoding alone,
  on the bundled demo model (16 to 2000 tokens) and tiny GPT-OSS and Qwen3-Next checkpoints (16 to 200: their
  context is 256). Gain = (8 sequences' decode time alone, summed) / (their time together), each sequence alone
  and the 8 together taking their best of --rounds rounds (the per-round gains are listed too: one 8-row step
  takes a few ms, so single readings scatter).
  Goal >= 4x.
- ttft: time to the first token of a chat's second turn (a 4k-token first turn, its answer and a new message),
  with prefix reuse and without, on the Qwen3-shaped checkpoint.
- memory: 8 sequences decoding on the demo model for --memory-steps steps: the process RSS after warm-up and at
  the end, and the pool's reserved bytes (nothing is allocated beyond the pool: flat).

Timing is noisy on shared machines: the load average is printed first; run when it is below the core count.

    python benchmarks/bench_kv_pool.py --dir scratch/tiermoe-bench
    python benchmarks/bench_kv_pool.py --dir scratch/tiermoe-bench --parts mixed memory --threads 2
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import psutil
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tiermoe.config import CPUConfig
from tiermoe.engine.llm import LLM
from tiermoe.engine.sampling import SamplingParams
from tiermoe.testing.make_model import make_model

aten = torch.ops.aten
CHUNK = 512
MIXED_DEMO = [16, 64, 128, 256, 512, 1000, 1500, 2000]
MIXED_TINY = [16, 24, 40, 64, 96, 128, 160, 200]


class CopyBytes(TorchDispatchMode):
    """Bytes written by copy_/cat (copies) and read by index_select (the pool's gathers) while active."""

    def __init__(self):
        super().__init__()
        self.copied = self.gathered = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        packet = func.overloadpacket
        if packet in (aten.copy_, aten.cat):
            self.copied += out.nbytes
        elif packet is aten.index_select:
            self.gathered += out.nbytes
        return out


def _tokens(n: int, salt: int = 0) -> list[int]:
    return [3 + (7 * i + 13 * salt) % 200 for i in range(n)]


def _prefill(engine, seq, n: int, salt: int = 0) -> None:
    ids = _tokens(n, salt)
    for start in range(0, n, CHUNK):
        engine.feed([seq], [ids[start:start + CHUNK]], rows=["none"])


def checkpoint(root: Path, arch: str, preset: str | None, layers: int | None, context: int) -> Path:
    path = root / f"{preset or arch + '-tiny'}-{layers or 'all'}l"
    if not (path / "config.json").exists():
        overrides = dict(max_position_embeddings=context) if preset else None
        make_model(arch, path, preset, layers, dtype=torch.bfloat16, config_overrides=overrides)
    return path


def part_decode(root: Path, pasts: list[int], steps: int, layers: int) -> list[str]:
    lines = ["| model | past tokens | decode tok/s | copy_/cat bytes per step | gathered K/V bytes per step | "
             "past x pool bytes per token |", "|---|---|---|---|---|---|"]
    context = max(16384, max(pasts) + 64)
    for arch, preset in (("qwen3_moe", "qwen3-30b-a3b"), ("deepseek_v2", "deepseek-v2-lite")):
        path = checkpoint(root, arch, preset, layers, context)
        with LLM(path, dtype=torch.bfloat16, max_total_tokens=context, max_running=1, progress=False) as llm:
            engine, fed = llm.engine, 0
            seq = engine.new_sequence()
            for past in pasts:
                _prefill(engine, seq, past - fed, past)
                fed = past
                engine.feed([seq], [[5]])  # warm-up, untimed
                with CopyBytes() as counted:
                    engine.feed([seq], [[6]])
                start = time.perf_counter()
                for i in range(steps):
                    engine.feed([seq], [[7 + i]])
                rate = steps / (time.perf_counter() - start)
                fed += steps + 2
                per_token = engine.pool.pages.bytes_per_token()
                lines.append(f"| {preset} ({layers} layers) | {past} | {rate:.2f} | {counted.copied:,} | "
                             f"{counted.gathered:,} | {(past + 1) * per_token:,} |")
                print(lines[-1], flush=True)
            engine.release(seq)
    return lines


def _decode_time(engine, seqs, steps: int) -> float:
    engine.feed(seqs, [[4]] * len(seqs))  # warm-up
    start = time.perf_counter()
    for i in range(steps):
        engine.feed(seqs, [[5 + i]] * len(seqs))
    return time.perf_counter() - start


def part_mixed(root: Path, steps: int, rounds: int, cpu_threads: int | None = None) -> list[str]:
    lines = ["| model | past lengths | 8 alone, s | 8 together, s | gain | gain per round |",
             "|---|---|---|---|---|---|"]
    models = [("demo (qwen3_moe, bundled)", None, MIXED_DEMO),
              ("tiny gpt_oss", checkpoint(root, "gpt_oss", None, None, 256), MIXED_TINY),
              ("tiny qwen3_next", checkpoint(root, "qwen3_next", None, None, 256), MIXED_TINY)]
    for name, path, lengths in models:
        alone, together = [], []  # per round: each sequence's time alone; the 8's time together
        with LLM(path, max_running=8, progress=False, cpu=CPUConfig(threads=cpu_threads)) as llm:
            engine = llm.engine
            for _ in range(rounds):  # fresh sequences each round: the longest stays within the context
                seqs = [engine.new_sequence() for _ in lengths]
                for i, (seq, n) in enumerate(zip(seqs, lengths)):
                    _prefill(engine, seq, n, i)
                alone.append([_decode_time(engine, [seq], steps) for seq in seqs])
                together.append(_decode_time(engine, seqs, steps))
                for seq in seqs:
                    engine.release(seq)
        best_alone = sum(min(times) for times in zip(*alone))  # each sequence's best round
        per_round = ", ".join(f"{sum(a) / t:.1f}x" for a, t in zip(alone, together))
        lines.append(f"| {name} | {lengths[0]}-{lengths[-1]} | {best_alone:.2f} | {min(together):.2f} | "
                     f"{best_alone / min(together):.1f}x | {per_round} |")
        print(lines[-1], flush=True)
    return lines


def part_ttft(root: Path, layers: int, first_turn: int) -> list[str]:
    lines = ["| prefix reuse | first turn tokens | second turn tokens | second-turn TTFT, s | reused tokens |",
             "|---|---|---|---|---|"]
    path = checkpoint(root, "qwen3_moe", "qwen3-30b-a3b", layers, 16384)
    for reuse in (False, True):
        with LLM(path, dtype=torch.bfloat16, max_running=1, prefix_cache=reuse, progress=False) as llm:
            first = _tokens(first_turn)
            answer = llm.generate(first, SamplingParams(max_tokens=16, ignore_eos=True))[0].token_ids
            second = first + answer + _tokens(32, 5)
            start = time.perf_counter()
            llm.generate(second, SamplingParams(max_tokens=1))
            ttft = time.perf_counter() - start
            lines.append(f"| {'on' if reuse else 'off'} | {first_turn} | {len(second)} | {ttft:.3f} | "
                         f"{llm.engine.prefix_hit_tokens} |")
            print(lines[-1], flush=True)
    return lines


def part_memory(steps: int) -> list[str]:
    process = psutil.Process()
    with LLM(None, max_running=8, progress=False) as llm:
        engine = llm.engine
        seqs = [engine.new_sequence() for _ in MIXED_DEMO]
        for i, (seq, n) in enumerate(zip(seqs, MIXED_DEMO)):
            _prefill(engine, seq, n - steps, i)  # so the longest stays within the context
        warm = 20
        for i in range(warm):
            engine.feed(seqs, [[5 + i % 50]] * len(seqs))
        rss_warm, pool_warm = process.memory_info().rss, engine.pool.nbytes()
        for i in range(steps - warm):
            engine.feed(seqs, [[5 + i % 50]] * len(seqs))
        rss_end, pool_end = process.memory_info().rss, engine.pool.nbytes()
    grown = (rss_end - rss_warm) / 2**20
    return ["| steps | RSS after warm-up, MiB | RSS at the end, MiB | grown, MiB | pool reserved, MiB (warm-up / end) |",
            "|---|---|---|---|---|",
            f"| {steps} | {rss_warm / 2**20:.1f} | {rss_end / 2**20:.1f} | {grown:+.1f} | "
            f"{pool_warm / 2**20:.1f} / {pool_end / 2**20:.1f} |"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--dir", required=True, help="where the make-model checkpoints are (written when missing)")
    parser.add_argument("--parts", nargs="+", choices=["decode", "mixed", "ttft", "memory"],
                        default=["decode", "mixed", "ttft", "memory"])
    parser.add_argument("--past", type=int, nargs="+", default=[16, 1024, 4096, 16384])
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the real-shaped checkpoints")
    parser.add_argument("--steps", type=int, default=8, help="decode steps timed per measurement")
    parser.add_argument("--rounds", type=int, default=3,
                        help="mixed: rounds, each on fresh sequences (alone, then together); best of each side")
    parser.add_argument("--first-turn", type=int, default=4096, help="tokens of the chat's first turn (ttft)")
    parser.add_argument("--memory-steps", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--cpu-threads", type=int, default=None,
                        help="mixed: the kernels' thread team (default: tiermoe's, --cpu-threads of the CLI)")
    parser.add_argument("--out", help="also write the tables (markdown) here")
    args = parser.parse_args()
    for flag in ("steps", "rounds", "layers", "first_turn", "memory_steps"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.cpu_threads is not None and not 1 <= args.cpu_threads <= (os.cpu_count() or 1):
        parser.error(f"--cpu-threads takes 1 to this machine's {os.cpu_count()} CPUs, got {args.cpu_threads}")
    if args.threads:
        torch.set_num_threads(args.threads)
    root = Path(args.dir)
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; {torch.get_num_threads()} threads",
          flush=True)
    tables = []
    with torch.inference_mode():
        if "decode" in args.parts:
            tables.append(part_decode(root, args.past, args.steps, args.layers))
        if "mixed" in args.parts:
            tables.append(part_mixed(root, args.steps, args.rounds, args.cpu_threads))
        if "ttft" in args.parts:
            tables.append(part_ttft(root, args.layers, args.first_turn))
        if "memory" in args.parts:
            tables.append(part_memory(args.memory_steps))
    text = "\n\n".join("\n".join(t) for t in tables)
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
