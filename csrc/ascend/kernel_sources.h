// The Ascend kernel's sources (csrc/kernels/ascend/ and the shared index
// rules), embedded into the extension at build time (csrc/embed_sources.py
// writes ascend_kernel_sources.cc); fastattn_jax.ascend writes them out to
// compile.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace fastattn::ascend {

// (file name, text) of every source and header.
const std::vector<std::pair<std::string, std::string>>& KernelSources();

}  // namespace fastattn::ascend
