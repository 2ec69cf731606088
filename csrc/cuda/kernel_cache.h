// Finding or building the CUDA attention kernels: a variant (path, head dim,
// dtypes, features) is compiled by NVRTC for the exact GPU arch, kept in an
// on-disk cache shared by processes, and loaded once per CUDA context.
#pragma once

#include <string>
#include <vector>

#include "cuda/driver.h"

namespace fastattn::cuda {

// One compiled specialization; see csrc/kernels/cuda/attention_common.cuh
// for what each option means.
struct KernelVariant {
  int path = 80;        // 70, 75, 80 or 90; the decode kernel: 75 or 80
  int head_dim = 128;   // 32, 64, ..., 256
  int dtype = 0;        // q/k/v: 0 float16, 1 bfloat16
  int out_dtype = 0;    // 0 float16, 1 bfloat16, 2 float32
  int general = 0;      // 1: bias, mask and soft cap compiled in
  int decode_rows = 0;  // > 0 (1, 2, 4 or 8): the decode kernel
                        // (attention_decode.cu) for up to this many rows per
                        // block, general 0

  // "sm80 H=128 bf16->bf16 plain", "decode rows=4 H=128 bf16->bf16": for logs.
  std::string Describe() const;
  // Empty if the variant is valid, else why not.
  std::string Check() const;
};

// The on-disk cache folder (created on first write). Set from Python:
// FASTATTN_CACHE_DIR, else the user cache folder.
void SetCacheDir(std::string dir);

struct CompiledKernel {
  std::string cubin;
  std::string log;      // NVRTC / ptxas log of the build that made it
  std::string nvrtc;    // NVRTC version that built it
  bool from_cache = false;
  double seconds = 0;   // compile time (0 when read from the cache)
};

// Reads `variant` for `arch` ("sm_90") from the disk cache or compiles and
// stores it. Needs no GPU. Returns false with *error on failure.
bool GetCompiledKernel(const KernelVariant& variant, const std::string& arch,
                       CompiledKernel* out, std::string* error);

// A kernel loaded into a CUDA context, with its launch configuration.
struct LoadedKernel {
  CUfunction function = nullptr;
  int block_m = 0;     // Br: query rows per block
  int threads = 0;
  int smem_bytes = 0;
  int block_n = 0;     // Bc: keys per tile
  int blocks_per_sm = 0;    // resident blocks per multiprocessor (occupancy)
  int multiprocessors = 0;  // of the device
  CUcontext context = nullptr;  // the one it is loaded in
};

// Finds, or builds and loads, `variant` for the device of `context`.
// Thread-safe; the result lives as long as the process.
const LoadedKernel* GetLoadedKernel(const Driver& d, CUcontext context,
                                    const KernelVariant& variant, std::string* error);

}  // namespace fastattn::cuda
