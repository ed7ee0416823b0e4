"""tiermoe's C++ expert kernels: built from csrc/ on first use, loaded with ctypes, ISA chosen at run time.

Why a plain shared library behind ctypes rather than a torch extension: the kernels take raw pointers and never
touch torch's C++ API, so the library builds in about 20 s with the system C++ compiler, does not depend on
torch's ABI, and one build serves every torch version. It is compiled for baseline x86-64 (no -march=native):
each ISA's kernels sit in their own source file under `#pragma GCC target(...)`, and `tm_cpu_isa()` picks the best
the CPU supports (AMX > AVX512-BF16 > AVX-512 > AVX2 > SSE2), so the same build runs on any x86-64 CPU.

Built once per source version and compiler into $TIERMOE_KERNEL_CACHE (default ~/.cache/tiermoe/kernels);
`tiermoe version --check` builds it ahead of time and prints the ISA (set-up scripts, CI). When there is no compiler or the
build fails, callers fall back to pure torch after a one-line warning.

Forcing a path (tests, comparisons): TIERMOE_CPU_ISA=amx|avx512bf16|avx512|avx2|base caps the ISA, and
TIERMOE_CPU_ISA=torch disables the library; `load_kernels(isa=...)` does the same per call.
TIERMOE_TEAM_SOLO_BYTES=N sets the size under which a team runs a job on its caller alone (SOLO_BYTES).
TIERMOE_TEAM_SPIN_US=N sets how long a team's helpers spin after a job before they sleep (SPIN_US).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tiermoe.errors import TiermoeError

if TYPE_CHECKING:
    import torch

ISA_NAMES = ("base", "avx2", "avx512", "avx512bf16", "amx")
TORCH_ISA = "torch"  # not a kernel level: "use no kernels"
# The expert activations the whole-layer kernels compute (tiermoe.experts.ffn.ExpertActivation kinds), with their
# TmLayerArgs.act codes (csrc/tm_kernels.h TmActivation).
ACTIVATION_CODES = {"silu_glu": 0, "gpt_oss_glu": 1}
# 2: tm_linear_forward / tm_linear_transposed; 3: layer_ops.cpp (fused norms, routers), decode attention, rotary;
# 4: decode attention per ISA (TmAttnArgs.isa); 5: the gated delta rule; 6: a team's solo_bytes, its shared jobs;
# 7: a whole decoder layer of a decode step (tm_decode_layer); 8: decode attention with a two-part key (MLA) and key
# splits; 9: a MoE layer's activation (SiLU-GLU or GPT-OSS's clamped SwiGLU) and per-expert biases (TmLayerArgs);
# 10: LoRA adapters served per request: a MoE layer's (tm_moe_lora_forward, TmLoraArgs), a decode layer's
# (TmDecodeLayerArgs.lora); 11: the up kernels' per-row addend (LoRA's gate_up update); 12: the read probe
# (probes.cpp); 13: a decode layer's k and v in a product of their own (TmDecodeLayerArgs.kv: an int4 model's int8
# k / v); 14: the int6 format (TM_INT6, tm_quantize_int6); 15: GPT-OSS's decode layer (TmDecodeLayerArgs' biases,
# half-width rotary, top-k-first router) and tm_softmax_topk's top-k-first order; 16: products of a packed matrix's
# heads in one job (tm_heads_linear, TmHeadsArgs: MLA's absorbed W_UK / W_UV), MLA's rope forms (tm_mla_rope) and
# its decode attention in one call (tm_mla_decode, TmMlaDecodeArgs)
ABI_VERSION = 16
# A MoE layer or packed product smaller than this (bytes of weights read, each row of activations beyond the first
# counted as an eighth more: csrc/tm_kernels.h tm_product_work) runs on the calling thread alone. Waking a helper
# asleep between a decode step's calls cost about 250 us on this project's 2-vCPU VMs (an idle vCPU is halted),
# so splitting paid from about 4 MB at one row and 8 rows (docs/cpu-backends.md, "CPU-only runs"); on bare metal a
# wake costs microseconds and a lower figure would do, but a job this small takes under half a millisecond alone.
SOLO_BYTES = 4 << 20
# Microseconds a helper spins after a job before it sleeps: long enough to cover the Python between a decode step's
# calls without taking a core from torch's threads for long (prompt steps run torch ops on the cores beside the
# team); the default's measurements: BENCHMARKS.md (bench_team_spin.py). At most MAX_SPIN_US.
SPIN_US = 50
MAX_SPIN_US = 1_000_000
CSRC = Path(__file__).with_name("csrc")
CXXFLAGS = ("-O3", "-std=c++20", "-fPIC", "-pthread", "-Wno-psabi")


class TmMatrix(ctypes.Structure):
    _fields_ = [("codes", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("gscale", ctypes.c_void_p),
                ("gzero", ctypes.c_void_p), ("N", ctypes.c_int32), ("K", ctypes.c_int32), ("fmt", ctypes.c_int32),
                ("_pad", ctypes.c_int32)]


class TmLayerArgs(ctypes.Structure):
    """One MoE layer's CPU-tier experts (csrc/tm_api.h). Left at zero, act, alpha, limit and the bias tables mean
    SiLU-GLU without biases; act 1 is GPT-OSS's clamped SwiGLU (ACTIVATION_CODES)."""

    _fields_ = [("isa", ctypes.c_int32), ("amx_min_rows", ctypes.c_int32), ("T", ctypes.c_int32),
                ("D", ctypes.c_int32), ("I", ctypes.c_int32), ("K", ctypes.c_int32), ("Dp", ctypes.c_int32),
                ("Ip", ctypes.c_int32), ("x_bf16", ctypes.c_int32), ("n_experts", ctypes.c_int32),
                ("x", ctypes.c_void_p), ("y", ctypes.c_void_p), ("ids", ctypes.c_void_p),
                ("weights", ctypes.c_void_p), ("gate_up", ctypes.POINTER(TmMatrix)),
                ("down", ctypes.POINTER(TmMatrix)), ("act", ctypes.c_int32), ("alpha", ctypes.c_float),
                ("limit", ctypes.c_float), ("_pad", ctypes.c_int32),
                ("gate_up_bias", ctypes.POINTER(ctypes.c_void_p)), ("down_bias", ctypes.POINTER(ctypes.c_void_p))]


class TmLoraArgs(ctypes.Structure):
    """LoRA adapters served per request on one MoE layer's CPU-tier experts (csrc/tm_api.h): fp32 factors stacked
    along the rank, A [E, R, in] and B transposed [E, R, out] (fp32, or bf16: factors_bf16), and each token's 0/1
    mask [T, R] (fp32); R 0: none on that projection."""

    _fields_ = [("R_gu", ctypes.c_int32), ("R_d", ctypes.c_int32), ("factors_bf16", ctypes.c_int32),
                ("_pad", ctypes.c_int32),
                *[(n, ctypes.c_void_p) for n in ("gate_up_A", "gate_up_Bt", "down_A", "down_Bt", "gate_up_mask",
                                                  "down_mask")]]


class TmLinearLora(ctypes.Structure):
    """One packed product's LoRA for every adapter slot that adapts it (csrc/decode_layer.cpp): A [R, in],
    Bt [R, out] (fp32, or bf16: factors_bf16), each row's mask [T, R] (fp32); R 0: none."""

    _fields_ = [("R", ctypes.c_int32), ("in_", ctypes.c_int32), ("out", ctypes.c_int32),
                ("factors_bf16", ctypes.c_int32),
                ("A", ctypes.c_void_p), ("Bt", ctypes.c_void_p), ("mask", ctypes.c_void_p)]


class TmDecodeLora(ctypes.Structure):
    """A decode layer's LoRA adapters served per request: q, k, v, o, the router's, and the experts'."""

    _fields_ = [*[(n, TmLinearLora) for n in ("q", "k", "v", "o", "router")], ("moe", TmLoraArgs)]


class TmLinearArgs(ctypes.Structure):
    """One packed matrix's product (csrc/expert_linear.cpp): W's real shape N x K, its real rows in segments of
    seg_len at the start of every seg_rows packed rows."""

    _fields_ = [("isa", ctypes.c_int32), ("amx_min_rows", ctypes.c_int32), ("M", ctypes.c_int32),
                ("N", ctypes.c_int32), ("K", ctypes.c_int32), ("seg_rows", ctypes.c_int32),
                ("seg_len", ctypes.c_int32), ("x_bf16", ctypes.c_int32), ("W", ctypes.POINTER(TmMatrix)),
                ("x", ctypes.c_void_p), ("out", ctypes.c_void_p)]


class TmHeadsArgs(ctypes.Structure):
    """H products of one packed matrix, one per head (csrc/tm_api.h): head i's matrix is `one.N` rows from strip
    first_strip + i * one.N / 16; its rows of activations and of output are strided (elements)."""

    _fields_ = [("one", TmLinearArgs), ("H", ctypes.c_int32), ("first_strip", ctypes.c_int32),
                ("transposed", ctypes.c_int32), ("_pad", ctypes.c_int32), ("x_row", ctypes.c_int64),
                ("x_head", ctypes.c_int64), ("out_row", ctypes.c_int64), ("out_head", ctypes.c_int64)]


class TmAttnArgs(ctypes.Structure):
    """Decode rows attending the paged KV pool in place (csrc/paged_attention.cpp)."""

    _fields_ = [("isa", ctypes.c_int32), ("T", ctypes.c_int32), ("H", ctypes.c_int32), ("Hkv", ctypes.c_int32),
                ("d", ctypes.c_int32), ("dv", ctypes.c_int32), ("page_size", ctypes.c_int32),
                ("max_pages", ctypes.c_int32), ("x_bf16", ctypes.c_int32), ("dr", ctypes.c_int32),
                ("q_row_stride", ctypes.c_int64), ("q_head_stride", ctypes.c_int64), ("scale", ctypes.c_float),
                ("key_splits", ctypes.c_int32), ("q", ctypes.c_void_p), ("k_slots", ctypes.c_void_p),
                ("kr_slots", ctypes.c_void_p), ("v_slots", ctypes.c_void_p), ("sinks", ctypes.c_void_p),
                ("tables", ctypes.c_void_p), ("pos", ctypes.c_void_p), ("lo", ctypes.c_void_p),
                ("out", ctypes.c_void_p)]


class TmDeltaArgs(ctypes.Structure):
    """Decode rows of a gated delta rule updating their states in the pool's slots (csrc/gated_delta.cpp)."""

    _fields_ = [("isa", ctypes.c_int32), ("B", ctypes.c_int32), ("Hk", ctypes.c_int32), ("Hv", ctypes.c_int32),
                ("dk", ctypes.c_int32), ("dv", ctypes.c_int32), ("x_bf16", ctypes.c_int32),
                ("qkv_row_stride", ctypes.c_int64), ("q_offset", ctypes.c_int64), ("k_offset", ctypes.c_int64),
                ("v_offset", ctypes.c_int64), ("qkv", ctypes.c_void_p), ("g", ctypes.c_void_p),
                ("beta", ctypes.c_void_p), ("state", ctypes.c_void_p), ("read", ctypes.c_void_p),
                ("write", ctypes.c_void_p), ("out", ctypes.c_void_p)]


class TmDecodeLayerArgs(ctypes.Structure):
    """One decoder layer of a decode step in one call (csrc/decode_layer.cpp; tiermoe.layers.fused_decode_layer)."""

    _fields_ = [*[(n, ctypes.c_int32) for n in ("T", "D", "H", "Hkv", "d", "E", "K", "norm_kind", "sum_lanes",
                                                "exp_lanes", "qk_norm", "renormalize", "weights_bf16",
                                                "attend_on_team")],
                ("eps", ctypes.c_double), ("qk_eps", ctypes.c_double),
                *[(n, ctypes.c_void_p) for n in ("x", "out", "input_norm", "post_norm", "q_norm", "k_norm")],
                ("qkv", TmLinearArgs), ("o", TmLinearArgs), ("router", TmLinearArgs), ("kv", TmLinearArgs),
                ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p), ("cs_row_stride", ctypes.c_int64),
                ("k_slots", ctypes.c_void_p), ("v_slots", ctypes.c_void_p), ("write_slots", ctypes.c_void_p),
                ("attn", TmAttnArgs), ("moe", TmLayerArgs), ("ids", ctypes.c_void_p), ("work", ctypes.c_void_p),
                ("lora", ctypes.POINTER(TmDecodeLora)), ("half_rotary", ctypes.c_int32), ("topk_first", ctypes.c_int32),
                *[(n, ctypes.c_void_p) for n in ("qkv_bias", "o_bias", "router_bias")]]


class TmMlaDecodeArgs(ctypes.Structure):
    """DeepSeek's MLA attention of a decode step in one call (csrc/mla_decode.cpp, csrc/tm_api.h)."""

    _fields_ = [*[(n, ctypes.c_int32) for n in ("T", "D", "H", "N", "P", "R", "V", "L", "norm_kind", "sum_lanes",
                                                "rope_form", "attend_on_team")],
                ("q_eps", ctypes.c_double), ("kv_eps", ctypes.c_double), ("x", ctypes.c_void_p),
                ("out", ctypes.c_void_p), *[(n, TmLinearArgs) for n in ("q_a", "q_b", "kv_a", "kv_b", "o")],
                *[(n, ctypes.c_void_p) for n in ("q_a_norm", "kv_a_norm", "cos", "sin")],
                ("cs_row_stride", ctypes.c_int64),
                *[(n, ctypes.c_void_p) for n in ("latent_slots", "kpe_slots", "write_slots")],
                ("attn", TmAttnArgs), ("work", ctypes.c_void_p)]


@dataclass(frozen=True)
class Kernels:
    """The loaded library, the ISA level its calls use, the size under which its teams run a job on the caller
    alone (SOLO_BYTES, or $TIERMOE_TEAM_SOLO_BYTES as it was when loaded) and how long their helpers spin before
    they sleep (SPIN_US, or $TIERMOE_TEAM_SPIN_US)."""

    lib: ctypes.CDLL
    isa: int
    solo_bytes: int = SOLO_BYTES
    spin_us: int = SPIN_US

    @property
    def isa_name(self) -> str:
        return ISA_NAMES[self.isa]


def _sources() -> list[Path]:
    return sorted([*CSRC.glob("*.cpp"), *CSRC.glob("*.h"), *CSRC.glob("*.inc")])


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")


def _cache_dir() -> Path:
    return Path(os.environ.get("TIERMOE_KERNEL_CACHE", Path.home() / ".cache" / "tiermoe" / "kernels"))


def _build(compiler: str, out: Path) -> None:
    """Compile each source in parallel, link, and move the library into place atomically (concurrent builds
    by several processes each finish with a complete file)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        objs, procs = [], []
        for src in sorted(CSRC.glob("*.cpp")):
            obj = Path(tmp) / (src.stem + ".o")
            objs.append(str(obj))
            procs.append(subprocess.Popen([compiler, *CXXFLAGS, "-c", str(src), "-o", str(obj)],
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = [p.communicate()[0] for p in procs]
        failed = [out for p, out in zip(procs, outputs, strict=True) if p.returncode != 0]
        if failed:
            raise RuntimeError(failed[0].strip() or "compile failed")
        lib = Path(tmp) / out.name
        subprocess.run([compiler, "-shared", "-pthread", *objs, "-o", str(lib)], check=True,
                       capture_output=True, text=True)
        os.replace(lib, out)


@functools.cache
def _library(cache_dir: str, compiler: str | None) -> ctypes.CDLL | None:
    """The built library (built on first use), or None after a one-line warning if it cannot be built."""
    if platform.machine() not in ("x86_64", "AMD64") or compiler is None:
        why = "no C++ compiler found (set CXX)" if compiler is None else f"no kernels for {platform.machine()}"
        warnings.warn(f"tiermoe: CPU expert kernels unavailable ({why}); using the pure-torch path", stacklevel=3)
        return None
    digest = hashlib.sha256()
    for src in _sources():
        digest.update(src.name.encode() + src.read_bytes())
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             check=False).stdout.splitlines()[:1]
    digest.update(repr((version, CXXFLAGS)).encode())
    path = Path(cache_dir) / digest.hexdigest()[:16] / "libtiermoe_cpu.so"
    try:
        if not path.exists():
            _build(compiler, path)
        lib = ctypes.CDLL(str(path))
        _declare(lib)
        if lib.tm_abi_version() != ABI_VERSION:
            raise RuntimeError(f"ABI {lib.tm_abi_version()} != {ABI_VERSION}")
    except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", None) or str(e)
        warnings.warn(f"tiermoe: CPU expert kernels failed to build or load ({detail.strip()[-200:]}); "
                      "using the pure-torch path", stacklevel=3)
        return None
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    lib.tm_abi_version.restype = ctypes.c_int
    lib.tm_cpu_isa.restype = ctypes.c_int
    lib.tm_team_create.restype = ctypes.c_void_p
    lib.tm_team_create.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int,
                                   ctypes.c_long]
    lib.tm_team_destroy.argtypes = [ctypes.c_void_p]
    lib.tm_team_size.argtypes = [ctypes.c_void_p]
    lib.tm_team_shared_jobs.restype = ctypes.c_long
    lib.tm_team_shared_jobs.argtypes = [ctypes.c_void_p]
    lib.tm_read_probe.restype = ctypes.c_int
    lib.tm_read_probe.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
                                  ctypes.POINTER(ctypes.c_double)]
    lib.tm_team_empty_job.restype = ctypes.c_int
    lib.tm_team_empty_job.argtypes = [ctypes.c_void_p]
    lib.tm_moe_forward.restype = ctypes.c_int
    lib.tm_moe_forward.argtypes = [ctypes.c_void_p, ctypes.POINTER(TmLayerArgs), ctypes.c_char_p, ctypes.c_int]
    lib.tm_moe_lora_forward.restype = ctypes.c_int
    lib.tm_moe_lora_forward.argtypes = [ctypes.c_void_p, ctypes.POINTER(TmLayerArgs), ctypes.POINTER(TmLoraArgs),
                                        ctypes.c_char_p, ctypes.c_int]
    for name in ("tm_linear_forward", "tm_linear_transposed"):
        getattr(lib, name).restype = ctypes.c_int
        getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.POINTER(TmLinearArgs), ctypes.c_char_p, ctypes.c_int]
    lib.tm_heads_linear.restype = ctypes.c_int
    lib.tm_heads_linear.argtypes = [ctypes.c_void_p, ctypes.POINTER(TmHeadsArgs), ctypes.c_char_p, ctypes.c_int]
    lib.tm_mla_decode.restype = ctypes.c_int
    lib.tm_mla_decode.argtypes = [ctypes.c_void_p, ctypes.POINTER(TmMlaDecodeArgs), ctypes.c_char_p, ctypes.c_int]
    lib.tm_mla_decode_work_bytes.restype = ctypes.c_size_t
    lib.tm_mla_decode_work_bytes.argtypes = [ctypes.POINTER(TmMlaDecodeArgs)]
    lib.tm_mla_rope.restype = ctypes.c_int
    lib.tm_mla_rope.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64,
                                ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
                                ctypes.c_int]
    lib.tm_paged_decode_attention.restype = ctypes.c_int
    lib.tm_paged_decode_attention.argtypes = [ctypes.c_void_p, ctypes.POINTER(TmAttnArgs), ctypes.c_char_p,
                                              ctypes.c_int]
    lib.tm_decode_layer.restype = ctypes.c_int
    lib.tm_decode_layer.argtypes = [ctypes.c_void_p, ctypes.POINTER(TmDecodeLayerArgs), ctypes.c_char_p, ctypes.c_int]
    lib.tm_decode_layer_work_bytes.restype = ctypes.c_size_t
    lib.tm_decode_layer_work_bytes.argtypes = [ctypes.POINTER(TmDecodeLayerArgs)]
    lib.tm_gated_delta_decode.restype = ctypes.c_int
    lib.tm_gated_delta_decode.argtypes = [ctypes.c_void_p, ctypes.POINTER(TmDeltaArgs), ctypes.c_char_p, ctypes.c_int]
    lib.tm_rotary_inplace.restype = ctypes.c_int
    lib.tm_rotary_inplace.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64,
                                      ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
                                      ctypes.c_int]
    lib.tm_gguf_dequant.restype = ctypes.c_int
    lib.tm_gguf_dequant.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    for name in ("tm_quantize_int4", "tm_quantize_int6"):
        getattr(lib, name).restype = ctypes.c_int
        getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.tm_rms_norm.restype = ctypes.c_int
    lib.tm_rms_norm.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                ctypes.c_int, ctypes.c_double, *[ctypes.c_int] * 5]
    lib.tm_rms_norm_gated.restype = ctypes.c_int
    lib.tm_rms_norm_gated.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                      ctypes.c_void_p,
                                      ctypes.c_int, ctypes.c_int, ctypes.c_double, *[ctypes.c_int] * 5]
    lib.tm_grouped_topk.restype = ctypes.c_int
    lib.tm_grouped_topk.argtypes = [ctypes.c_void_p, *[ctypes.c_int] * 4, ctypes.c_void_p, *[ctypes.c_int] * 3,
                                    ctypes.c_double, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    lib.tm_softmax_topk.restype = ctypes.c_int
    lib.tm_softmax_topk.argtypes = [ctypes.c_void_p, *[ctypes.c_int] * 9, ctypes.c_void_p, ctypes.c_void_p]


def native_library() -> ctypes.CDLL | None:
    """The library for ISA-independent helpers (load-time quantisation, GGUF decoding), or None when disabled or
    unavailable."""
    if os.environ.get("TIERMOE_CPU_ISA") == TORCH_ISA:
        return None
    return _library(str(_cache_dir()), _compiler())


def supported_isa() -> str | None:
    """The best kernel level this CPU runs, or None when the kernels are unavailable."""
    lib = _library(str(_cache_dir()), _compiler())
    return None if lib is None else ISA_NAMES[lib.tm_cpu_isa()]


def load_kernels(isa: str | None = None) -> Kernels | None:
    """The kernels at level `isa` (None: $TIERMOE_CPU_ISA, else the best this CPU has); None for "torch" or when
    the library cannot be built. Asking for a level above the CPU's, or a bad environment variable, raises
    TiermoeError (a ValueError: one line from the CLI, before a model loads)."""
    requested = isa or os.environ.get("TIERMOE_CPU_ISA") or None
    if requested is not None and requested not in (*ISA_NAMES, TORCH_ISA):
        raise TiermoeError(f"unknown CPU ISA '{requested}'; choose one of: {', '.join((*ISA_NAMES, TORCH_ISA))}")
    solo_bytes, spin_us = solo_bytes_from_env(), spin_us_from_env()
    if requested == TORCH_ISA:
        return None
    lib = _library(str(_cache_dir()), _compiler())
    if lib is None:
        return None
    best = lib.tm_cpu_isa()
    level = best if requested is None else ISA_NAMES.index(requested)
    if level > best:
        raise TiermoeError(f"CPU ISA '{requested}' is not supported by this CPU (best: {ISA_NAMES[best]})")
    return Kernels(lib, level, solo_bytes, spin_us)


def _whole_number_from_env(name: str, default: int, expected: str, most: int | None = None) -> int:
    """$name as a whole number (at most `most`), else `default`; anything else is refused saying `expected`."""
    text = os.environ.get(name)
    if text is None:
        return default
    if not text.strip().isdigit() or (most is not None and int(text) > most):
        raise TiermoeError(f"{name}={text!r}: expected {expected}")
    return int(text)


def solo_bytes_from_env() -> int:
    """$TIERMOE_TEAM_SOLO_BYTES (0: every job shared; tests, comparisons), else SOLO_BYTES."""
    return _whole_number_from_env("TIERMOE_TEAM_SOLO_BYTES", SOLO_BYTES,
                                  "a whole number of bytes (0 shares every job)")


def spin_us_from_env() -> int:
    """$TIERMOE_TEAM_SPIN_US (0: helpers sleep as soon as a job is done), else SPIN_US."""
    return _whole_number_from_env("TIERMOE_TEAM_SPIN_US", SPIN_US,
                                  f"a whole number of microseconds, 0 to {MAX_SPIN_US:,}", MAX_SPIN_US)


class ThreadTeam:
    """`n` threads for the kernels: the calling thread plus n - 1 helpers, pinned to `cpus` (member 0 first) or
    unpinned when `cpus` is empty. Helpers spin `spin_us` after a job (default: the kernels', Kernels.spin_us), then
    sleep. A MoE layer or packed product smaller than `solo_bytes` (default: the kernels', Kernels.solo_bytes) runs
    on the caller alone. Closed by `close()` or when collected."""

    def __init__(self, kernels: Kernels, n: int, cpus: list[int] | tuple[int, ...] = (), spin_us: int | None = None,
                 solo_bytes: int | None = None):
        arr = (ctypes.c_int * max(len(cpus), 1))(*cpus)
        self.n = n
        self.cpus = tuple(cpus)
        if solo_bytes is None:
            solo_bytes = kernels.solo_bytes
        if spin_us is None:
            spin_us = kernels.spin_us
        self.kernels = kernels
        self.handle = kernels.lib.tm_team_create(n, arr if cpus else None, len(cpus), spin_us, solo_bytes)
        if not self.handle:
            raise RuntimeError("could not start the CPU expert thread team")
        self._finalizer = weakref.finalize(self, kernels.lib.tm_team_destroy, self.handle)

    @property
    def shared_jobs(self) -> int:
        """How many jobs so far woke the helpers (the rest ran on the caller alone)."""
        return self.kernels.lib.tm_team_shared_jobs(self.handle)

    def read_seconds(self, buffer: torch.Tensor, reps: int) -> float:
        """The fastest of `reps` reads of `buffer` (contiguous, CPU, a multiple of 8 bytes) by every member, each
        taking chunks of it as the products take their tasks: the team's read rate is buffer bytes over this."""
        nbytes = buffer.numel() * buffer.element_size()
        if buffer.device.type != "cpu" or not buffer.is_contiguous() or nbytes % 8 or buffer.data_ptr() % 8:
            raise ValueError("the read probe takes a contiguous CPU buffer of a multiple of 8 bytes, 8-aligned")
        seconds = ctypes.c_double()
        if self.kernels.lib.tm_read_probe(self.handle, buffer.data_ptr(), nbytes, reps, ctypes.byref(seconds)):
            raise ValueError(f"the read probe needs reps >= 1, got {reps}")
        return seconds.value

    def empty_job(self) -> None:
        """One job with no work that every member takes part in (timed after an idle gap: the wake-up cost)."""
        self.kernels.lib.tm_team_empty_job(self.handle)

    def close(self) -> None:
        self._finalizer()

