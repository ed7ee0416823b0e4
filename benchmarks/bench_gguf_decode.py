"""How fast GGUF expert tensors decode to fp32: the gguf package's numpy code against tiermoe's kernels.

Loading or converting a GGUF model decodes every expert once, so this rate bounds how long a big file takes:
DeepSeek-V3 in Q4_K is about 400 GB. Both paths decode the same blocks (random codes with sane half-precision
scales: the cost does not depend on the values) in one run, best of `--repeats`; the kernels use torch's intra-op
thread count (`--threads`). Their outputs are checked equal bit for bit before timing.

    python benchmarks/bench_gguf_decode.py                      # 64 MB of each type
    python benchmarks/bench_gguf_decode.py --mb 256 --threads 8 --out benchmarks/results/gguf_decode.md
"""

from __future__ import annotations

import argparse
import warnings
from functools import partial

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from tqdm.auto import tqdm

from tiermoe.analysis.device_profile import best_time, synchronizer
from tiermoe.checkpoint.gguf_dequant import NATIVE_TYPES, dequantize_into

# Where each type keeps its half-precision scales (d, and dmin for the K-quants that have one).
_HALF_OFFSETS = {"Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
FILE_GB = 400  # DeepSeek-V3 Q4_K, roughly: the file a user waits for


def sample_blocks(qtype, mb: int, rows: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, bytes per row] of `qtype` blocks, about `mb` MB."""
    nbytes = GGML_QUANT_SIZES[qtype][1]
    n = max(rows, (mb << 20) // nbytes // rows * rows)
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, nbytes), dtype=np.uint8)
    halves = np.ascontiguousarray((rng.standard_normal(n) * 0.01).astype(np.float16)).view(np.uint8).reshape(n, 2)
    for offset in _HALF_OFFSETS[qtype.name]:
        raw[:, offset:offset + 2] = halves
    return raw.reshape(rows, -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--mb", type=int, default=64, help="MB of blocks per type (default 64)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--out", help="also write the table (markdown) here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore", RuntimeWarning)  # random codes: gguf's numpy may see odd halves
    rows = []
    for name in tqdm(list(NATIVE_TYPES), desc="decoding"):
        qtype = GGMLQuantizationType[name]
        raw = sample_blocks(qtype, args.mb, rows=64)
        values = GGML_QUANT_SIZES[qtype][0] * raw.nbytes // GGML_QUANT_SIZES[qtype][1]
        ref, out = torch.empty(64, values // 64), torch.empty(64, values // 64)
        dequantize_into(raw, qtype, ref, native=False)
        dequantize_into(raw, qtype, out)
        if not torch.equal(ref.nan_to_num(), out.nan_to_num()):
            raise SystemExit(f"{name}: tiermoe's decoding differs from the gguf package's")
        t_gguf = best_time(partial(dequantize_into, raw, qtype, ref, native=False), synchronizer("cpu"), args.repeats)
        t_ours = best_time(partial(dequantize_into, raw, qtype, out), synchronizer("cpu"), args.repeats)
        mb = raw.nbytes / 1e6
        rows.append((name, mb / t_gguf, mb / t_ours, t_gguf / t_ours))
    lines = [(f"GGUF decoding to fp32, {args.mb} MB per type, {torch.get_num_threads()} threads, best of "
              f"{args.repeats} (MB of file per second)"), "",
             f"| type | gguf package | tiermoe | speed-up | {FILE_GB} GB file: gguf | tiermoe |", "|---|---|---|---|---|---|"]
    for name, gguf_rate, ours, ratio in rows:
        lines.append(f"| {name} | {gguf_rate:.0f} | {ours:.0f} | {ratio:.1f}x | "
                     f"{FILE_GB * 1e3 / gguf_rate / 3600:.1f} h | {FILE_GB * 1e3 / ours / 60:.0f} min |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
