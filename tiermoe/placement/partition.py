"""Split the GPU experts of a mask over N GPUs: assignment [L, E] with -1 for CPU and the rank otherwise.

balanced (default): each GPU gets the same number of experts (its memory share, within one), and the expected
  load (statistics mass) per GPU is evened out by longest-processing-time-first assignment.
layers: contiguous layer ranges per GPU, early layers on GPU 0 (the GPU experts in layer-major order, cut
  into N runs of near-equal length).
round-robin: the GPU experts in layer-major order dealt to GPUs in turn.
"""

from __future__ import annotations

import torch

from tiermoe.errors import TiermoeError

GPU_SPLITS = ("balanced", "layers", "round-robin")


def split_across_gpus(mask_LE: torch.Tensor, num_gpus: int, method: str = "balanced",
                      counts_LE: torch.Tensor | None = None) -> torch.Tensor:
    if num_gpus < 1:
        raise TiermoeError(f"--num-gpus must be >= 1, got {num_gpus}")
    if method not in GPU_SPLITS:
        raise TiermoeError(f"unknown --gpu-split '{method}'; choose one of: {', '.join(GPU_SPLITS)}")
    mask_LE = torch.as_tensor(mask_LE).bool()
    assignment = torch.full(mask_LE.shape, -1, dtype=torch.int64)
    positions = mask_LE.nonzero().tolist()  # layer-major
    n = len(positions)
    if n == 0:
        return assignment
    if method == "round-robin":
        ranks = [i % num_gpus for i in range(n)]
    elif method == "layers":
        bounds = [round(r * n / num_gpus) for r in range(num_gpus + 1)]
        ranks = [r for r in range(num_gpus) for _ in range(bounds[r], bounds[r + 1])]
    else:
        ranks = _balanced_ranks(positions, num_gpus, counts_LE)
    for (layer, expert), rank in zip(positions, ranks):
        assignment[layer, expert] = rank
    return assignment


def _balanced_ranks(positions: list[list[int]], num_gpus: int, counts_LE) -> list[int]:
    """LPT: heaviest expert first, onto the least-loaded GPU that still has room (capacity ceil(n / N))."""
    n = len(positions)
    capacity = -(-n // num_gpus)
    loads = [float(counts_LE[layer, expert]) if counts_LE is not None else 1.0 for layer, expert in positions]
    order = sorted(range(n), key=lambda i: (-loads[i], i))
    gpu_load, gpu_count, ranks = [0.0] * num_gpus, [0] * num_gpus, [0] * n
    for i in order:
        rank = min((r for r in range(num_gpus) if gpu_count[r] < capacity), key=lambda r: (gpu_load[r], gpu_count[r], r))
        ranks[i] = rank
        gpu_load[rank] += loads[i]
        gpu_count[rank] += 1
    return ranks


def load_per_gpu(assignment: torch.Tensor, num_gpus: int, counts_LE: torch.Tensor) -> list[float]:
    """Statistics mass each GPU serves."""
    counts = torch.as_tensor(counts_LE, dtype=torch.float64)
    return [float(counts[assignment == r].sum()) for r in range(num_gpus)]
