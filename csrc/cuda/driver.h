// The few CUDA driver API calls the kernel runtime needs, loaded with dlopen
// from libcuda.so.1 at first use, so that building and importing
// fastattn_jax needs no CUDA toolkit and no GPU.
#pragma once

#include <string>

namespace fastattn::cuda {

// Opaque driver handles, declared here instead of taken from cuda.h.
using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;
using CUcontext = struct CUctx_st*;
using CUmodule = struct CUmod_st*;
using CUfunction = struct CUfunc_st*;
using CUstream = struct CUstream_st*;

// Enum values from cuda.h (stable across driver versions).
constexpr int kAttrMultiprocessorCount = 16;
constexpr int kAttrComputeCapabilityMajor = 75;
constexpr int kAttrComputeCapabilityMinor = 76;
constexpr int kAttrMaxSharedMemoryPerBlockOptin = 97;
constexpr int kFuncAttrMaxDynamicSharedSizeBytes = 8;

// cuLaunchKernelEx's configuration (cuda.h's CUlaunchConfig and
// CUlaunchAttribute, CUDA 12), with the one attribute used: the cluster shape.
constexpr int kLaunchAttrClusterDimension = 4;
struct LaunchAttribute {
  int id;
  char pad[4];
  union {
    unsigned cluster_dim[3];
    char bytes[64];
  } value;
};
struct LaunchConfig {
  unsigned grid[3], block[3], smem_bytes;
  CUstream stream;
  LaunchAttribute* attrs;
  unsigned num_attrs;
};

struct Driver {
  CUresult (*cuInit)(unsigned);
  CUresult (*cuGetErrorString)(CUresult, const char**);
  CUresult (*cuDeviceGetAttribute)(int*, int, CUdevice);
  CUresult (*cuStreamGetCtx)(CUstream, CUcontext*);
  CUresult (*cuCtxPushCurrent)(CUcontext);
  CUresult (*cuCtxPopCurrent)(CUcontext*);
  CUresult (*cuCtxGetDevice)(CUdevice*);
  CUresult (*cuModuleLoadData)(CUmodule*, const void*);
  CUresult (*cuModuleGetFunction)(CUfunction*, CUmodule, const char*);
  CUresult (*cuModuleGetGlobal)(CUdeviceptr*, size_t*, CUmodule, const char*);
  CUresult (*cuMemcpyDtoH)(void*, CUdeviceptr, size_t);
  CUresult (*cuFuncSetAttribute)(CUfunction, int, int);
  CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned,
                             unsigned, unsigned, unsigned, CUstream, void**, void**);
  CUresult (*cuMemsetD32Async)(CUdeviceptr, unsigned, size_t, CUstream);
  CUresult (*cuMemAlloc)(CUdeviceptr*, size_t);
  CUresult (*cuMemFree)(CUdeviceptr);
  CUresult (*cuOccupancyMaxActiveBlocksPerMultiprocessor)(int*, CUfunction, int, size_t);
  // CUDA 12 drivers and newer; null on older ones (path 90 then refuses).
  // The arguments: map, data type, rank, address, dims, byte strides of
  // dims 1.., box dims, element strides, interleave, swizzle, L2 promotion,
  // out-of-bounds fill.
  CUresult (*cuTensorMapEncodeTiled)(void*, int, unsigned, void*, const unsigned long long*,
                                     const unsigned long long*, const unsigned*,
                                     const unsigned*, int, int, int, int);
  // CUDA 12 drivers and newer; null on older ones (no cluster launches).
  CUresult (*cuLaunchKernelEx)(const LaunchConfig*, CUfunction, void**, void**);
};

// Enum values of cuTensorMapEncodeTiled's arguments (cuda.h).
constexpr int kTensorMapUint16 = 1;
constexpr int kTensorMapInterleaveNone = 0;
constexpr int kTensorMapSwizzle128B = 3;
constexpr int kTensorMapL2Promotion256B = 3;
constexpr int kTensorMapOobFillZeros = 0;

// The loaded driver, or nullptr with *error set (no libcuda, or cuInit failed).
const Driver* GetDriver(std::string* error);

// Launches `function` on `blocks` blocks of `threads`, in clusters of
// `cluster` blocks when above 1 (cuLaunchKernelEx; CUDA_ERROR_NOT_SUPPORTED
// from drivers without it). `what` names the launch in the error.
std::string Launch(const Driver& d, CUfunction function, unsigned blocks, unsigned threads,
                   unsigned smem_bytes, unsigned cluster, CUstream stream, void** args,
                   const char* what);

// "cuFoo failed: CUDA_ERROR_... (message)" for a failed call, "" for success.
std::string DriverError(const Driver& d, CUresult rc, const char* what);

}  // namespace fastattn::cuda
