"""SGLang / KTransformers launch flags that have no counterpart in tiermoe: accepted, and said to be without effect.

A KTransformers launch line (`python -m sglang.launch_server ...`) carries flags for SGLang's own engine (attention
backend, static memory fraction, tensor parallelism, ...) and for kt-kernel's weight files and NUMA pools. So that
such a line works with `tiermoe serve` in its place, these flags parse; tiermoe then prints one line naming the ones
it ignores and why, rather than failing on them or dropping them silently.
"""

from __future__ import annotations

import argparse
import sys

# flag -> (takes a value, why tiermoe does without it)
IGNORED = {
    "--kt-weight-path": (True, "experts are quantised from --model at load (or converted once: `tiermoe convert`)"),
    "--kt-threadpool-count": (True, "one CPU thread team (--cpu-threads), split into pools only by --kt-numa-nodes, "
                                    "which must then list as many nodes"),
    "--trust-remote-code": (False, "models are built from transformers' own classes"),
    "--mem-fraction-static": (True, "GPU memory is sized by placement (--gpu-memory-gb) and --max-total-tokens"),
    "--enable-mixed-chunk": (False, "prefill chunks always share steps with running decodes"),
    "--tensor-parallel-size": (True, "several GPUs split the experts: --num-gpus"),
    "--tp-size": (True, "several GPUs split the experts: --num-gpus"),
    "--enable-p2p-check": (False, "no peer-to-peer transfers"),
    "--disable-shared-experts-fusion": (False, "shared experts are never fused with routed ones"),
    "--max-lora-rank": (True, "adapters of any rank load: each loaded adapter's factors are stacked as they come"),
    "--lora-backend": (True, "adapters per request take tiermoe's own products (a kernel call per MoE layer)"),
    "--fp8-gemm-backend": (True, "FP8 checkpoints' matmuls run tiermoe's own block-FP8 path (docs/checkpoint-"
                                 "formats.md)"),
}


def _dest(flag: str) -> str:
    return "ignored_" + flag.lstrip("-").replace("-", "_")


def add_sglang_compat_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("SGLang / KTransformers flags accepted without effect (one line says which)")
    for flag, (takes_value, why) in IGNORED.items():
        dest = _dest(flag)
        if takes_value:
            g.add_argument(flag, dest=dest, metavar="X", default=None, help=f"ignored: {why}")
        else:
            g.add_argument(flag, dest=dest, action="store_true", default=None, help=f"ignored: {why}")


def ignored_flags(args) -> list[str]:
    """The ignored flags the user gave, as `--flag value` (or `--flag`)."""
    given = []
    for flag, (takes_value, _) in IGNORED.items():
        if flag == "--kt-threadpool-count" and getattr(args, "numa_nodes", None):
            continue  # it is then the pool count --kt-numa-nodes is checked against
        value = getattr(args, _dest(flag), None)
        if value is not None:
            given.append(f"{flag} {value}" if takes_value else flag)
    return given


def report_ignored(args, stream=None) -> None:
    """One line on stderr naming the SGLang flags given that tiermoe does without, and why."""
    given = ignored_flags(args)
    if given:
        reasons = "; ".join(f"{g} ({IGNORED[g.split()[0]][1]})" for g in given)
        print(f"note: without effect in tiermoe: {reasons}", file=stream or sys.stderr, flush=True)
