"""Qwen3-Next's linear attention decode step for one layer: tiermoe's gated delta rule per ISA against transformers'.

Decode rows (`--rows`, each one token of its own sequence) update their recurrent states [Hv, dk, dv] (fp32, 2 MB
a layer and sequence at Qwen3-Next-80B's 32 value heads of 128 x 128) kept in the KV pool's slots. Columns:
- tiermoe's kernel (`DecodeAttention.gated_delta`: each state read where it lies and written once to the slot's
  other bank) at each ISA level this CPU runs;
- transformers: what the engine did before, and what a model without tiermoe does per step: the rows' states
  gathered out of the pool, `torch_recurrent_gated_delta_rule` (a dozen elementwise passes over each state),
  the new states scattered back;
- the state bytes a step must read and write over the best kernel time (GB/s), against a copy of the same bytes
  on one thread (the floor: read once, write once).
Times are the best of `--rounds` rounds of `--calls` calls, the columns alternating within each round, on one
thread each (a kernel team of one, torch with one thread).

    python benchmarks/bench_gated_delta.py
    python benchmarks/bench_gated_delta.py --rows 1 8 32 --dtype fp32
"""

from __future__ import annotations

import argparse
import os

import torch
from bench_decode_attention import best_times
from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

from tiermoe.experts.kernels import ISA_NAMES, ThreadTeam, load_kernels
from tiermoe.layers.decode_attention import DecodeAttention

SHAPES = {  # name: (key heads, value heads, key head dim, value head dim)
    "qwen3-next-80b": (16, 32, 128, 128),
    "tiny (tests)": (2, 4, 16, 16),
}


def _case(Hk: int, Hv: int, dk: int, dv: int, rows: int, dtype: torch.dtype, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    slots = 2 * rows + 2  # two banks per sequence, plus one spare sequence, as the pool holds them
    order = torch.randperm(slots, generator=g)
    return dict(qkv=torch.randn(rows, 2 * Hk * dk + Hv * dv, generator=g).to(dtype),
                g=-torch.rand(rows, Hv, generator=g), beta=torch.rand(rows, Hv, generator=g).to(dtype),
                states=torch.randn(slots, Hv, dk, dv, generator=g) * 0.1,
                read=order[:rows].contiguous(), write=order[rows:2 * rows].contiguous(),
                out=torch.empty(rows, Hv, dv, dtype=dtype), shape=(Hk, Hv, dk, dv))


def _kernel_call(delta: DecodeAttention, c: dict):
    Hk, _, dk, _ = c["shape"]
    return lambda: delta.gated_delta(c["qkv"], Hk, dk, c["g"], c["beta"], c["states"], c["read"], c["write"],
                                     c["out"])


def _transformers_call(c: dict):
    Hk, Hv, dk, dv = c["shape"]
    b = c["qkv"].shape[0]
    q, k, v = torch.split(c["qkv"], [Hk * dk, Hk * dk, Hv * dv], dim=-1)
    q, k, v = q.reshape(b, 1, Hk, dk), k.reshape(b, 1, Hk, dk), v.reshape(b, 1, Hv, dv)

    def call():
        _, state = torch_recurrent_gated_delta_rule(q, k, v, g=c["g"][:, None], beta=c["beta"][:, None],
                                                    initial_state=c["states"].index_select(0, c["read"]),
                                                    output_final_state=True, use_qk_l2norm_in_kernel=True)
        c["states"].index_copy_(0, c["write"], state)
    return call


def _copy_call(nbytes: int):
    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    return lambda: dst.copy_(src)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="q, k, v and output (states: fp32)")
    parser.add_argument("--calls", type=int, default=10, help="calls per timed round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if min(args.rows) < 1 or max(args.rows) > 256 or args.calls < 1 or args.rounds < 1:
        parser.error("--rows must be 1-256, --calls and --rounds positive")
    best = load_kernels()
    if best is None:
        parser.error("the CPU kernels are not built here (no C++ compiler?)")
    torch.set_num_threads(1)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    isas = ISA_NAMES[:best.isa + 1]
    team = ThreadTeam(best, 1)
    kernels = {isa: DecodeAttention(load_kernels(isa=isa), lambda: team) for isa in isas}
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; {args.dtype} rows, fp32 states; "
          "one thread", flush=True)
    head = "| shape | rows | " + " | ".join(f"tiermoe {isa}, ms" for isa in isas) + \
        " | transformers, ms | transformers / best | state GB/s (best) | floor GB/s |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    print(lines[0], flush=True)
    for name in args.shapes:
        for rows in args.rows:
            c = _case(*SHAPES[name], rows, dtype)
            moved = 2 * rows * c["states"][0].nbytes  # each row's state read once and written once
            calls = {isa: _kernel_call(delta, c) for isa, delta in kernels.items()}
            calls["transformers"] = _transformers_call(c)
            calls["floor"] = _copy_call(moved // 2)
            t = best_times(calls, args.calls, args.rounds)
            ours = t[isas[-1]]
            lines.append(f"| {name} | {rows} | " + " | ".join(f"{t[i] * 1e3:.3f}" for i in isas) +
                         f" | {t['transformers'] * 1e3:.3f} | {t['transformers'] / ours:.1f}x | "
                         f"{moved / ours / 1e9:.1f} | {moved / t['floor'] / 1e9:.1f} |")
            print(lines[-1], flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
