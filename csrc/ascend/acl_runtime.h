// The Ascend kernel on an NPU, through the ACL runtime (libascendcl.so,
// loaded with dlopen: neither the build nor the import needs CANN). Written
// to CANN 8's ACL documentation; no NPU or CANN was reachable where it was
// written, so it has never run (README: status table).
#pragma once

#include <cstddef>
#include <string>

#include "kernels/ascend/attention_ascend.h"

namespace fastattn::ascend {

// Bytes of each operand of one call (0: absent).
struct OperandBytes {
  size_t q, k, v, bias, mask, q_lens, kv_lens, out, lse, workspace;
  size_t q_spans, kv_spans, sinks;  // the features' (0 where absent)
};

// Runs one call on NPU 0: copies the host operands of `host` (sizes in
// `bytes`) to device memory, launches the forward kernel over host.cores AI
// cores through `library`'s fa_ascend_launch (a shared library that CANN's
// bisheng built from attention_ascend.cpp), then the split-KV merge where
// host.splits > 1, and copies out and lse back into host.out and host.lse.
// Returns false with *error naming what is missing (libascendcl.so, a
// device, the library) or the ACL call that failed and its message.
bool RunOnNpu(const std::string& library, const FaAscendParams& host, const OperandBytes& bytes,
              std::string* error);

}  // namespace fastattn::ascend
