"""Prompt chunks attending the paged KV pool on the CPU: read in place row by row, against gathered SDPA.

A step's prompt chunk (rows of one sequence after its past: a prompt's next chunk, a scored prompt's rows, a
speculative verify segment) attends the past and itself. Two ways, one layer, Qwen3-30B-A3B's attention (32 query
heads, 4 KV heads, head dim 128) unless --shape says otherwise, the past in pages of 16 in a shuffled order as the
pool holds it:
- in place: tiermoe's native kernel (`DecodeAttention.attend_chunks`, what the engine runs on the CPU now): each
  row reads its keys through the chunk's page table, up to its own position;
- gathered: what the engine ran before, and what transformers' SDPA path over a paged pool needs: the chunk's
  pages gathered (`paged_attention.gather_pages`), then transformers' `sdpa_attention_forward` with the chunk's
  causal mask (which repeats each KV head for its query heads where a mask is given).
Both on one thread by default (--threads: a kernel team and torch's pool of that many; on a 2-core machine with
anything else running, torch's second thread and the team's wait for each other's CPU). Each round times every
case both ways, the two alternating; the table gives the median and the spread (min-max) of --rounds rounds of
--calls calls, and the ratio of the medians (gathered / in place: above 1, in place is faster).

    python benchmarks/bench_chunk_attention.py
    python benchmarks/bench_chunk_attention.py --cases 4096x8 4096x16 0x512 --rounds 7 --dtype fp32
    python benchmarks/bench_chunk_attention.py --shape demo --threads 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from tiermoe.experts.kernels import ThreadTeam, load_kernels
from tiermoe.layers.decode_attention import DecodeAttention
from tiermoe.layers.paged_attention import gather_pages
from tiermoe.layers.ragged_step import RaggedStep, SeqFeed

SHAPES = {"qwen3-30b-a3b": (32, 4, 128), "gpt-oss": (64, 8, 64), "demo": (4, 2, 64)}  # heads, KV heads, head dim
CASES = ["256x8", "1024x8", "4096x4", "4096x8", "4096x16", "4096x128", "0x64", "0x512", "2048x512"]
PAGE = 16


class _Module:
    """What transformers' sdpa_attention_forward reads of an attention module."""

    def __init__(self, groups: int):
        self.num_key_value_groups, self.is_causal, self.training = groups, True, False


def _case(H: int, Hkv: int, d: int, past: int, rows: int, dtype: torch.dtype, attention: DecodeAttention):
    """(in place, gathered) calls for one chunk of `rows` after `past`."""
    g = torch.Generator().manual_seed(past * 1000 + rows)
    pages = (past + rows - 1) // PAGE + 1
    order = (torch.randperm(pages, generator=g) + 1).tolist()  # page 0 unused, as in the pool
    k = torch.randn((pages + 1) * PAGE, Hkv, d, generator=g).to(dtype)
    v = torch.randn((pages + 1) * PAGE, Hkv, d, generator=g).to(dtype)
    q = torch.randn(rows, H, d, generator=g).to(dtype)
    step = RaggedStep([SeqFeed(past, rows, {None: order})], PAGE, {0: None}, torch.device("cpu"), dtype,
                      num_decode=0, decode_attention=attention)
    out = torch.empty(rows, H, d, dtype=dtype)
    scale = d ** -0.5
    gathered = RaggedStep([SeqFeed(past, rows, {None: order})], PAGE, {0: None}, torch.device("cpu"), dtype,
                          num_decode=0)
    read, mask = gathered.groups[None].read_pages, gathered.groups[None].parts[0].mask
    q_1HTd, module = q.transpose(0, 1)[None], _Module(H // Hkv)

    def in_place():
        step.attend_in_place(None, q, k, v, scale, None, out)

    def gather_and_sdpa():
        sdpa_attention_forward(module, q_1HTd, gather_pages(k, read, PAGE), gather_pages(v, read, PAGE), mask,
                               scaling=scale)

    return in_place, gather_and_sdpa


def _timed(call, n: int) -> float:
    call()  # warm
    start = time.perf_counter()
    for _ in range(n):
        call()
    return (time.perf_counter() - start) / n


def _parse(case: str) -> tuple[int, int]:
    try:
        past, rows = (int(x) for x in case.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a case is PASTxROWS (e.g. 4096x8), got {case!r}") from None
    if past < 0 or rows < 1:
        raise argparse.ArgumentTypeError(f"a case needs a past >= 0 and rows >= 1, got {case!r}")
    return past, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--cases", type=_parse, nargs="+", default=[_parse(c) for c in CASES],
                        help=f"PASTxROWS: a chunk of ROWS rows after a past of PAST (default: {' '.join(CASES)})")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--threads", type=int, default=1, help="kernel team and torch threads (default 1)")
    parser.add_argument("--calls", type=int, default=3, help="calls per timed round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.calls < 1 or args.rounds < 1:
        parser.error("--calls and --rounds must be positive")
    if not 1 <= args.threads <= (os.cpu_count() or 1):
        parser.error(f"--threads takes 1 to this machine's {os.cpu_count()} CPUs, got {args.threads}")
    kernels = load_kernels()
    if kernels is None:
        parser.error("the CPU kernels are not built here (no C++ compiler?)")
    torch.set_num_threads(args.threads)
    # torch's thread pool started before the team pins the calling thread to its CPU: threads started after that
    # inherit the one-CPU mask, so SDPA would run its threads on one CPU
    torch.ones(256, 256) @ torch.ones(256, 256)
    team = ThreadTeam(kernels, args.threads)
    attention = DecodeAttention(kernels, lambda: team)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    H, Hkv, d = SHAPES[args.shape]
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; {args.shape} ({H} / {Hkv} heads, "
          f"head dim {d}), {args.dtype}, {args.threads} threads; median (min-max) of {args.rounds} rounds",
          flush=True)
    head = "| past | rows | in place, ms | gathered + SDPA, ms | gathered / in place |"
    print(head + "\n|" + "---|" * 5, flush=True)
    for past, rows in args.cases:
        calls = _case(H, Hkv, d, past, rows, dtype, attention)
        times = ([], [])
        for _ in range(args.rounds):
            for side, call in enumerate(calls):
                times[side].append(_timed(call, args.calls) * 1e3)
        mid = [statistics.median(t) for t in times]
        cells = [f"{m:.2f} ({min(t):.2f}-{max(t):.2f})" for m, t in zip(mid, times)]
        print(f"| {past} | {rows} | {cells[0]} | {cells[1]} | {mid[1] / mid[0]:.2f}x |", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    team.close()


if __name__ == "__main__":
    main()
