"""Which kernel computes the GPU tier: chosen by the device's compute capability and the dtype, so that none makes
the host wait.

`torch._grouped_mm` runs on the device alone only for bf16 on compute capability 9.x and 10.x (Hopper, Blackwell
datacentre parts); on sm80/86/89 (A100, RTX 3090/4090, A6000, L40S) and for fp16/fp32 anywhere it falls back to a
host loop over `offs.cpu()`, one sync per layer per step. Computing expert by expert costs 3 + g syncs (g: the
experts a step routes here). So:

| device | bf16 | fp16, fp32 | FP8 weights (e4m3 + block scales) |
|---|---|---|---|
| CUDA, capability 9.x or 10.x | `grouped_mm` | `triton` | `triton` (codes decoded in the kernel) |
| CUDA, any other capability | `triton` | `triton` | `triton` |
| CUDA without the triton package | `per_expert` (syncs, said in the log) | same | same |
| no CUDA (`gpu_device="cpu"`) | `grouped_mm` where torch takes the stacks, else `per_expert`: there is no host to wait for |

`triton` is tiermoe.experts.triton_grouped; the grouped-GEMM host-loop fallback is never chosen on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SYNC_FREE = ("grouped_mm", "triton")  # the kernels that queue a layer without the host waiting on the device
GROUPED_MM_CAPABILITIES = (9, 10)  # major versions where torch._grouped_mm's bf16 path is a device kernel


@dataclass(frozen=True)
class KernelChoice:
    name: str  # "grouped_mm" | "triton" | "per_expert"
    why: str

    @property
    def sync_free(self) -> bool:
        return self.name in SYNC_FREE


def choose_kernel(capability: tuple[int, int] | None, dtype: torch.dtype, fp8: bool = False,
                  triton_available: bool = True, grouped_mm_runs: bool = False) -> KernelChoice:
    """The GPU tier's kernel for activations of `dtype` (`fp8`: the weights are FP8 codes). `capability`: the CUDA
    device's (major, minor), None off CUDA; `grouped_mm_runs`: off CUDA, whether torch._grouped_mm took the stacks
    (probed by the pool)."""
    if capability is None:
        if grouped_mm_runs and not fp8:
            return KernelChoice("grouped_mm", "torch._grouped_mm takes these stacks on this device")
        return KernelChoice("per_expert", "no CUDA device: expert by expert")
    where = f"sm{capability[0]}{capability[1]}"
    if dtype == torch.bfloat16 and not fp8 and capability[0] in GROUPED_MM_CAPABILITIES:
        return KernelChoice("grouped_mm", f"torch._grouped_mm runs bf16 on the device on {where}")
    if not triton_available:
        return KernelChoice("per_expert", f"no triton package: expert by expert on {where}, with host syncs "
                                          "(torch._grouped_mm would loop on the host there too)")
    what = "FP8 codes decoded in the kernel" if fp8 else f"{str(dtype).removeprefix('torch.')}"
    return KernelChoice("triton", f"Triton grouped GEMM ({what}) on {where}: torch._grouped_mm would sync there")


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """The CUDA device's compute capability, None for any other device."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)
