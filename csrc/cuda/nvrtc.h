// NVRTC, loaded with dlopen. Which libnvrtc to use is decided in Python
// (fastattn_jax/cuda.py: the one matching the CUDA major version of the JAX
// plugin first, from the nvidia-cuda-nvrtc wheels or a CUDA toolkit);
// this file tries those candidates in order and takes, per compute capability, the
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

// NVRTC's name of the target for compute capability `cc` (10 * major +
// minor, as the project encodes a GPU everywhere else): "sm_90"; with
// `arch_specific`, the target of that compute capability's own instructions
// (wgmma), whose code runs on it alone: "sm_90a". The one place that spells
// a target.
std::string NvrtcTarget(int cc, bool arch_specific = false);

// The version string ("12.9") of the NVRTC that would compile for compute
// capability `cc`, or "" with *error explaining why none can.
std::string NvrtcVersionFor(int cc, std::string* error);

// Compiles `source` (named `name`) with the in-memory headers for
// NvrtcTarget(cc, arch_specific).
CompileResult NvrtcCompile(int cc, bool arch_specific, const std::string& source,
                           const std::string& name,
                           const std::vector<std::pair<std::string, std::string>>& headers,
                           const std::vector<std::string>& options);

}  // namespace fastattn::cuda
