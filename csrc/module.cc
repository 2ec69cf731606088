// The extension module fastattn_jax._ffi: hands the XLA FFI handlers to
// Python as capsules, nothing else (fastattn_jax/backends.py registers them).
#include <nanobind/nanobind.h>

#include "ffi/handlers.h"

namespace nb = nanobind;

NB_MODULE(_ffi, m) {
  m.def("registrations", []() {
    nb::dict targets;
    targets["fastattn_attention_fwd_cpu"] =
        nb::capsule(reinterpret_cast<void*>(AttentionForwardCpu));
    return targets;
  });
}
