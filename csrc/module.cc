// The extension module fastattn_jax._ffi: hands the XLA FFI handlers to
// Python as capsules (fastattn_jax/backends.py registers them) and exposes the
// CUDA kernel cache (fastattn_jax/cuda_kernels.py), which needs no GPU.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "cuda/kernel_cache.h"
#include "cuda/nvrtc.h"
#include "ffi/handlers.h"

namespace nb = nanobind;
namespace cu = fastattn::cuda;

namespace {

nb::capsule Capsule(XLA_FFI_Error* (*handler)(XLA_FFI_CallFrame*)) {
  return nb::capsule(reinterpret_cast<void*>(handler));
}

}  // namespace

NB_MODULE(_ffi, m) {
  m.def("registrations", []() {
    nb::dict cpu, cuda, stages;
    cpu["fastattn_attention_fwd_cpu"] = Capsule(AttentionForwardCpu);
    stages["initialize"] = Capsule(AttentionForwardCudaInitialize);
    stages["execute"] = Capsule(AttentionForwardCudaExecute);
    cuda["fastattn_attention_fwd_cuda"] = stages;
    nb::dict decode_stages;
    decode_stages["instantiate"] = Capsule(DecodeCudaInstantiate);
    decode_stages["initialize"] = Capsule(DecodeCudaInitialize);
    decode_stages["execute"] = Capsule(DecodeCudaExecute);
    cuda["fastattn_decode_cuda"] = decode_stages;
    nb::dict targets;
    targets["cpu"] = cpu;
    targets["CUDA"] = cuda;
    return targets;
  }, "FFI targets by platform: {platform: {name: capsule or {stage: capsule}}}.");

  m.def("types", []() {
    nb::dict registration, cuda, types;
    registration["type_id"] = nb::capsule(DecodeCountersTypeId());
    registration["type_info"] = nb::capsule(const_cast<XLA_FFI_TypeInfo*>(DecodeCountersTypeInfo()));
    cuda["fastattn_decode_counters"] = registration;
    types["CUDA"] = cuda;
    return types;
  }, "FFI state types by platform: {platform: {name: {'type_id': capsule, 'type_info': capsule}}}.");

  m.def("set_nvrtc_candidates", &cu::SetNvrtcCandidates, nb::arg("paths"),
        "libnvrtc paths or sonames to try, in order.");
  m.def("set_cache_dir", &cu::SetCacheDir, nb::arg("path"),
        "Folder of the on-disk kernel cache ('' disables it).");
  m.def("compile_kernel",
        [](const std::string& arch, int path, int head_dim, int dtype, int out_dtype,
           int general, int decode_rows) {
          cu::KernelVariant v{path, head_dim, dtype, out_dtype, general, decode_rows};
          cu::CompiledKernel k;
          std::string error;
          bool ok;
          {
            nb::gil_scoped_release release;
            ok = cu::GetCompiledKernel(v, arch, &k, &error);
          }
          if (!ok) throw std::runtime_error(error);
          nb::dict r;
          r["variant"] = v.Describe();
          r["from_cache"] = k.from_cache;
          r["seconds"] = k.seconds;
          r["log"] = k.log;
          r["nvrtc"] = k.nvrtc;
          r["cubin_bytes"] = k.cubin.size();
          return r;
        },
        nb::arg("arch"), nb::arg("path"), nb::arg("head_dim"), nb::arg("dtype"),
        nb::arg("out_dtype"), nb::arg("general"), nb::arg("decode_rows") = 0,
        "Compiles one kernel variant for arch ('sm_90') or reads it from the disk cache; "
        "raises RuntimeError with NVRTC's log on failure.");
}
