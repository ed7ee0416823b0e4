"""The CPU tier's flags, shared by every command that loads a model: backend, expert format, threads, NUMA pools
deferred experts, and the format of the non-expert weights in CPU-only runs (--non-expert-dtype).

SGLang-kt's spellings are accepted so a KTransformers launch line keeps working: `--kt-cpuinfer N` is
`--cpu-threads N`, and `--kt-method AMXINT4 | AMXINT8 | BF16` chooses the expert format (computed by tiermoe's own
kernels unless `--cpu-backend kt` asks for kt-kernel's).
"""

from __future__ import annotations

import argparse

from tiermoe.cli.flags import non_negative_int, positive_int
from tiermoe.config import CPU_BACKENDS, CPU_EXPERT_DTYPES, NON_EXPERT_AS_LOADED, NON_EXPERT_DTYPES, CPUConfig
from tiermoe.errors import TiermoeError

KT_METHODS = {"AMXINT4": "int4", "AMXINT8": "int8", "BF16": "bf16", "AMXBF16": "bf16"}


def kt_method(value: str) -> str:
    fmt = KT_METHODS.get(value.upper())
    if fmt is None:
        formats = ",".join(CPU_EXPERT_DTYPES)
        raise argparse.ArgumentTypeError(f"--kt-method '{value}' is not supported; expected one of "
                                         f"{', '.join(KT_METHODS)} (or use --cpu-expert-dtype {{{formats}}})")
    return fmt


def cpu_threads(value: str) -> int:
    """--cpu-threads: a positive integer within what this machine's CPUs can run (CPUConfig's bound)."""
    number = positive_int(value)
    try:
        CPUConfig(threads=number)
    except TiermoeError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return number


def numa_node_ids(value: str) -> list[int]:
    """One --kt-numa-nodes value: a node id, or several in one quoted word ("0 1", "0,1")."""
    ids = []
    for word in value.replace(",", " ").split():
        if not word.isdigit():
            raise argparse.ArgumentTypeError(f"'{word}' is not a NUMA node id (expected integers >= 0, e.g. 0 1)")
        ids.append(int(word))
    if not ids:
        raise argparse.ArgumentTypeError("expected NUMA node ids, e.g. --kt-numa-nodes 0 1")
    return ids


class _ExtendFlat(argparse.Action):
    """nargs="+" of values that are each a list: one flat list (repeated flags add to it)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, (getattr(namespace, self.dest) or []) + [n for v in values for n in v])


def add_cpu_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("CPU tier (docs/cpu-backends.md)")
    g.add_argument("--cpu-backend", choices=CPU_BACKENDS, default=CPUConfig().backend,
                   help=f"what computes the CPU-tier experts: native (tiermoe's kernels), torch (the reference) or kt "
                        f"(kt-kernel, if installed) (default {CPUConfig().backend})")
    g.add_argument("--cpu-expert-dtype", choices=CPU_EXPERT_DTYPES, default=None,
                   help="format the CPU-tier experts are stored and computed in, quantised once at load "
                        "(default: the checkpoint's dtype). int4 keeps the experts' down projections in int6 (6.5 "
                        "bits), as llama.cpp's Q4_K_M keeps them at Q5 / Q6: --cpu-expert-down-dtype int4 for 4 bits "
                        "throughout")
    g.add_argument("--cpu-expert-down-dtype", choices=CPU_EXPERT_DTYPES, default=None,
                   help="format of the CPU-tier experts' down projections on the native backend (default: "
                        "--cpu-expert-dtype's, int6 under int4; int4 and int6 may be paired either way)")
    g.add_argument("--non-expert-dtype", choices=(NON_EXPERT_AS_LOADED, *NON_EXPERT_DTYPES), default=None,
                   help="CPU-only runs (--gpu-device cpu): hold the non-expert linears (attention, dense and shared "
                        "MLPs, LM head) packed in this format, computed by the same kernels (routers, norms, "
                        "embeddings and MLA's kv_b stay as loaded; int4 holds attention's k / v projections in "
                        "int8 and its output projection in int6, as llama.cpp's Q4_K_M keeps them at Q8_0 and "
                        "Q5_K); 'none': torch's linears as loaded. "
                        "Default: bf16 for a bf16 model run CPU-only in one process, with the CPU tier's threads on "
                        "every physical core; the checkpoint's dtype otherwise")
    g.add_argument("--head-dtype", choices=NON_EXPERT_DTYPES, default=None,
                   help="format of the packed LM head, where the non-expert linears are packed (default: theirs, "
                        "int6 under int4, as the 6.6-bit output matrix of llama.cpp's Q4_K_M). int4 reads 0.55 "
                        "bytes a weight, int6 0.81, int8 1.0: --head-dtype int4 is the faster, coarser choice "
                        "(docs/cpu-backends.md has the measured cost of each)")
    g.add_argument("--kt-method", dest="kt_method", type=kt_method, default=None,
                   help="SGLang-kt spelling of the format: AMXINT4 = int4, AMXINT8 = int8, BF16 = bf16")
    g.add_argument("--cpu-threads", "--kt-cpuinfer", dest="cpu_threads", type=cpu_threads, default=None,
                   help="threads computing the CPU tier (default: every physical core in a CPU-only run of a bf16 "
                        "model, physical cores less one otherwise)")
    g.add_argument("--kt-numa-nodes", dest="numa_nodes", type=numa_node_ids, nargs="+",
                   action=_ExtendFlat, default=None, metavar="NODE",
                   help="split the CPU-tier threads into one pool per NODE listed, as kt-kernel does, each pinned to "
                        "that NUMA node's cores (e.g. 0 1; a node may be listed twice for two pools on it)")
    g.add_argument("--kt-max-deferred-experts-per-token", dest="deferred_experts", type=non_negative_int, default=0,
                   metavar="D",
                   help="per token, add the D lowest-weighted CPU-tier experts in the next MoE layer, so their work "
                        "overlaps it (kt-kernel's approximation: outputs change; docs/cpu-backends.md has the "
                        "measured error). Default 0: every expert in its own layer, outputs exact")


def cpu_from_args(args) -> CPUConfig:
    """The CPUConfig the flags ask for; --cpu-expert-dtype and --kt-method must agree when both are given."""
    fmt, method = getattr(args, "cpu_expert_dtype", None), getattr(args, "kt_method", None)
    if fmt is not None and method is not None and fmt != method:
        raise TiermoeError(f"--cpu-expert-dtype {fmt} and --kt-method (= {method}) disagree; give one")
    nodes = getattr(args, "numa_nodes", None)
    pools = getattr(args, "ignored_kt_threadpool_count", None)  # serve's SGLang spelling of the pool count
    if nodes and pools is not None and str(pools) != str(len(nodes)):
        raise TiermoeError(f"--kt-numa-nodes lists {len(nodes)} nodes but --kt-threadpool-count is {pools}: "
                           "give one node per pool (as SGLang-kt requires)")
    return CPUConfig(backend=getattr(args, "cpu_backend", CPUConfig().backend), expert_dtype=fmt or method,
                     threads=getattr(args, "cpu_threads", None), numa_nodes=tuple(nodes) if nodes else None,
                     deferred_experts=getattr(args, "deferred_experts", 0),
                     non_expert_dtype=getattr(args, "non_expert_dtype", None),
                     head_dtype=getattr(args, "head_dtype", None),
                     expert_down_dtype=getattr(args, "cpu_expert_down_dtype", None))
