// What the CPU and CUDA FFI handlers share: the options of one call, decoded
// from the custom call's attribute dictionary (fastattn_jax/backends.py:
// fused_call), and the checks of broadcast operands.
#pragma once

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace fastattn {

struct AttentionAttrs {
  float scale;
  float softcap;
  int64_t is_causal;
  int64_t window_left;
  int64_t window_right;
  int64_t kernel_path;  // CUDA: 70, 75 or 80 (the forced or chosen path); CPU: 0
};

inline std::string DimsString(xla::ffi::Span<const int64_t> dims) {
  std::string s = "(";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + ")";
}

// Element strides that broadcast a 4-D (b, n, t, s) operand to `full`, or an
// error if a dim is neither 1 nor the full size.
inline xla::ffi::Error BroadcastStrides(const char* name, xla::ffi::Span<const int64_t> dims,
                                        const int64_t full[4], int64_t strides[4]) {
  if (dims.size() != 4) {
    return xla::ffi::Error::InvalidArgument(std::string(name) + " must be 4-D, got " +
                                            DimsString(dims));
  }
  int64_t stride = 1;
  for (int d = 3; d >= 0; --d) {
    if (dims[d] != 1 && dims[d] != full[d]) {
      return xla::ffi::Error::InvalidArgument(std::string(name) + " of shape " +
                                              DimsString(dims) +
                                              " does not broadcast to (B, N, T, S)");
    }
    strides[d] = dims[d] == 1 ? 0 : stride;
    stride *= dims[d];
  }
  return xla::ffi::Error::Success();
}

}  // namespace fastattn

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(fastattn::AttentionAttrs,
                                      StructMember<float>("scale"),
                                      StructMember<float>("softcap"),
                                      StructMember<int64_t>("is_causal"),
                                      StructMember<int64_t>("window_left"),
                                      StructMember<int64_t>("window_right"),
                                      StructMember<int64_t>("kernel_path"));
