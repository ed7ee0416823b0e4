"""GPU profiles for cost estimates: memory bandwidth, compute rate, host-to-device bandwidth, launch overhead.

Presets are published figures (dense bf16 tensor rate without sparsity; PCIe as achieved with pinned memory);
a JSON file with the same fields overrides them (`save_profile` writes one, e.g. a profile measured on a real GPU
by benchmarks/gpu_check.sh). Every figure derived from a profile is an estimate and is labelled so wherever it is
printed. `this-cpu` is not a preset: `tiermoe bench placement` measures it on the spot.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from tiermoe.errors import TiermoeError


@dataclass(frozen=True)
class GPUProfile:
    name: str
    memory_bandwidth: float  # bytes/s
    compute_flops: float  # bf16 FLOP/s
    pcie_bandwidth: float  # host -> device bytes/s, pinned
    launch_overhead: float  # seconds per kernel launch
    # torch's grouped GEMM runs as one kernel per projection (CUTLASS, compute capability 9.x). Elsewhere torch
    # loops over the groups on the host (one matrix product per expert and projection), so the GPU tier's grouped
    # call launches two kernels per expert it computes (tiermoe.placement.pass_cost.gpu_tier_seconds)
    fused_grouped_gemm: bool = False

    def as_dict(self) -> dict:
        return asdict(self)


# Where each figure comes from (bandwidths in bytes/s, rates in FLOP/s):
# rtx4090  memory 1.008e12: NVIDIA's GeForce RTX 4090 specifications (384-bit GDDR6X at 21 Gbps = 1008 GB/s).
#          compute 1.65e14: NVIDIA Ada Lovelace architecture whitepaper, RTX 4090 "Peak BF16 Tensor TFLOPS with FP32
#          Accumulate" 165.2 dense (330.4 with sparsity). PCIe 25e9: PCIe 4.0 x16 is 32 GB/s a direction; pinned
#          host-to-device copies reach about 25 GB/s (CUDA bandwidthTest-class figure, not a datasheet one).
# h200     memory 4.8e12 and compute 9.89e14: NVIDIA H200 Tensor Core GPU product page / datasheet (SXM), "GPU memory
#          bandwidth 4.8TB/s" and "BF16 Tensor Core 1,979 TFLOPS" with sparsity, i.e. 989 dense. PCIe 55e9: the
#          datasheet's "PCIe Gen5: 128GB/s" is both directions, 64 GB/s host-to-device; pinned copies reach about 55
#          (80-85% of a link, as above; not a datasheet figure).
# launch overhead (5e-6, 4e-6): a kernel launch's order of magnitude on either, assumed, not published.
# fused grouped GEMM: torch runs `_grouped_mm` as one CUTLASS kernel on compute capability 9.x (the H200 is 9.0);
#          on 8.x (the RTX 4090 is 8.9) it falls back to a loop of matrix products over the groups
#          (aten/src/ATen/native/GroupedMMUtils.h, `_grouped_mm_fallback`).
PRESETS = {
    "rtx4090": GPUProfile("rtx4090", 1.008e12, 1.65e14, 25e9, 5e-6, fused_grouped_gemm=False),
    "h200": GPUProfile("h200", 4.8e12, 9.89e14, 55e9, 4e-6, fused_grouped_gemm=True),
}


def save_profile(profile: GPUProfile, path: str | Path, **extra) -> Path:
    """Write `profile` as JSON that load_profile reads back (extra keys, e.g. how it was measured, ride along)."""
    path = Path(path)
    path.write_text(json.dumps({**profile.as_dict(), **extra}, indent=2) + "\n")
    return path


def load_profile(name_or_file: str) -> GPUProfile:
    if name_or_file in PRESETS:
        return PRESETS[name_or_file]
    path = Path(name_or_file)
    if not path.is_file():
        raise TiermoeError(f"--gpu-profile '{name_or_file}' is neither a preset ({', '.join(PRESETS)}) nor a file"
                           " (`tiermoe bench placement` also takes this-cpu)")
    expected = ("expected a JSON object with memory_bandwidth, compute_flops, pcie_bandwidth (finite numbers > 0) "
                "and optionally launch_overhead (>= 0), fused_grouped_gemm (true or false) and name")
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise TypeError(f"it holds a JSON {type(data).__name__}, not an object")
        rates = {key: float(data[key]) for key in ("memory_bandwidth", "compute_flops", "pcie_bandwidth")}
        overhead = float(data.get("launch_overhead", 5e-6))
        fused = data.get("fused_grouped_gemm", False)
        if not isinstance(fused, bool):
            raise TypeError(f"fused_grouped_gemm is {fused!r}, not true or false")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError, OverflowError) as err:
        raise TiermoeError(f"GPU profile file '{path}' is malformed ({err}); {expected}") from None
    if not all(math.isfinite(v) and v > 0 for v in rates.values()) or not (math.isfinite(overhead) and overhead >= 0):
        raise TiermoeError(f"GPU profile file '{path}' has a value out of range ({rates}, launch_overhead "
                           f"{overhead}); {expected}")
    return GPUProfile(name=str(data.get("name", path.stem)), launch_overhead=overhead, fused_grouped_gemm=fused,
                      **rates)
