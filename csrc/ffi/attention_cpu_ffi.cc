// XLA FFI handler of the fused CPU attention: checks the buffers XLA hands
// over, fills fastattn::AttentionParams and calls the kernel.
#include <algorithm>
#include <cstdint>
#include <string>

#include "ffi/attention_attrs.h"
#include "ffi/handlers.h"
#include "kernels/cpu/attention_cpu.h"

namespace ffi = xla::ffi;
using fastattn::CallAttrs;
using fastattn::BroadcastStrides;

namespace {

bool ToElementType(ffi::DataType dtype, fastattn::ElementType* out) {
  switch (dtype) {
    case ffi::DataType::F32: *out = fastattn::ElementType::kF32; return true;
    case ffi::DataType::F16: *out = fastattn::ElementType::kF16; return true;
    case ffi::DataType::BF16: *out = fastattn::ElementType::kBF16; return true;
    default: return false;
  }
}

ffi::Error AttentionCpuImpl(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                   ffi::AnyBuffer bias, ffi::Buffer<ffi::PRED> mask,
                                   ffi::Buffer<ffi::S32> q_lens, ffi::Buffer<ffi::S32> kv_lens,
                                   ffi::Result<ffi::AnyBuffer> out,
                                   ffi::ResultBuffer<ffi::F32> lse, CallAttrs attrs) {
  fastattn::QkvDims d;
  if (auto err = fastattn::CheckQkv(q.dimensions(), k.dimensions(), v.dimensions(), &d);
      err.failure()) {
    return err;
  }
  fastattn::AttentionParams p;
  p.B = d.B, p.T = d.T, p.S = d.S, p.N = d.N, p.K = d.K, p.H = d.H;
  if (q.element_type() != k.element_type() || q.element_type() != v.element_type() ||
      q.element_type() != out->element_type() || !ToElementType(q.element_type(), &p.dtype)) {
    return ffi::Error::InvalidArgument("query, key, value and out must share one of F32, F16, BF16");
  }
  p.q = q.untyped_data(), p.k = k.untyped_data(), p.v = v.untyped_data();
  p.out = out->untyped_data();
  p.lse = lse->typed_data();

  const int64_t full[4] = {p.B, p.N, p.T, p.S};
  if (bias.element_count() > 0) {
    if (!ToElementType(bias.element_type(), &p.bias_dtype)) {
      return ffi::Error::InvalidArgument("bias must be F32, F16 or BF16");
    }
    if (auto err = BroadcastStrides("bias", bias.dimensions(), full, p.bias_strides);
        err.failure()) {
      return err;
    }
    p.bias = bias.untyped_data();
  }
  if (mask.element_count() > 0) {
    if (auto err = BroadcastStrides("mask", mask.dimensions(), full, p.mask_strides);
        err.failure()) {
      return err;
    }
    p.mask = mask.typed_data();
  }
  if (auto err = fastattn::CheckLengths("query_seq_lengths", q_lens, p.B, &p.q_lens);
      err.failure()) {
    return err;
  }
  if (auto err = fastattn::CheckLengths("key_value_seq_lengths", kv_lens, p.B, &p.kv_lens);
      err.failure()) {
    return err;
  }
  const FaRules rules = fastattn::RulesOf(attrs);
  p.scale = rules.scale;
  p.softcap = rules.softcap;
  p.causal = rules.causal != 0;
  p.end_aligned = rules.end_aligned != 0;
  p.window_left = rules.window_left;
  p.window_right = rules.window_right;
  fastattn::attention_forward_cpu(p);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttentionCpu, AttentionCpuImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()            // query
                                  .Arg<ffi::AnyBuffer>()            // key
                                  .Arg<ffi::AnyBuffer>()            // value
                                  .Arg<ffi::AnyBuffer>()            // bias or empty
                                  .Arg<ffi::Buffer<ffi::PRED>>()    // mask or empty
                                  .Arg<ffi::Buffer<ffi::S32>>()     // query lengths or empty
                                  .Arg<ffi::Buffer<ffi::S32>>()     // key lengths or empty
                                  .Ret<ffi::AnyBuffer>()            // out
                                  .Ret<ffi::Buffer<ffi::F32>>()     // lse
                                  .Attrs<CallAttrs>());
