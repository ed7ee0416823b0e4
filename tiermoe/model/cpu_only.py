"""CPU-only inference: every product of a step on the kernels' thread team, and every core in that team.

Without a GPU the CPU computes the whole step. Measured on a 2-core box (docs/cpu-backends.md, "CPU-only runs"):
with torch's linears beside a kernel team of one thread, torch's OpenMP pool and the team share the cores badly
(torch's bf16 LM head of a Qwen3-30B-A3B-shaped model read ~16 GB/s on two threads, the kernels ~28 GB/s; a team
of two with torch's two threads beside it spins on the same cores and decodes slower than one of one). So a
CPU-only run of a bf16 model holds its non-expert linears packed in bf16 (the same values; only the products'
summation order changes, as on any BLAS) and computes them on the team, the team takes every physical core, and
torch keeps the cores the team leaves (at least one) for what is still its own in a step: embeddings, norms of
other layouts, prompt attention, sampling.

Applies to one process (not to ranks, which split the cores between them), inference only, the native backend
with its kernels built, and a bf16 model: an fp32 model has no packed format of its own values, so it keeps
torch's linears and the defaults of tiermoe.experts.threads. `--non-expert-dtype none` keeps torch's linears
(and those defaults) for a bf16 model too; `--cpu-threads` still sets the team.
"""

from __future__ import annotations

import dataclasses

import torch

from tiermoe.config import CPUConfig
from tiermoe.experts.kernels import load_kernels
from tiermoe.experts.threads import physical_cpus


def cpu_only_defaults(cpu: CPUConfig, gpu_device: torch.device, dtype: torch.dtype, trainable: bool,
                      multi_rank: bool) -> CPUConfig:
    """`cpu` with the CPU-only defaults filled in (see the module docstring); unchanged where they do not apply."""
    if cpu.non_expert_dtype is None and packs_by_default(cpu, gpu_device, dtype, trainable, multi_rank):
        cpu = dataclasses.replace(cpu, non_expert_dtype="bf16")
    if cpu.packs_non_experts and cpu.threads is None and not multi_rank:
        cpu = dataclasses.replace(cpu, threads=len(physical_cpus()))
    return cpu


def packs_by_default(cpu: CPUConfig, gpu_device: torch.device, dtype: torch.dtype, trainable: bool,
                     multi_rank: bool) -> bool:
    """Whether a run that did not choose --non-expert-dtype gets bf16 (the module docstring's conditions)."""
    return (gpu_device.type == "cpu" and not trainable and not multi_rank and dtype == torch.bfloat16
            and cpu.backend == "native" and load_kernels() is not None)


def torch_threads_beside(cpu: CPUConfig) -> int | None:
    """torch's intra-op threads during a forward: with packed non-expert linears, the physical cores the kernel
    team leaves (at least one); None (torch's own setting) otherwise."""
    if not cpu.packs_non_experts or cpu.threads is None:
        return None
    return max(1, len(physical_cpus()) - cpu.threads)
