// NVRTC, loaded with dlopen. Which libnvrtc to use is decided in Python
// (fastattn_jax/cuda.py: the one matching the CUDA major version of the JAX
// plugin first, from the nvidia-cuda-nvrtc wheels or a CUDA toolkit);
// this file tries those candidates in order and takes, per target arch, the
// first that loads and can compile for it.
#pragma once

#include <string>
#include <vector>

namespace fastattn::cuda {

// Library paths or sonames to try, in order of preference.
void SetNvrtcCandidates(std::vector<std::string> candidates);

struct CompileResult {
  bool ok = false;
  std::string cubin;    // the compiled module (ELF)
  std::string log;      // NVRTC's log, including ptxas' resource report
  std::string nvrtc;    // "12.9 (/path/libnvrtc.so.12)": which NVRTC compiled it
};

// The version string ("12.9") of the NVRTC that would compile for `arch`
// (e.g. "sm_90"), or "" with *error explaining why none can.
std::string NvrtcVersionFor(const std::string& arch, std::string* error);

// Compiles `source` (named `name`) with the in-memory headers for `arch`.
CompileResult NvrtcCompile(const std::string& arch, const std::string& source,
                           const std::string& name,
                           const std::vector<std::pair<std::string, std::string>>& headers,
                           const std::vector<std::string>& options);

}  // namespace fastattn::cuda
