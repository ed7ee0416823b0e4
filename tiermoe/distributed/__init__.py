"""Several GPUs on torch.distributed: one rank per GPU, the GPU experts split, one host copy of the CPU experts.

- group.py: the process group (NCCL or gloo for the data, gloo for control), its timeouts, RankFailure;
- shm_store.py: the CPU-tier experts once per host, in /dev/shm files every rank can map;
- share.py: one rank's share of the model, as the loader and the MoE blocks use it;
- step_plan.py / follower.py: rank 0 publishes each step, the other ranks run the same forwards;
- swaps.py: expert swaps applied by all ranks at the same step boundary;
- rank_model.py: loading a rank's share (rank 0: an LLM; the others: a follower);
- launch.py: starting ranks without torchrun (`tiermoe serve` as a rank lives in tiermoe.cli.serve_ranks);
- memory.py: PSS, the host-memory measure that counts shared pages once.
See docs/multi-gpu.md.
"""

from tiermoe.distributed.group import DEFAULT_DIST_TIMEOUT_S, RankEnv, RankFailure, RankGroup, rank_device
from tiermoe.distributed.launch import rank_env, spawn_ranks
from tiermoe.distributed.memory import memory_rollup, pss_bytes
from tiermoe.distributed.rank_model import RankModel

__all__ = ["DEFAULT_DIST_TIMEOUT_S", "RankEnv", "RankFailure", "RankGroup", "RankModel", "memory_rollup",
           "pss_bytes", "rank_device", "rank_env", "spawn_ranks"]
