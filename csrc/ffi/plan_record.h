// The launch plan each FFI target ran its latest call with, as named
// integers: what the handler asked the plan functions (csrc/cuda/variants.h,
// csrc/kernels/cpu/attention_cpu.h) and launched. Python reads them with
// fastattn_jax._ffi.recorded_plans(), to check and explain what ran.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace fastattn {

using PlanFacts = std::vector<std::pair<std::string, int64_t>>;

// Replaces `target`'s record. Thread-safe.
void RecordPlan(const std::string& target, PlanFacts facts);

// Every target's latest record.
std::map<std::string, PlanFacts> RecordedPlans();

}  // namespace fastattn
