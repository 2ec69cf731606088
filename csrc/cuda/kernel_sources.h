// The CUDA kernel sources (csrc/kernels/cuda/*.cu and *.cuh), embedded into
// the extension at build time (CMakeLists.txt generates kernel_sources.cc),
// so the sources that compile are always those the package was built with.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace fastattn::cuda {

// (file name, text) of every kernel source and header.
const std::vector<std::pair<std::string, std::string>>& KernelSources();

}  // namespace fastattn::cuda
