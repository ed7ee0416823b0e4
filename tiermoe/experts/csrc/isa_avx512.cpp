// The portable kernels compiled for avx512 (avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c); chosen at run time only when the CPU has it.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#define TM_GEN_VEC 512
#define TM_GEN_MT 4
#include "generic_kernels.inc"
#include "decode_attention.inc"
#include "gated_delta.inc"

namespace {
const TmKernels kTable = {TM_ISA_AVX512, wants_f32, scratch_generic, up_generic, down_generic, finish_nothing,
                           transposed_generic, to_bf16_generic, transpose_group_generic,
                           attend_scratch_floats, attend_task, delta_task};
}

extern "C" const TmKernels* tm_kernels_avx512(void) { return &kTable; }
