#include "cuda/driver.h"

#include <dlfcn.h>

#include <mutex>

namespace fastattn::cuda {

namespace {

template <typename F>
bool Load(void* lib, const char* name, F* fn) {
  *fn = reinterpret_cast<F>(dlsym(lib, name));
  return *fn != nullptr;
}

}  // namespace

const Driver* GetDriver(std::string* error) {
  static Driver driver;
  static std::string load_error;
  static std::once_flag once;
  std::call_once(once, [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      load_error = std::string("cannot load the CUDA driver (libcuda.so.1): ") + dlerror();
      return;
    }
    Driver& d = driver;
    // The _v2 names are the current ABI of the calls that have them.
    bool ok = Load(lib, "cuInit", &d.cuInit) &&
              Load(lib, "cuGetErrorString", &d.cuGetErrorString) &&
              Load(lib, "cuDeviceGetAttribute", &d.cuDeviceGetAttribute) &&
              Load(lib, "cuStreamGetCtx", &d.cuStreamGetCtx) &&
              Load(lib, "cuCtxPushCurrent_v2", &d.cuCtxPushCurrent) &&
              Load(lib, "cuCtxPopCurrent_v2", &d.cuCtxPopCurrent) &&
              Load(lib, "cuCtxGetDevice", &d.cuCtxGetDevice) &&
              Load(lib, "cuModuleLoadData", &d.cuModuleLoadData) &&
              Load(lib, "cuModuleGetFunction", &d.cuModuleGetFunction) &&
              Load(lib, "cuModuleGetGlobal_v2", &d.cuModuleGetGlobal) &&
              Load(lib, "cuMemcpyDtoH_v2", &d.cuMemcpyDtoH) &&
              Load(lib, "cuFuncSetAttribute", &d.cuFuncSetAttribute) &&
              Load(lib, "cuLaunchKernel", &d.cuLaunchKernel) &&
              Load(lib, "cuMemsetD32Async", &d.cuMemsetD32Async) &&
              Load(lib, "cuMemAlloc_v2", &d.cuMemAlloc) &&
              Load(lib, "cuMemFree_v2", &d.cuMemFree) &&
              Load(lib, "cuOccupancyMaxActiveBlocksPerMultiprocessor",
                   &d.cuOccupancyMaxActiveBlocksPerMultiprocessor);
    Load(lib, "cuTensorMapEncodeTiled", &d.cuTensorMapEncodeTiled);
    Load(lib, "cuLaunchKernelEx", &d.cuLaunchKernelEx);
    if (!ok) {
      load_error = "libcuda.so.1 lacks a driver API call fastattn_jax needs: update the driver";
      return;
    }
    if (CUresult rc = d.cuInit(0); rc != 0) load_error = DriverError(d, rc, "cuInit");
  });
  if (!load_error.empty()) {
    *error = load_error;
    return nullptr;
  }
  return &driver;
}

std::string DriverError(const Driver& d, CUresult rc, const char* what) {
  if (rc == 0) return "";
  const char* msg = nullptr;
  d.cuGetErrorString(rc, &msg);
  return std::string(what) + " failed with CUDA error " + std::to_string(rc) + ": " +
         (msg ? msg : "unknown");
}

std::string Launch(const Driver& d, CUfunction function, unsigned blocks, unsigned threads,
                   unsigned smem_bytes, unsigned cluster, CUstream stream, void** args,
                   const char* what) {
  if (cluster <= 1) {
    return DriverError(d, d.cuLaunchKernel(function, blocks, 1, 1, threads, 1, 1, smem_bytes,
                                           stream, args, nullptr),
                       what);
  }
  constexpr CUresult kNotSupported = 801;  // CUDA_ERROR_NOT_SUPPORTED
  if (!d.cuLaunchKernelEx) return DriverError(d, kNotSupported, what);
  LaunchAttribute attr{};
  attr.id = kLaunchAttrClusterDimension;
  attr.value.cluster_dim[0] = cluster;
  attr.value.cluster_dim[1] = attr.value.cluster_dim[2] = 1;
  const LaunchConfig config{{blocks, 1, 1}, {threads, 1, 1}, smem_bytes, stream, &attr, 1};
  return DriverError(d, d.cuLaunchKernelEx(&config, function, args, nullptr), what);
}

}  // namespace fastattn::cuda
