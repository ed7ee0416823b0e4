"""The GPU check's first check: is this machine's software what tiermoe needs, before anything is measured.

The GPU machine's image brings its own torch and transformers (2.11 and 5.17 when last read); tiermoe has
never been imported there. So: the versions actually imported (the carried wheels must win over the image's),
transformers in the range we test (pyproject.toml), every tiermoe module importable on this torch (an API newer than it fails
here, not halfway through a check), the C++ CPU kernels built with this machine's compiler and right on every
instruction set its CPU has (a server CPU may have AMX, which no developer's machine had), and CUDA itself:
a bf16 matrix product against the CPU's, a pinned buffer, a copy there and back.
"""

from __future__ import annotations

import importlib
import pkgutil
import time
import warnings
from pathlib import Path

import torch
import transformers
from packaging.version import Version

import tiermoe
from tiermoe.analysis.gpu_check.plan import NOT_CARRIED, CheckContext
from tiermoe.arch.transformers_version import declared_range
from tiermoe.experts.ffn import ExpertActivation, routed_experts_forward
from tiermoe.experts.kernels import ISA_NAMES, supported_isa
from tiermoe.experts.native import NativeCPUExperts
from tiermoe.experts.threads import default_threads
from tiermoe.experts.tiers import CPUWorker
from tiermoe.experts.weights import ExpertWeights

KERNEL_TOLERANCE = 2e-2  # bf16 activations (AMX, AVX512-BF16): the unit tests' bound


def check_environment(ctx: CheckContext) -> dict:
    result = {"torch": torch.__version__, "torch_file": torch.__file__, "transformers": transformers.__version__,
              "transformers_file": transformers.__file__, "tiermoe_file": tiermoe.__file__}
    problems = []
    tested = declared_range()
    if tested is None or not tested.contains(Version(transformers.__version__), prereleases=True):
        problems.append(f"transformers {transformers.__version__} is outside the tested range {tested} (the wheels "
                        "were not used?)")
    imports = import_every_module()
    result["imports"] = imports
    if imports["failed"]:
        problems.append(f"{len(imports['failed'])} tiermoe module(s) do not import: " + ", ".join(imports["failed"]))
    kernels = cpu_kernels()
    result["cpu_kernels"] = kernels
    if kernels["isa"] is None:
        problems.append(f"the C++ CPU kernels are unavailable: {kernels.get('why')}")
    bad = [isa for isa, err in kernels.get("relative_error_by_isa", {}).items() if err > KERNEL_TOLERANCE]
    if bad:
        problems.append(f"CPU kernels wrong on {', '.join(bad)} (relative error > {KERNEL_TOLERANCE})")
    if ctx.cuda:
        result["cuda"] = cuda_sanity(torch.device(ctx.device))
        if not result["cuda"]["ok"]:
            problems.append("CUDA sanity: " + result["cuda"]["why"])
    else:
        result["cuda"] = "skipped: no CUDA"
    return {"status": "fail" if problems else "pass", **({"problems": problems} if problems else {}), **result}


def import_every_module() -> dict:
    """Import each tiermoe module; a module needing a package that is not carried (NOT_CARRIED: the checks do
    not serve HTTP) is only listed."""
    root = Path(tiermoe.__file__).parent
    ok, failed, not_carried = 0, {}, {}
    for info in pkgutil.walk_packages([str(root)], prefix="tiermoe."):
        try:
            importlib.import_module(info.name)
            ok += 1
        except ModuleNotFoundError as err:
            if (err.name or "").split(".")[0] in NOT_CARRIED:
                not_carried[info.name] = err.name
            else:
                failed[info.name] = f"{type(err).__name__}: {err}"
        except Exception as err:  # noqa: BLE001 - any failure to import is what this check reports
            failed[info.name] = f"{type(err).__name__}: {err}"
    return {"imported": ok, "failed": failed, "not_carried": not_carried}


def cpu_kernels(hidden: int = 2048, inter: int = 768, experts: int = 8, top_k: int = 4) -> dict:
    """Build the kernels (timed), then each instruction set this CPU has against the torch reference, in bf16
    at real layer shapes."""
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        best = supported_isa()
    result = {"isa": best, "build_or_load_s": round(time.perf_counter() - start, 2)}
    if best is None:
        result["why"] = "; ".join(str(w.message) for w in caught) or "unknown"
        return result
    act = ExpertActivation("silu_glu")
    gen = torch.Generator().manual_seed(0)
    weights = {e: ExpertWeights((torch.randn(2 * inter, hidden, generator=gen) * 0.02).bfloat16(),
                                (torch.randn(hidden, inter, generator=gen) * 0.02).bfloat16()) for e in range(experts)}
    errors = {}
    worker = CPUWorker()
    try:
        for isa in ISA_NAMES[: ISA_NAMES.index(best) + 1]:
            tier = NativeCPUExperts(worker, act, "bf16", torch.bfloat16, default_threads(), isa=isa)
            for e, w in weights.items():
                tier.add(e, w)
            worst = 0.0
            for tokens in (1, 5, 64):
                x = torch.randn(tokens, hidden, generator=gen).bfloat16()
                ids = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=1).indices
                w = torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=1)
                tier.submit(x, ids, w)
                y = tier.sync().float()
                fp32 = {e: ExpertWeights(*(t.float() for t in tier.get(e).tensors())) for e in weights}
                ref = routed_experts_forward(fp32, x.float(), ids, w, act)
                worst = max(worst, float((y - ref).abs().max() / ref.abs().max()))
            errors[isa] = worst
    finally:
        worker.close()
    result["relative_error_by_isa"] = errors
    return result


def cuda_sanity(device: torch.device) -> dict:
    props = torch.cuda.get_device_properties(device)
    result = {"gpu": props.name, "capability": f"{props.major}.{props.minor}", "total_gib": props.total_memory / 2**30,
              "multiprocessors": props.multi_processor_count, "torch_cuda": torch.version.cuda,
              "sync_debug_mode": hasattr(torch.cuda, "set_sync_debug_mode")}
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(1024, 1024, generator=gen), torch.randn(1024, 1024, generator=gen)
    ref = a @ b
    got = (a.to(device, torch.bfloat16) @ b.to(device, torch.bfloat16)).float().cpu()
    result["bf16_matmul_rel_err"] = float((got - ref).abs().max() / ref.abs().max())
    pinned = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
    pinned.random_(0, 256, generator=gen)
    back = pinned.to(device, non_blocking=True).to("cpu")
    torch.cuda.synchronize(device)
    result["pinned"] = pinned.is_pinned()
    result["round_trip_equal"] = bool(torch.equal(back, pinned))
    why = []
    if result["bf16_matmul_rel_err"] > 2e-2:
        why.append(f"bf16 matmul relative error {result['bf16_matmul_rel_err']:.3g}")
    if not result["pinned"] or not result["round_trip_equal"]:
        why.append("a pinned 64 MiB buffer did not come back equal from the GPU")
    result["ok"] = not why
    if why:
        result["why"] = "; ".join(why)
    return result
