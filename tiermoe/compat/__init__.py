"""KTransformers-compatible Python API, backed by the same code as tiermoe's engine (no second implementation).

    from tiermoe.compat import generate_gpu_experts_masks, get_moe_arch_config, move_non_experts_to_gpu
    from tiermoe.compat import KExpertsCPUBuffer  # CPU experts in shared memory, kt-kernel's staging buffers
"""

from tiermoe.compat.arch_config import (
                                      MOEArchConfig,
                                      MOEArchNotSupportedError,
                                      get_moe_arch_config,
)
from tiermoe.compat.cpu_buffer import KExpertsCPUBuffer, StagingBuffers
from tiermoe.compat.placement import (
                                      build_device_map,
                                      generate_gpu_experts_masks,
                                      move_non_experts_to_gpu,
                                      num_gpu_experts_from_env,
)

__all__ = [
    "KExpertsCPUBuffer",
    "MOEArchConfig",
    "MOEArchNotSupportedError",
    "StagingBuffers",
    "build_device_map",
    "generate_gpu_experts_masks",
    "get_moe_arch_config",
    "move_non_experts_to_gpu",
    "num_gpu_experts_from_env",
]
