"""Decode attention of one layer over the paged KV pool: tiermoe's kernel per ISA against torch's attention.

One decode row attends a past of each length (`--past`) with the attention shapes of real models (Qwen3-30B-A3B:
32 query heads, 4 KV heads, head dim 128; GPT-OSS: 64 / 8 / 64 with sinks; the bundled demo model: 4 / 2 / 64;
absorbed MLA, every head on one latent of 512 and a roped key of 64: DeepSeek-V2-Lite's 16 heads and DeepSeek-V3's
128), the past in pages of 16 in a shuffled page order as the pool holds it. Columns:
- tiermoe's kernel (`tiermoe.layers.decode_attention`, reading the pages in place) at each ISA level this CPU runs
  (the best one is what tiermoe uses; the lower ones are what other CPUs get from the same build);
- torch on K/V already gathered into contiguous tensors (a generous peer: the gather it needs from a paged pool
  is not timed): `scaled_dot_product_attention` (GQA repeated by its `enable_gqa`), or for MLA the absorbed
  attention tiermoe computed with torch before its kernel took two-part keys (`mla_math.latent_attention`: two
  matmuls and a softmax over the latent);
- the K/V bytes the step must read over the best kernel time (GB/s), against the bandwidth this process measures
  reading a buffer of the same size on one thread (the floor).
Times are the best of `--rounds` rounds of `--calls` calls, the columns alternating within each round, on the
calling thread alone (a kernel team of one: one row of one layer is what a decode step hands it); `--team N` adds
the best kernel on a team of N threads.

    python benchmarks/bench_decode_attention.py
    python benchmarks/bench_decode_attention.py --past 1024 4096 16384 --rounds 5 --dtype fp32
    python benchmarks/bench_decode_attention.py --shapes deepseek-v2-lite deepseek-v3 --mla-heads 32 64
    python benchmarks/bench_decode_attention.py --shapes deepseek-v2-lite deepseek-v3 qwen3-30b-a3b --team 2
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from tiermoe.experts.kernels import ISA_NAMES, ThreadTeam, load_kernels
from tiermoe.layers.decode_attention import DecodeAttention
from tiermoe.layers.mla_math import latent_attention

SHAPES = {  # name: (query heads, KV heads, head dim, sinks, rope dim: MLA's second key part, the head dim its latent)
    "qwen3-30b-a3b": (32, 4, 128, False, 0),
    "gpt-oss": (64, 8, 64, True, 0),
    "demo": (4, 2, 64, False, 0),
    "deepseek-v2-lite": (16, 1, 512, False, 64),
    "deepseek-v3": (128, 1, 512, False, 64),
}
PAGE = 16


def _case(H: int, Hkv: int, d: int, past: int, dtype: torch.dtype, sinks: bool, rope: int, seed: int = 0) -> dict:
    """One row's query, the pool's K/V slots (MLA: latent as K and V, roped key as KR) and the same gathered."""
    g = torch.Generator().manual_seed(seed)
    pages = past // PAGE + 1
    order = torch.randperm(pages, generator=g) + 1  # page 0 unused, as in the pool
    k = torch.randn((pages + 1) * PAGE, Hkv, d, generator=g).to(dtype)
    v = k if rope else torch.randn((pages + 1) * PAGE, Hkv, d, generator=g).to(dtype)
    kr = torch.randn((pages + 1) * PAGE, Hkv, rope, generator=g).to(dtype) if rope else None
    slots = order[torch.arange(past) // PAGE] * PAGE + torch.arange(past) % PAGE
    gathered = {name: x[slots].transpose(0, 1).contiguous()[None]  # [1, Hkv, past, *]
                for name, x in (("k", k), ("v", v), ("kr", kr)) if x is not None and (name != "v" or not rope)}
    return dict(q=torch.randn(1, H, d + rope, generator=g).to(dtype), k=k, v=v, kr=kr, tables=order[None].long(),
                pos=torch.tensor([past - 1], dtype=torch.int32), lo=torch.zeros(1, dtype=torch.int32),
                sinks=torch.randn(H, generator=g) if sinks else None, gathered=gathered,
                scale=(d + rope) ** -0.5)


def _kernel_call(attention: DecodeAttention, c: dict, dv: int):
    out = torch.empty(1, c["q"].shape[1], dv, dtype=c["q"].dtype)
    keys = int(c["pos"][0]) + 1
    return lambda: attention.attend(c["q"], c["k"], c["v"], c["tables"], c["pos"], c["lo"], PAGE, c["scale"], keys,
                                    c["sinks"], out, c["kr"])


def _torch_call(c: dict, d: int):
    """The peer on the gathered K/V: SDPA, or MLA's torch absorbed attention."""
    q = c["q"][:, :, None]  # [1, H, 1, d (+ rope)]
    if c["kr"] is None:
        return lambda: F.scaled_dot_product_attention(q, c["gathered"]["k"], c["gathered"]["v"], enable_gqa=True)
    latent, k_pe = c["gathered"]["k"][:, 0], c["gathered"]["kr"][:, 0]  # [1, past, R], [1, past, P]
    q_latent, q_pe = q[..., :d], q[..., d:]
    return lambda: latent_attention(q_latent, q_pe, latent, k_pe, c["scale"])


def _bandwidth_call(nbytes: int):
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    return lambda: buf.sum()


def best_times(calls: dict, n: int, rounds: int) -> dict[str, float]:
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(rounds):
        for name, call in calls.items():
            call()  # warm
            start = time.perf_counter()
            for _ in range(n):
                call()
            best[name] = min(best[name], (time.perf_counter() - start) / n)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--past", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--mla-heads", type=int, nargs="*", default=[],
                        help="also MLA shapes of these head counts (latent 512, roped key 64): where the kernel "
                             "stops beating torch decides MLA_KERNEL_MAX_HEADS")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--calls", type=int, default=10, help="calls per timed round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--team", type=int, default=0,
                        help="also the best kernel on a team of this many threads (a row's keys split among them "
                             "where its KV heads are too few tasks), and its speed-up over one thread")
    args = parser.parse_args()
    if min(args.past) < 1 or args.calls < 1 or args.rounds < 1 or min(args.mla_heads, default=1) < 1:
        parser.error("--past, --calls, --rounds and --mla-heads must be positive")
    if not 0 <= args.team <= (os.cpu_count() or 1):
        parser.error(f"--team takes 0 (none) to this machine's {os.cpu_count()} CPUs, got {args.team}")
    shapes = {name: SHAPES[name] for name in args.shapes}
    shapes.update({f"mla-{h}-heads": (h, 1, 512, False, 64) for h in args.mla_heads})
    best = load_kernels()
    if best is None:
        parser.error("the CPU kernels are not built here (no C++ compiler?)")
    torch.set_num_threads(1)  # one thread on each side: the kernel runs on the calling thread here
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    isas = ISA_NAMES[:best.isa + 1]
    team = ThreadTeam(best, 1)  # the calling thread alone
    kernels = {isa: DecodeAttention(load_kernels(isa=isa), lambda: team) for isa in isas}
    if args.team:
        threads = ThreadTeam(best, args.team)
        kernels["team"] = DecodeAttention(best, lambda: threads)
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; {args.dtype}; one thread", flush=True)
    head = "| shape | past | " + " | ".join(f"tiermoe {isa}, ms" for isa in isas) + \
        (f" | tiermoe {isas[-1]} on {args.team} threads, ms | speed-up" if args.team else "") + \
        " | torch (gathered), ms | torch / best | K/V GB/s (best) | floor GB/s |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    print(lines[0], flush=True)
    for name, (H, Hkv, d, sinks, rope) in shapes.items():
        for past in args.past:
            c = _case(H, Hkv, d, past, dtype, sinks, rope)
            kv_bytes = sum(x.nbytes for x in c["gathered"].values())
            calls = {isa: _kernel_call(attention, c, d) for isa, attention in kernels.items()}
            if not sinks:  # torch's attention has no sink logits: no like-for-like row for GPT-OSS
                calls["torch"] = _torch_call(c, d)
            calls["floor"] = _bandwidth_call(kv_bytes)
            t = best_times(calls, args.calls, args.rounds)
            ours = t[isas[-1]]
            peer = f"{t['torch'] * 1e3:.3f} | {t['torch'] / ours:.1f}x" if "torch" in t else "- | -"
            team_cells = f" | {t['team'] * 1e3:.3f} | {ours / t['team']:.2f}x" if args.team else ""
            lines.append(f"| {name} | {past} | " + " | ".join(f"{t[i] * 1e3:.3f}" for i in isas) + team_cells +
                         f" | {peer} | {kv_bytes / ours / 1e9:.1f} | {kv_bytes / t['floor'] / 1e9:.1f} |")
            print(lines[-1], flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
