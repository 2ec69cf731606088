// What the CPU and CUDA FFI handlers share: the options of one call, decoded
// from the custom call's attribute dictionary (fastattn_jax/backends.py:
// fused_call), and the checks of the operands' shapes.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace fastattn {

struct AttentionAttrs {
  float scale;
  float softcap;
  int64_t is_causal;
  int64_t end_aligned;  // row i sits at key position i + kv_len - q_len
  int64_t window_left;
  int64_t window_right;
  int64_t kernel_path;  // CUDA: 70, 75 or 80 (the forced or chosen path); CPU: 0
};

// The options of a CUDA decode-kernel call (fastattn_jax/backends.py: decode_call).
struct DecodeAttrs {
  float scale;
  float softcap;
  int64_t is_causal;
  int64_t end_aligned;
  int64_t window_left;
  int64_t window_right;
  int64_t kv_splits;    // the most split-KV blocks per (b, kvh), 1..128 (the
                        // workspace's size); the handler picks the count
  int64_t kernel_path;  // the CUDA path (70, 75, 80, 90) the call serves
};

inline std::string DimsString(xla::ffi::Span<const int64_t> dims) {
  std::string s = "(";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + ")";
}

struct QkvDims {
  int64_t B, T, S, N, K, H;
};

// Reads (B, T, N, H) x (B, S, K, H) from query, key and value, or an error
// naming the shapes that do not fit.
inline xla::ffi::Error CheckQkv(xla::ffi::Span<const int64_t> qd, xla::ffi::Span<const int64_t> kd,
                                xla::ffi::Span<const int64_t> vd, QkvDims* d) {
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4) {
    return xla::ffi::Error::InvalidArgument("query, key and value must be 4-D");
  }
  *d = QkvDims{qd[0], qd[1], kd[1], qd[2], kd[2], qd[3]};
  if (kd[0] != d->B || kd[3] != d->H || d->K == 0 || d->N % d->K != 0 ||
      !std::equal(vd.begin(), vd.end(), kd.begin())) {
    return xla::ffi::Error::InvalidArgument("query " + DimsString(qd) + " and key " +
                                            DimsString(kd) +
                                            " do not fit (B, T, N, H) x (B, S, K, H)");
  }
  return xla::ffi::Error::Success();
}

// The data of a (B,) lengths operand, or nullptr when it is empty (absent).
inline xla::ffi::Error CheckLengths(const char* name, xla::ffi::Buffer<xla::ffi::S32>& lens,
                                    int64_t B, const int32_t** data) {
  *data = nullptr;
  if (lens.element_count() == 0) return xla::ffi::Error::Success();
  if (lens.element_count() != static_cast<size_t>(B)) {
    return xla::ffi::Error::InvalidArgument(std::string(name) + " must have shape (B,)");
  }
  *data = lens.typed_data();
  return xla::ffi::Error::Success();
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
                                      StructMember<int64_t>("end_aligned"),
                                      StructMember<int64_t>("window_left"),
                                      StructMember<int64_t>("window_right"),
                                      StructMember<int64_t>("kernel_path"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(fastattn::DecodeAttrs,
                                      StructMember<float>("scale"),
                                      StructMember<float>("softcap"),
                                      StructMember<int64_t>("is_causal"),
                                      StructMember<int64_t>("end_aligned"),
                                      StructMember<int64_t>("window_left"),
                                      StructMember<int64_t>("window_right"),
                                      StructMember<int64_t>("kv_splits"),
                                      StructMember<int64_t>("kernel_path"));
