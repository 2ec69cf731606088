// The CPU kernel for the baseline vectors (SSE2 on x86-64, NEON on aarch64): see
// attention_cpu_internal.h.
#include "attention_cpu_internal.h"

namespace fastattn {
namespace {
namespace baseline {
constexpr int kW = 4;
constexpr int kKeys = 4;
constexpr int kDims = 4;
constexpr int kVecs = 3;
#include "cpu_vec.inc"
#include "attention_cpu_kernel.inc"
#include "attention_cpu_backward.inc"
}  // namespace baseline
}  // namespace

Kernels baseline_kernels() {
  return Kernels{baseline::worker, baseline::backward_item, baseline::dq_item,
                 baseline::backward_scratch_floats, baseline::kW};
}

}  // namespace fastattn
