"""CPU-tier backends by name (--cpu-backend) and the factory the loader calls once per MoE layer.

  native  tiermoe's C++ kernels (tiermoe.experts.native), bf16 / int8 / int4 / int6; the default. Experts kept in fp32 /
          fp16 (an fp32 or fp16 checkpoint without --cpu-expert-dtype) are computed by the torch reference, which
          is exact for them.
  torch   the plain-torch reference (TorchCPUExperts), in the checkpoint's dtype.
  kt      kt-kernel's AMX operators (optional: pip install 'tiermoe[kt]').
"""

from __future__ import annotations

import torch

from tiermoe.config import CPUConfig
from tiermoe.errors import TiermoeError
from tiermoe.experts.ffn import ExpertActivation
from tiermoe.experts.kt import KtCPUExperts
from tiermoe.experts.native import NativeCPUExperts
from tiermoe.experts.threads import default_threads, numa_team_cpus
from tiermoe.experts.tiers import CPUExpertBackend, CPUWorker, TorchCPUExperts


def make_cpu_tier(config: CPUConfig, worker: CPUWorker, act: ExpertActivation, pin: bool,
                  checkpoint_dtype: torch.dtype) -> CPUExpertBackend:
    """A CPU tier for one MoE layer."""
    if config.backend == "torch":
        if config.expert_dtype not in (None, "bf16") or (config.expert_dtype == "bf16"
                                                          and checkpoint_dtype != torch.bfloat16):
            raise TiermoeError(f"the torch backend keeps the checkpoint's dtype ({checkpoint_dtype}); "
                               f"--cpu-expert-dtype {config.expert_dtype} needs another --cpu-backend")
        return TorchCPUExperts(worker, act, pin=pin)
    fmt = config.expert_dtype or ("bf16" if checkpoint_dtype == torch.bfloat16 else None)
    threads = config.threads or default_threads()
    if config.numa_nodes is not None:
        numa_team_cpus(threads, config.numa_nodes)  # a node that is missing or too small: say so before loading
    if config.backend == "native":
        if fmt is None:
            return TorchCPUExperts(worker, act, pin=pin)

        return NativeCPUExperts(worker, act, fmt, checkpoint_dtype, threads, pin=pin, numa_nodes=config.numa_nodes,
                                down_fmt=config.down_format)
    if config.backend == "kt":
        return KtCPUExperts(worker, act, fmt or "bf16", checkpoint_dtype, threads, pin=pin,
                            numa_nodes=config.numa_nodes)
    raise TiermoeError(f"cpu backend '{config.backend}' is unknown")
