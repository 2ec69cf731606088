// Finding or building the CUDA attention kernels: a variant
// (csrc/cuda/variants.h) is compiled by NVRTC for the exact GPU, kept in
// an on-disk cache shared by processes, and loaded once per CUDA context.
#pragma once

#include <string>
#include <vector>

#include "cuda/driver.h"
#include "cuda/variants.h"

namespace fastattn::cuda {

// The on-disk cache folder (created on first write). Set from Python:
// FASTATTN_CACHE_DIR, else the user cache folder.
void SetCacheDir(std::string dir);

struct CompiledKernel {
  std::string target;   // the NVRTC target it was compiled for ("sm_90a": NvrtcTarget)
  std::string cubin;
  std::string log;      // NVRTC / ptxas log of the build that made it
  std::string nvrtc;    // NVRTC version that built it
  bool from_cache = false;
  double seconds = 0;   // compile time (0 when read from the cache)
};

// Reads `variant` for a GPU of compute capability `cc` (10 * major + minor:
// 90) from the disk cache or compiles and stores it. Needs no GPU. Returns
// false with *error on failure.
bool GetCompiledKernel(const KernelVariant& variant, int cc, CompiledKernel* out,
                       std::string* error);

// A kernel loaded into a CUDA context, with what its launches need.
struct LoadedKernel {
  CUfunction function = nullptr;  // fa_forward; backward variants: fa_backward_dkdv
  CUfunction merge = nullptr;     // the forward kernels' split-KV merge, fa_merge
  CUfunction dq = nullptr;        // backward variants: fa_backward_dq
  KernelVariant variant;
  int cc = 0;               // of the device: 90 for compute capability 9.0
  FaTile tile{};            // variant.Tile(cc): Br, Bc, threads, shared memory
  int blocks_per_sm = 0;    // resident blocks per multiprocessor (occupancy)
  int multiprocessors = 0;  // of the device
  CUcontext context = nullptr;  // the one it is loaded in
};

// Finds, or builds and loads, `variant` for the device of `context`.
// Thread-safe; the result lives as long as the process.
const LoadedKernel* GetLoadedKernel(const Driver& d, CUcontext context,
                                    const KernelVariant& variant, std::string* error);

}  // namespace fastattn::cuda
