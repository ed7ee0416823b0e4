// The portable kernels compiled for base; chosen at run time only when the CPU has it.
// No target pragma: plain x86-64 (SSE2), so this table runs on any x86-64 CPU.
#define TM_GEN_VEC 0
#define TM_GEN_MT 2
#include "generic_kernels.inc"
#include "decode_attention.inc"
#include "gated_delta.inc"

namespace {
const TmKernels kTable = {TM_ISA_BASE, wants_f32, scratch_generic, up_generic, down_generic, finish_nothing,
                           transposed_generic, to_bf16_generic, transpose_group_generic,
                           attend_scratch_floats, attend_task, delta_task};
}

extern "C" const TmKernels* tm_kernels_base(void) { return &kTable; }
