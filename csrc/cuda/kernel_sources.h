// The CUDA kernel sources (csrc/kernels/cuda/*.cu and *.cuh and the shared
// headers), embedded into the extension at build time (csrc/embed_sources.py
// writes kernel_sources.cc), so the sources that compile are always those the
// package was built with.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace fastattn::cuda {

// (file name, text) of every kernel source and header.
const std::vector<std::pair<std::string, std::string>>& KernelSources();

}  // namespace fastattn::cuda
