// The CPU kernel for AVX-512 (F, VL, BW, DQ) with FMA: see attention_cpu_internal.h.
#include "attention_cpu_internal.h"

#if FASTATTN_X86
// Compiled for the set from the start (a target region, not a target attribute on an entry
// point: vector code first optimized for the baseline and inlined later loses its broadcasts
// and register blocking).
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma")
#endif
namespace fastattn {
namespace {
namespace avx512 {
// 32 vector registers: 6 x 4 accumulators, 4 loaded vectors of Q^T or P^T, 1 broadcast.
constexpr int kW = 16;
constexpr int kKeys = 6;
constexpr int kDims = 6;
constexpr int kVecs = 4;
#include "cpu_vec.inc"
#include "attention_cpu_kernel.inc"
#include "attention_cpu_backward.inc"
}  // namespace avx512
}  // namespace
}  // namespace fastattn
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace fastattn {

Kernels avx512_kernels() {
  return Kernels{avx512::worker, avx512::backward_item, avx512::dq_item,
                 avx512::backward_scratch_floats, avx512::kW};
}

}  // namespace fastattn
#endif  // FASTATTN_X86
