// RunOnNpu through CANN's ACL runtime. Follows CANN 8's ACL documentation
// (acl.h, acl_rt.h, aclError); it has never run on an NPU. Nothing here needs
// CANN's headers or libraries at build time: the few ACL types are declared
// below (enums passed as int) and every call is resolved with dlsym from
// libascendcl.so when the first call comes.
#include "ascend/acl_runtime.h"

#include <dlfcn.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <vector>

namespace fastattn::ascend {

namespace {

using aclError = int;
using aclrtStream = void*;
constexpr aclError kAclSuccess = 0;                  // ACL_SUCCESS
constexpr aclError kAclRepeatInitialize = 100002;    // ACL_ERROR_REPEAT_INITIALIZE
constexpr int kAclMallocHugeFirst = 0;               // ACL_MEM_MALLOC_HUGE_FIRST
constexpr int kAclMemcpyHostToDevice = 1;            // ACL_MEMCPY_HOST_TO_DEVICE
constexpr int kAclMemcpyDeviceToHost = 2;            // ACL_MEMCPY_DEVICE_TO_HOST

struct Acl {
  aclError (*aclInit)(const char* config_path);
  aclError (*aclrtSetDevice)(int32_t device);
  aclError (*aclrtGetDeviceCount)(uint32_t* count);
  aclError (*aclrtCreateStream)(aclrtStream* stream);
  aclError (*aclrtSynchronizeStream)(aclrtStream stream);
  aclError (*aclrtDestroyStream)(aclrtStream stream);
  aclError (*aclrtMalloc)(void** ptr, size_t size, int policy);
  aclError (*aclrtFree)(void* ptr);
  aclError (*aclrtMemcpy)(void* dst, size_t dst_max, const void* src, size_t count, int kind);
  const char* (*aclGetRecentErrMsg)();
};

// fa_ascend_launch(cores, stream, device params, merge) of the kernel library.
using LaunchFn = int (*)(uint32_t, void*, void*, int);

template <typename F>
bool Load(void* lib, const char* name, F* fn) {
  *fn = reinterpret_cast<F>(dlsym(lib, name));
  return *fn != nullptr;
}

// False with *error = "<call> failed with ACL error <rc>: <message>" unless rc is ACL_SUCCESS.
bool Check(const Acl& acl, aclError rc, const char* call, std::string* error) {
  if (rc == kAclSuccess) return true;
  const char* message = acl.aclGetRecentErrMsg();
  *error = std::string(call) + " failed with ACL error " + std::to_string(rc) + ": " +
           (message ? message : "");
  return false;
}

// libascendcl.so, loaded and initialized once per process; null with *error set if it cannot be.
const Acl* GetAcl(std::string* error) {
  static Acl acl;
  static std::string load_error;
  static std::once_flag once;
  std::call_once(once, [] {
    void* lib = dlopen("libascendcl.so", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      load_error = std::string("implementation='ascend' needs CANN's ACL runtime: libascendcl.so "
                               "not found (") +
                   dlerror() +
                   "); install the CANN toolkit and source its set_env.sh, or use "
                   "implementation='ascend_sim'";
      return;
    }
    const struct { const char* name; bool found; } symbols[] = {
        {"aclInit", Load(lib, "aclInit", &acl.aclInit)},
        {"aclrtSetDevice", Load(lib, "aclrtSetDevice", &acl.aclrtSetDevice)},
        {"aclrtGetDeviceCount", Load(lib, "aclrtGetDeviceCount", &acl.aclrtGetDeviceCount)},
        {"aclrtCreateStream", Load(lib, "aclrtCreateStream", &acl.aclrtCreateStream)},
        {"aclrtSynchronizeStream",
         Load(lib, "aclrtSynchronizeStream", &acl.aclrtSynchronizeStream)},
        {"aclrtDestroyStream", Load(lib, "aclrtDestroyStream", &acl.aclrtDestroyStream)},
        {"aclrtMalloc", Load(lib, "aclrtMalloc", &acl.aclrtMalloc)},
        {"aclrtFree", Load(lib, "aclrtFree", &acl.aclrtFree)},
        {"aclrtMemcpy", Load(lib, "aclrtMemcpy", &acl.aclrtMemcpy)},
        {"aclGetRecentErrMsg", Load(lib, "aclGetRecentErrMsg", &acl.aclGetRecentErrMsg)},
    };
    for (const auto& s : symbols) {
      if (!s.found) {
        load_error = std::string("libascendcl.so lacks ") + s.name + ": update the CANN toolkit";
        return;
      }
    }
    // ACL_ERROR_REPEAT_INITIALIZE: another user of ACL in this process (torch_npu) came first.
    const aclError rc = acl.aclInit(nullptr);
    if (rc != kAclRepeatInitialize && !Check(acl, rc, "aclInit", &load_error)) return;
    uint32_t count = 0;
    if (!Check(acl, acl.aclrtGetDeviceCount(&count), "aclrtGetDeviceCount", &load_error)) return;
    if (count == 0) load_error = "no Ascend NPU found (aclrtGetDeviceCount = 0)";
  });
  if (!load_error.empty()) {
    *error = load_error;
    return nullptr;
  }
  return &acl;
}

// fa_ascend_launch of `library`, loaded once per path; null with *error set if it cannot be.
LaunchFn GetLaunch(const std::string& library, std::string* error) {
  static std::mutex mutex;
  static std::map<std::string, LaunchFn> loaded;
  std::lock_guard<std::mutex> lock(mutex);
  if (auto it = loaded.find(library); it != loaded.end()) return it->second;
  void* lib = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    *error = "cannot load the Ascend kernel library " + library + ": " + dlerror();
    return nullptr;
  }
  LaunchFn launch;
  if (!Load(lib, "fa_ascend_launch", &launch)) {
    *error = "the Ascend kernel library " + library + " lacks the symbol fa_ascend_launch";
    dlclose(lib);
    return nullptr;
  }
  loaded[library] = launch;
  return launch;
}

// One call's stream and device buffers, released on every path.
struct Resources {
  explicit Resources(const Acl& a) : acl(a) {}
  Resources(const Resources&) = delete;
  Resources& operator=(const Resources&) = delete;
  ~Resources() {
    // Nothing enqueued may still use a buffer when it is freed.
    if (stream) acl.aclrtSynchronizeStream(stream);
    for (void* buffer : buffers) acl.aclrtFree(buffer);
    if (stream) acl.aclrtDestroyStream(stream);
  }

  // *device = a device buffer of `size` bytes holding a copy of `host` (if
  // given), or null when size is 0.
  bool Alloc(size_t size, const void* host, void** device, std::string* error) {
    *device = nullptr;
    if (size == 0) return true;
    if (!Check(acl, acl.aclrtMalloc(device, size, kAclMallocHugeFirst), "aclrtMalloc", error)) {
      return false;
    }
    buffers.push_back(*device);
    return !host || Check(acl, acl.aclrtMemcpy(*device, size, host, size, kAclMemcpyHostToDevice),
                          "aclrtMemcpy (host to device)", error);
  }

  const Acl& acl;
  aclrtStream stream = nullptr;
  std::vector<void*> buffers;
};

}  // namespace

bool RunOnNpu(const std::string& library, const FaAscendParams& host, const OperandBytes& bytes,
              std::string* error) {
  const Acl* acl = GetAcl(error);
  if (!acl) return false;
  const LaunchFn launch = GetLaunch(library, error);
  if (!launch) return false;
  // The device context ACL creates belongs to the calling thread: set it on each call.
  if (!Check(*acl, acl->aclrtSetDevice(0), "aclrtSetDevice", error)) return false;

  Resources r(*acl);
  if (!Check(*acl, acl->aclrtCreateStream(&r.stream), "aclrtCreateStream", error)) return false;
  FaAscendParams params = host;
  void *q, *k, *v, *bias, *mask, *q_lens, *kv_lens, *out, *lse, *workspace, *params_dev;
  void *q_spans, *kv_spans, *sinks;
  if (!r.Alloc(bytes.q, host.q, &q, error) || !r.Alloc(bytes.k, host.k, &k, error) ||
      !r.Alloc(bytes.v, host.v, &v, error) || !r.Alloc(bytes.bias, host.bias, &bias, error) ||
      !r.Alloc(bytes.mask, host.mask, &mask, error) ||
      !r.Alloc(bytes.q_lens, host.q_lens, &q_lens, error) ||
      !r.Alloc(bytes.kv_lens, host.kv_lens, &kv_lens, error) ||
      !r.Alloc(bytes.out, nullptr, &out, error) || !r.Alloc(bytes.lse, nullptr, &lse, error) ||
      !r.Alloc(bytes.workspace, nullptr, &workspace, error) ||
      !r.Alloc(bytes.q_spans, host.features.q_spans, &q_spans, error) ||
      !r.Alloc(bytes.kv_spans, host.features.kv_spans, &kv_spans, error) ||
      !r.Alloc(bytes.sinks, host.features.sinks, &sinks, error)) {
    return false;
  }
  params.q = q;
  params.k = k;
  params.v = v;
  params.bias = static_cast<const float*>(bias);
  params.mask = static_cast<const uint8_t*>(mask);
  params.q_lens = static_cast<const int32_t*>(q_lens);
  params.kv_lens = static_cast<const int32_t*>(kv_lens);
  params.out = out;
  params.lse = static_cast<float*>(lse);
  params.workspace = static_cast<float*>(workspace);
  params.features.q_spans = static_cast<const int32_t*>(q_spans);
  params.features.kv_spans = static_cast<const int32_t*>(kv_spans);
  params.features.sinks = static_cast<const float*>(sinks);
  if (!r.Alloc(sizeof(params), &params, &params_dev, error)) return false;

  const uint32_t cores = static_cast<uint32_t>(host.cores);
  if (!Check(*acl, launch(cores, r.stream, params_dev, 0), "fa_ascend_launch (forward)", error)) {
    return false;
  }
  if (host.splits > 1 &&
      !Check(*acl, launch(cores, r.stream, params_dev, 1), "fa_ascend_launch (merge)", error)) {
    return false;
  }
  if (!Check(*acl, acl->aclrtSynchronizeStream(r.stream), "aclrtSynchronizeStream", error)) {
    return false;
  }
  return (bytes.out == 0 ||
          Check(*acl, acl->aclrtMemcpy(host.out, bytes.out, out, bytes.out, kAclMemcpyDeviceToHost),
                "aclrtMemcpy (out, device to host)", error)) &&
         (bytes.lse == 0 ||
          Check(*acl, acl->aclrtMemcpy(host.lse, bytes.lse, lse, bytes.lse, kAclMemcpyDeviceToHost),
                "aclrtMemcpy (lse, device to host)", error));
}

}  // namespace fastattn::ascend
