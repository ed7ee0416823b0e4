"""The plan of the one GPU run (`benchmarks/gpu_check.sh`): which checks, in which order, within which time.

A GPU is lent rarely, for about 9 minutes in one call, with no network. So every check has its own time budget
(it is stopped, its threads' stacks dumped, when it overruns it), the budgets and the set-up add up to at most
LIMIT_S, and the checks run in the order of what their results are worth: if the call is cut short, what was
learnt first is what mattered most. Standard library only: `--dry-run` prints this plan without loading torch's
CUDA parts, and the child process that runs a check reads its context from here.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

# The run is meant to end within 600 s (RUN_CALL's timeout); 540 leaves a minute to stop and write the results.
LIMIT_S = 540
# The command run on the GPU machine, in a copy of the checkout with benchmarks/gpu_wheels/ (benchmarks/gpu_wheels.sh,
# run where the package registry is reachable).
RUN_CALL = "OUT=gpu-results timeout 600 bash benchmarks/gpu_check.sh"
# Before the first check: versions, the wheels' install into a target folder, the CUDA probe (the shell's part).
SETUP_S = 25

# The value order of the issue: what is worth most first.
STAGES = ("environment", "exactness", "syncs/overlap", "serving", "memory", "layerwise", "fp8", "profile")


@dataclass(frozen=True)
class Check:
    name: str
    stage: str
    budget_s: float
    target: str  # "module:function", called with a CheckContext, returning a result dict
    shows: str


def _c(name: str, stage: str, budget_s: float, module: str, shows: str) -> Check:
    return Check(name, stage, budget_s, f"tiermoe.analysis.gpu_check.{module}:check_{name}", shows)


CHECKS = (
    _c("environment", "environment", 45, "env",
       "versions in use, the GPU, every tiermoe module imports on this torch, the C++ CPU kernels build (ISA)"),
    _c("checkpoints", "environment", 30, "models",
       "the run's checkpoints written once, before any timed check: small, real (1.2 GB), tiny GPT-OSS, DeepSeek-V3"),
    _c("engine_vs_transformers", "exactness", 35, "exact",
       "Engine steps over the paged pool (8 mixed-length sequences) against transformers on this GPU, fp32 "
       "(<= 1e-5, equal greedy tokens): tiny GPT-OSS (sinks, window) and DeepSeek-V3 (MLA); the GPU-tier kernel"),
    _c("attention_in_place", "exactness", 20, "attention",
       "decode rows read the KV pool in place (Triton): the K/V bytes a decode step writes at pasts of 1k and 16k "
       "(equal), greedy tokens equal to the CPU run's"),
    _c("exactness_fp32", "exactness", 20, "exact",
       "fp32 logits at GPU ratios 0..1 against the all-CPU run (<= 1e-3)"),
    _c("exactness_bf16_native", "exactness", 30, "exact",
       "bf16, native CPU kernels, ratio 0.5: CUDA against the CPU-device run (argmax agreement + tolerance)"),
    _c("greedy_concurrency", "exactness", 30, "exact",
       "greedy generation of 8 prompts at concurrency 8 equals each prompt run alone"),
    _c("dynamic_vs_static", "exactness", 25, "exact",
       "outputs with swaps in flight (adaptive; kt-dynamic after a large prefill) equal static placement's"),
    _c("host_syncs", "syncs/overlap", 25, "syncs",
       "host synchronisations per MoE layer in one decode step (torch.cuda.set_sync_debug_mode), by source line"),
    _c("deferred_decode", "syncs/overlap", 15, "syncs",
       "ms per decode step (8 sequences, ratio 0.5) with deferred experts 0 and 2 of top-8"),
    _c("overlap_real_shapes", "syncs/overlap", 30, "syncs",
       "one layer at real shapes (H 2048, I 768, E 128, K 8): CPU tier, GPU tier, both; overlap"),
    _c("pinned_copies", "syncs/overlap", 25, "copies",
       "CPU-tier experts pinned, copies asynchronous, landed bytes equal, pinned faster than pageable"),
    _c("serving_by_ratio", "serving", 35, "items",
       "throughput and time to first token at GPU ratios 0..1, concurrency 8"),
    _c("auto_memory_budget", "memory", 35, "memory",
       "--gpu-memory-gb auto with free memory for about half the experts: the plan, then serving without OOM"),
    _c("layerwise_prefill", "layerwise", 35, "items",
       "layerwise GPU prefill through a buffer of >= 3 chunks: exact, and its time against the CPU tier"),
    _c("fp8_gpu_tier", "fp8", 40, "items",
       "FP8 GPU-tier experts: exact against their dequantised values, 1 byte/param, codes kept through moves"),
    _c("decode_profile", "profile", 20, "profile",
       "a torch.profiler table of one decode step (decode_profile.txt)"),
    _c("cost_model_calibration", "profile", 20, "items",
       "this GPU's profile (gpu_profile.json) and the CPU-only estimate against the measurement"),
)


@dataclass
class CheckContext:
    """What a check is given (it crosses into the check's own process as JSON)."""

    device: str  # "cuda:0", or "cpu" for a rehearsal on a machine without CUDA
    out_dir: str  # $OUT: the results folder copied back from the GPU machine (at most 8 files)
    work_dir: str  # checkpoints shared by the checks of one run
    quick: bool  # tiny models (a rehearsal)
    deadline: float  # time.time() by which the check must have returned

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> CheckContext:
        return cls(**json.loads(text))


def check_plan(checks=CHECKS, limit_s: float = LIMIT_S, setup_s: float = SETUP_S) -> None:
    """The plan keeps the value order and fits the limit (raises ValueError otherwise)."""
    order = [STAGES.index(c.stage) for c in checks]
    if order != sorted(order):
        raise ValueError("the checks are not in the value order " + " -> ".join(STAGES))
    total = setup_s + sum(c.budget_s for c in checks)
    if total > limit_s:
        raise ValueError(f"the budgets add up to {total:g} s, over the limit of {limit_s:g} s")


def select(names: str | None, checks=CHECKS) -> tuple[Check, ...]:
    """The checks named in a comma-separated list (all of them for None), in plan order."""
    if not names:
        return tuple(checks)
    wanted = {n.strip() for n in names.split(",") if n.strip()}
    unknown = wanted - {c.name for c in checks}
    if unknown:
        raise ValueError(f"unknown check(s): {', '.join(sorted(unknown))}; the checks are: "
                         + ", ".join(c.name for c in checks))
    return tuple(c for c in checks if c.name in wanted)


# --- the wheels the GPU machine lacks ----------------------------------------------------------------------------

# The GPU machine's image as last checked (None: present, its version not recorded).
# benchmarks/gpu_wheels.txt carries what it lacks or has too old; tests check tiermoe's dependencies are covered.
IMAGE_PACKAGES = {"torch": "2.11.0", "transformers": "5.17.0", "huggingface-hub": "1.33.0", "safetensors": "0.8.0",
                  "tokenizers": "0.23.2", "numpy": "2.5.2", "accelerate": "1.15.0", "tqdm": None, "matplotlib": None,
                  "httpx": None, "pyyaml": None, "requests": None, "packaging": None, "typer": None,
                  "filelock": None, "psutil": None, "pytest": None}
# Neither in the image nor carried: only tiermoe.server (HTTP) imports them, and no check serves HTTP.
NOT_CARRIED = {"fastapi": "tiermoe.server", "uvicorn": "tiermoe.cli.serve_http", "pydantic": "tiermoe.server",
               "starlette": "fastapi"}

def read_requirements(path: Path) -> list[tuple[str, str]]:
    """(name, pinned version) per line `name==version` of a requirements file (comments and blanks skipped)."""
    pins = []
    for line in Path(path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            if not sep:
                raise ValueError(f"{path}: '{line}' is not pinned (name==version)")
            pins.append((name.strip(), version.strip()))
    return pins


def wheel_name(name: str) -> str:
    """A distribution's name as wheel files spell it."""
    return name.replace("-", "_").replace(".", "_").lower()


def wheel_files(pins: list[tuple[str, str]], folder: Path) -> dict[str, Path | None]:
    """name -> its downloaded wheel of the pinned version in `folder`, or None."""
    found = {}
    for name, version in pins:
        matches = sorted(Path(folder).glob(f"{wheel_name(name)}-{version}-*.whl")) if Path(folder).is_dir() else []
        found[name] = matches[0] if matches else None
    return found


def plan_text(checks, limit_s: float, setup_s: float, pins, wheels: dict, skip_reason: str | None) -> str:
    """What `--dry-run` prints: the wheels, then each check with its budget and what it would do here, the
    total, and the one device call that runs it."""
    lines = [f"GPU check plan: at most {limit_s:g} s ({limit_s / 60:g} min) in one device call", "",
             "wheels carried (benchmarks/gpu_wheels/, installed with pip --no-index --no-deps --target):"]
    total_bytes = 0
    for name, version in pins:
        path = wheels.get(name)
        if path is None:
            lines.append(f"  {name}=={version}  (not downloaded: run benchmarks/gpu_wheels.sh)")
        else:
            total_bytes += path.stat().st_size
            lines.append(f"  {name}=={version}  {path.name}  {path.stat().st_size / 2**20:.1f} MiB")
    lines += [f"  together {total_bytes / 2**20:.1f} MiB", ""]
    here = "skipped: no CUDA" if skip_reason else "runs"
    if skip_reason:
        lines += [f"on this machine every check is skipped: {skip_reason}", ""]
    lines.append(f"{'#':>2}  {'check':<24}{'stage':<15}{'budget':>7}  {'here':<18}what it shows")
    lines.append(f"{0:>2}  {'(set-up)':<24}{'-':<15}{setup_s:>6g}s  {'-':<18}versions, wheels installed, CUDA probe")
    for i, c in enumerate(checks, 1):
        lines.append(f"{i:>2}  {c.name:<24}{c.stage:<15}{c.budget_s:>6g}s  {here:<18}{c.shows}")
    total = setup_s + sum(c.budget_s for c in checks)
    lines += ["", f"total {total:g} s of {limit_s:g} s", "", f"device call: {RUN_CALL}"]
    return "\n".join(lines)
