// ruvllm CPU kernels: which ISA variant runs. cpu_isa.cc reads the CPU's features once (cpuid and
// xgetbv on x86-64, getauxval(AT_HWCAP) on Linux/aarch64) and selects the best variant this build
// holds and the CPU runs; ruvllm_select_isa (called from ruvllm_jax.native) forces another it runs.
#ifndef RUVLLM_CPU_ISA_H_
#define RUVLLM_CPU_ISA_H_

#include "cpu_kernels.h"

#pragma GCC visibility push(hidden)  // the library's own: only its extern "C" entry points are exported
namespace ruvllm {

// The selected variant's kernels (the scalar ones until one is selected).
const KernelTable* kernels();

}  // namespace ruvllm
#pragma GCC visibility pop

#endif  // RUVLLM_CPU_ISA_H_
