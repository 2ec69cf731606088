// The CPU kernel for AVX2 with FMA: see attention_cpu_internal.h.
#include "attention_cpu_internal.h"

#if FASTATTN_X86
// Compiled for the set from the start (a target region, not a target attribute on an entry
// point: vector code first optimized for the baseline and inlined later loses its broadcasts
// and register blocking).
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif
namespace fastattn {
namespace {
namespace avx2 {
// 16 vector registers: 4 x 3 accumulators, 3 loaded, 1 broadcast.
constexpr int kW = 8;
constexpr int kKeys = 4;
constexpr int kDims = 4;
constexpr int kVecs = 3;
#include "cpu_vec.inc"
#include "attention_cpu_kernel.inc"
#include "attention_cpu_backward.inc"
}  // namespace avx2
}  // namespace
}  // namespace fastattn
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace fastattn {

Kernels avx2_kernels() {
  return Kernels{avx2::worker, avx2::backward_item, avx2::dq_item,
                 avx2::backward_scratch_floats, avx2::kW};
}

}  // namespace fastattn
#endif  // FASTATTN_X86
