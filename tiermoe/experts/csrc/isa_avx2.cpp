// The portable kernels compiled for avx2 (avx2,fma,f16c); chosen at run time only when the CPU has it.
#pragma GCC target("avx2,fma,f16c")
#define TM_GEN_VEC 256
#define TM_GEN_MT 2
#include "generic_kernels.inc"
#include "decode_attention.inc"
#include "gated_delta.inc"

namespace {
const TmKernels kTable = {TM_ISA_AVX2, wants_f32, scratch_generic, up_generic, down_generic, finish_nothing,
                           transposed_generic, to_bf16_generic, transpose_group_generic,
                           attend_scratch_floats, attend_task, delta_task};
}

extern "C" const TmKernels* tm_kernels_avx2(void) { return &kTable; }
