"""KTransformers' fine-tuning settings, `ACCELERATE_KT_*`, read with KT's meanings and defaults.

KT's SFT path (kt_kernel.sft's KTConfig, set by `accelerate launch` from LLaMA-Factory's kt_config) reads its
settings from the environment. `tiermoe finetune` and scripts that fine-tune a hybrid model read the same names,
so a KT launch environment keeps its meaning; a flag given on the command line wins over its variable.

What each name does here:
- NUM_GPU_EXPERTS (default 0): GPU-tier experts per MoE layer, chosen by the inference planner: frequency when a
  statistics file is given, else KT's own rule, the first n experts of every layer (the `uniform` strategy).
  Unset (and no flag): the loader's default, every expert on the CPU tier unless the checkpoint carries a mask.
- LORA_RANK, LORA_ALPHA (default 2 x rank), LORA_DROPOUT (default 0): the LoRA on attention, dense projections
  and every routed expert.
- BACKEND / EXPERT_WEIGHT_FORMAT: the CPU tier's expert format. AMXBF16 / bf16 -> bf16, AMXINT8 / int8 -> int8,
  AMXINT4 -> int4 (tiermoe's own kernels; the frozen base is dequantised on the fly); a `_SkipLoRA` backend
  leaves the experts without LoRA. Unset: the checkpoint's dtype (KT's default, AMXBF16, for a bf16 checkpoint).
- NUM_THREADS: threads of the CPU tier, at most what the machine runs. Unset: tiermoe's default (physical cores
  less one), not KT's 1, which sizes kt-kernel's own pool. OMP_NUM_THREADS: torch's threads for the rest.
- MODEL_MAX_LENGTH: the longest training sequence.
- ACTIVATION_POLICY: a JSON object {"cpu": "retain"|"recompute", "gpu": "retain"|"recompute"} (KT's
  KTActivationPolicy; KT's launcher writes it from kt_activation_policy). gpu=recompute turns gradient
  checkpointing on (each decoder layer recomputed in backward: `tiermoe finetune --gradient-checkpointing`),
  gpu=retain leaves it off. tiermoe's CPU tier always keeps only a layer's input and recomputes its experts in
  backward, so cpu=retain (kt-kernel's cache of the experts' forward activations) comes back as a note.
Not implemented, each a one-line error: TRAIN_MODE full / hybrid (full-weight training), USE_LORA_EXPERTS=1
(KT's extra GPU-side LoRA experts), the fp8 / rawint4 / mxfp4 formats, TP_ENABLED=1. kt-kernel's memory and
loading knobs (MAX_CACHE_DEPTH, SHARE_BACKWARD_BB, WEIGHT_LIFECYCLE, THREADPOOL_COUNT, WEIGHT_PATH, ...) have
nothing to act on in tiermoe: their values are checked, and each set one comes back as a one-line note.
An unknown ACCELERATE_KT_* name, or a malformed or out-of-range value, is a one-line error saying what is expected.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from tiermoe.config import CPUConfig, PlacementConfig, machine_cpus
from tiermoe.errors import TiermoeError
from tiermoe.training.lora import MAX_RANK

PREFIX = "ACCELERATE_KT_"
TRAIN_MODES = ("lora", "full", "hybrid")
WEIGHT_FORMATS = {"bf16": "bf16", "int8": "int8", "fp8": None, "rawint4": None, "mxfp4": None}  # None: not here
# kt-kernel SFT backends (the `_SFT` suffix and KGroup variants name the same formats).
BACKENDS = {"AMXBF16": "bf16", "BF16": "bf16", "AMXINT8": "int8", "INT8": "int8", "AMXINT4": "int4",
            "AMXINT4_1": "int4", "AMXINT4_KGROUP": "int4", "AMXINT4_1_KGROUP": "int4", "AMXFP8": None, "FP8": None,
            "MXFP4": None, "RAWINT4": None}
MAX_SEQUENCE = 1 << 24  # tokens in one training sequence: far past any model's positions, a typo beyond
# Settings whose values are checked but that act on nothing in tiermoe: name -> (parser, what it is in KT).
KT_ONLY = {
    "WEIGHT_LIFECYCLE": ("lifecycle", "when kt-kernel frees its converted weights"),
    "TP_ENABLED": ("bool", "tensor parallelism"),
    "THREADPOOL_COUNT": ("positive", "kt-kernel's thread pools (NUMA sub-pools)"),
    "WEIGHT_PATH": ("text", ("kt-kernel's pre-converted expert weights (tiermoe reads the checkpoint, or a "
                             "`tiermoe convert` cache)")),
    "NON_EXPERT_WEIGHT_PATH": ("text", "a separate non-expert checkpoint"),
    "EXPERT_CHECKPOINT_PATH": ("text", "a separate expert checkpoint"),
    "SKIP_EXPERT_LOADING": ("bool", "skipping the expert weights at load"),
    "MAX_CACHE_DEPTH": ("positive", "kt-kernel's cache of forward activations for backward"),
    "SHARE_BACKWARD_BB": ("bool", "kt-kernel's shared backward buffers"),
    "SHARE_CACHE_POOL": ("bool", "kt-kernel's shared cache pool"),
    "FORCE_FUSED_EXPERT_LORA": ("bool", "kt-kernel's fused expert-LoRA kernels"),
}
USED = ("NUM_GPU_EXPERTS", "LORA_RANK", "LORA_ALPHA", "LORA_DROPOUT", "BACKEND", "EXPERT_WEIGHT_FORMAT", "NUM_THREADS",
        "OMP_NUM_THREADS", "MODEL_MAX_LENGTH", "TRAIN_MODE", "USE_LORA_EXPERTS", "LORA_EXPERT_NUM",
        "LORA_EXPERT_INTERMEDIATE_SIZE", "ACTIVATION_POLICY")
ACTIVATION_RETENTION = ("retain", "recompute")
KNOWN = USED + tuple(KT_ONLY)


@dataclass(frozen=True)
class KTTrainingSettings:
    """The fine-tuning settings KT's variables and the command line's flags describe, with KT's defaults.

    lora_rank None: neither a flag nor ACCELERATE_KT_LORA_RANK gave one. expert_dtype None: the checkpoint's.
    threads / torch_threads / max_length / gradient_checkpointing None: tiermoe's defaults. notes: one line for
    each KT-only setting given (and ACTIVATION_POLICY's cpu=retain).
    """

    num_gpu_experts: int | None = None  # None: neither gave it (the loader's default placement)
    lora_rank: int | None = None
    lora_alpha: float | None = None
    lora_dropout: float = 0.0
    expert_dtype: str | None = None
    expert_lora: bool = True
    threads: int | None = None
    torch_threads: int | None = None
    max_length: int | None = None
    gradient_checkpointing: bool | None = None  # None: neither a flag nor ACTIVATION_POLICY gave it
    notes: tuple[str, ...] = ()

    @property
    def alpha(self) -> float | None:
        """LoRA alpha: as given, else 2 x rank (KT's default)."""
        if self.lora_alpha is not None:
            return self.lora_alpha
        return None if self.lora_rank is None else 2.0 * self.lora_rank


def _bool(name: str, value: str) -> bool:
    low = value.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise TiermoeError(f"{name}={value!r}: expected a boolean (1/0, true/false, yes/no)")


def _int(name: str, value: str, low: int, high: int, what: str) -> int:
    try:
        number = int(value.strip())
    except ValueError:
        raise TiermoeError(f"{name}={value!r}: expected an integer ({what})") from None
    if not low <= number <= high:
        raise TiermoeError(f"{name}={number}: expected {what} between {low} and {high}")
    return number


def _float(name: str, value: str, low: float, high: float, what: str, high_open: bool = False) -> float:
    try:
        number = float(value.strip())
    except ValueError:
        raise TiermoeError(f"{name}={value!r}: expected a number ({what})") from None
    if not math.isfinite(number) or number < low or number > high or (high_open and number == high):
        bound = f"[{low}, {high})" if high_open else f"between {low} and {high}"
        raise TiermoeError(f"{name}={value}: expected {what} {bound}")
    return number


def _threads(name: str, value: int) -> int:
    try:
        CPUConfig(threads=value)  # the machine's bound on threads, one rule for every command
    except TiermoeError as err:
        raise TiermoeError(f"{name}: {err}") from None
    return value


def kt_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ACCELERATE_KT_* variables that are set (an empty value is unset, as in KT), by short name; an unknown
    name is an error."""
    environ = os.environ if environ is None else environ
    found = {k[len(PREFIX):]: v for k, v in environ.items() if k.startswith(PREFIX) and v != ""}
    unknown = sorted(set(found) - set(KNOWN))
    if unknown:
        raise TiermoeError(f"unknown KTransformers setting {PREFIX}{unknown[0]}; known: "
                           f"{', '.join(PREFIX + n for n in sorted(KNOWN))}")
    return found


def _expert_dtype(env: dict[str, str]) -> tuple[str | None, bool]:
    """(tiermoe's CPU expert dtype or None, expert LoRA on) from BACKEND and EXPERT_WEIGHT_FORMAT."""
    from_format = from_backend = None
    expert_lora = True
    if "EXPERT_WEIGHT_FORMAT" in env:
        value = env["EXPERT_WEIGHT_FORMAT"].strip().lower()
        if value not in WEIGHT_FORMATS:
            raise TiermoeError(f"{PREFIX}EXPERT_WEIGHT_FORMAT={env['EXPERT_WEIGHT_FORMAT']!r}: expected one of "
                               f"{', '.join(WEIGHT_FORMATS)}")
        from_format = WEIGHT_FORMATS[value]
        if from_format is None:
            raise TiermoeError(f"{PREFIX}EXPERT_WEIGHT_FORMAT={value}: {value} CPU experts are not implemented in "
                               "tiermoe (bf16 and int8 are; int4 through BACKEND=AMXINT4)")
    if "BACKEND" in env and env["BACKEND"].strip().lower() != "auto":
        value = env["BACKEND"].strip().upper()
        base = value.removesuffix("_SKIPLORA").removesuffix("_SFT")
        if value.endswith("_SKIPLORA"):
            expert_lora = False
        if base not in BACKENDS:
            raise TiermoeError(f"{PREFIX}BACKEND={env['BACKEND']!r}: expected auto or one of {', '.join(BACKENDS)} "
                               "(optionally with _SFT or _SkipLoRA)")
        from_backend = BACKENDS[base]
        if from_backend is None:
            raise TiermoeError(f"{PREFIX}BACKEND={env['BACKEND']}: its expert format is not implemented in tiermoe "
                               "(AMXBF16, AMXINT8 and AMXINT4 are)")
    if from_format and from_backend and from_format != from_backend:
        raise TiermoeError(f"{PREFIX}BACKEND={env['BACKEND']} ({from_backend}) and EXPERT_WEIGHT_FORMAT="
                           f"{env['EXPERT_WEIGHT_FORMAT']} disagree; set one")
    return from_backend or from_format, expert_lora


def _check_not_implemented(env: dict[str, str]) -> None:
    mode = env.get("TRAIN_MODE", "lora").strip().lower()
    if mode not in TRAIN_MODES:
        raise TiermoeError(f"{PREFIX}TRAIN_MODE={env['TRAIN_MODE']!r}: expected one of {', '.join(TRAIN_MODES)}")
    if mode != "lora":
        raise TiermoeError(f"{PREFIX}TRAIN_MODE={mode}: full-weight training is not implemented in tiermoe "
                           "(TRAIN_MODE=lora is)")
    for name in ("LORA_EXPERT_NUM", "LORA_EXPERT_INTERMEDIATE_SIZE"):
        if name in env:
            _int(PREFIX + name, env[name], 1, 1 << 20, "a positive count")
    if "USE_LORA_EXPERTS" in env and _bool(PREFIX + "USE_LORA_EXPERTS", env["USE_LORA_EXPERTS"]):
        raise TiermoeError(f"{PREFIX}USE_LORA_EXPERTS=1: KT's extra GPU-side LoRA experts are not implemented in "
                           "tiermoe (its LoRA is on every routed expert, KT's default SFT mode)")


def _activation_policy(value: str) -> tuple[bool, str | None]:
    """(gradient checkpointing on, a note or None) from ACTIVATION_POLICY's JSON object, checked as KT checks it."""
    name = PREFIX + "ACTIVATION_POLICY"
    expected = ('expected a JSON object with exactly the keys cpu and gpu, each "retain" or "recompute", e.g. '
                '{"cpu": "recompute", "gpu": "recompute"}')
    try:
        policy = json.loads(value)
    except json.JSONDecodeError:
        raise TiermoeError(f"{name}={value!r}: {expected}") from None
    if not isinstance(policy, dict) or set(policy) != {"cpu", "gpu"} or \
            any(policy[k] not in ACTIVATION_RETENTION for k in policy):
        raise TiermoeError(f"{name}={value!r}: {expected}")
    note = None
    if policy["cpu"] == "retain":
        note = (f"{name} cpu=retain (kt-kernel's cache of the CPU experts' forward activations) has no effect in "
                "tiermoe: its CPU tier keeps a layer's input and recomputes the experts in backward")
    return policy["gpu"] == "recompute", note


def _kt_only_notes(env: dict[str, str]) -> tuple[str, ...]:
    notes = []
    for name, (kind, what) in KT_ONLY.items():
        if name not in env:
            continue
        value, full = env[name], PREFIX + name
        if kind == "bool":
            on = _bool(full, value)
            if name == "TP_ENABLED" and on:
                raise TiermoeError(f"{full}=1: tensor-parallel fine-tuning is not implemented in tiermoe (one "
                                   "process: set it to 0)")
        elif kind == "positive":
            _int(full, value, 1, 1 << 20, "a positive count")
        elif kind == "lifecycle" and value.strip().lower() not in ("persistent", "ephemeral"):
            raise TiermoeError(f"{full}={value!r}: expected persistent or ephemeral")
        notes.append(f"{full} ({what}) has no effect in tiermoe")
    return tuple(notes)


def read_kt_settings(environ: Mapping[str, str] | None = None, *, num_gpu_experts: int | None = None,
                     lora_rank: int | None = None, lora_alpha: float | None = None,
                     lora_dropout: float | None = None, expert_dtype: str | None = None, threads: int | None = None,
                     max_length: int | None = None,
                     gradient_checkpointing: bool | None = None) -> KTTrainingSettings:
    """The settings from ACCELERATE_KT_* (default: os.environ), each keyword given (not None) winning over its
    variable. Errors are one line (see the module docstring)."""
    env = kt_environment(environ)
    _check_not_implemented(env)
    notes = _kt_only_notes(env)
    env_dtype, expert_lora = _expert_dtype(env)

    def pick(flag, name, parse):
        if flag is not None:
            return flag
        return parse(PREFIX + name, env[name]) if name in env else None

    rank = pick(lora_rank, "LORA_RANK", lambda n, v: _int(n, v, 1, MAX_RANK, "a LoRA rank"))
    alpha = pick(lora_alpha, "LORA_ALPHA", lambda n, v: _float(n, v, 1e-6, 1e9, "a LoRA alpha > 0"))
    dropout = pick(lora_dropout, "LORA_DROPOUT", lambda n, v: _float(n, v, 0.0, 1.0, "a dropout probability",
                                                                     high_open=True))
    gpu = pick(num_gpu_experts, "NUM_GPU_EXPERTS", lambda n, v: _int(n, v, 0, 1 << 20, "GPU experts per MoE layer"))
    cpu_threads = pick(threads, "NUM_THREADS", lambda n, v: _threads(n, _int(n, v, 1, 1 << 20, "a thread count")))
    torch_threads = pick(None, "OMP_NUM_THREADS",
                         lambda n, v: _int(n, v, 1, machine_cpus(), "torch threads (at most this machine's CPUs)"))
    length = pick(max_length, "MODEL_MAX_LENGTH", lambda n, v: _int(n, v, 2, MAX_SEQUENCE, "a sequence length"))
    if "ACTIVATION_POLICY" in env:  # checked even under the flag, as every set variable is
        recompute, note = _activation_policy(env["ACTIVATION_POLICY"])
        notes += (note,) if note else ()
        gradient_checkpointing = recompute if gradient_checkpointing is None else gradient_checkpointing
    return KTTrainingSettings(
        num_gpu_experts=gpu, lora_rank=rank, lora_alpha=alpha, lora_dropout=dropout or 0.0,
        expert_dtype=expert_dtype if expert_dtype is not None else env_dtype, expert_lora=expert_lora,
        threads=cpu_threads, torch_threads=torch_threads, max_length=length,
        gradient_checkpointing=gradient_checkpointing, notes=notes,
    )


def training_placement(num_gpu_experts: int | None, statistics: str | None = None,
                       strategy: str | None = None) -> PlacementConfig | None:
    """The placement of `num_gpu_experts` GPU-tier experts per MoE layer, planned as inference plans it:
    `strategy` when given, else frequency when a statistics file is given, else KT's first n experts of every
    layer (`uniform`: ids 0..n-1 in each MoE layer); 0: every expert on the CPU tier. None when no count was given
    (the loader's default: every expert on the CPU tier unless the checkpoint carries a mask)."""
    if num_gpu_experts is None:
        return None
    if num_gpu_experts == 0:
        return PlacementConfig(num_gpu_experts=0)
    return PlacementConfig(strategy=strategy or ("frequency" if statistics else "uniform"),
                           num_gpu_experts=num_gpu_experts, init_expert_location=statistics)
