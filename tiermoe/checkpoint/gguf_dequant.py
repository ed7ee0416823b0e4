"""GGUF blocks to floats: tiermoe's C++ kernels where they are built, else the gguf package's numpy code.

Why our own: gguf.quants dequantises 30-70 MB of file per second on one core, so a DeepSeek-V3 Q4_K file
(about 400 GB) would take hours to load or convert; tiermoe/experts/csrc/gguf_dequant.cpp reads each block once,
on torch's intra-op thread count, with the same float32 operations (tests check the two bit for bit).
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, quants

from tiermoe.experts.kernels import native_library

# GGML types the kernels decode (GGMLQuantizationType values); the rest go through gguf.quants.
NATIVE_TYPES = {"Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}


def dequantize_into(raw: np.ndarray, qtype, out: torch.Tensor, native: bool = True) -> torch.Tensor:
    """Rows of GGUF blocks `raw` (uint8 [rows, bytes per row], or unquantised values) of type `qtype` (a
    gguf.GGMLQuantizationType), decoded into `out` ([rows, values per row], contiguous, any float dtype).
    `native=False` forces the gguf package's path (the reference the kernels are tested against)."""
    kind = NATIVE_TYPES.get(qtype.name)
    lib = native_library() if native and kind is not None else None
    if lib is None:
        # a copy: for F32 tensors the package returns the read-only file mapping itself
        values = np.array(quants.dequantize(np.ascontiguousarray(raw), qtype), dtype=np.float32)
        return out.copy_(torch.from_numpy(values.reshape(out.shape)))
    src = np.ascontiguousarray(raw)
    dst = out if out.dtype == torch.float32 else torch.empty(out.shape, dtype=torch.float32)
    block_bytes, block_values = _block_size(qtype)
    n_blocks = src.nbytes // block_bytes
    if n_blocks * block_values != dst.numel():
        raise ValueError(f"{src.nbytes} bytes of {qtype.name} hold {n_blocks * block_values} values, "
                         f"the destination {dst.numel()}")
    lib.tm_gguf_dequant(kind, src.ctypes.data_as(ctypes.c_void_p), ctypes.c_void_p(dst.data_ptr()), n_blocks,
                        torch.get_num_threads())
    return out if dst is out else out.copy_(dst)


def _block_size(qtype) -> tuple[int, int]:
    values, nbytes = GGML_QUANT_SIZES[qtype]
    return nbytes, values
