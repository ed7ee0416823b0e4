"""CPU-tier backends by name (--cpu-backend) and the factory the loader calls once per MoE layer."""

from __future__ import annotations

import torch

from tiermoe.config import CPUConfig
from tiermoe.errors import TiermoeError
from tiermoe.experts.ffn import ExpertActivation
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
    raise TiermoeError(f"cpu backend '{config.backend}' is unknown")
