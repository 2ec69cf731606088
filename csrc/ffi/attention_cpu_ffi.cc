// XLA FFI handler of the fused CPU attention, target fastattn_attention_cpu:
// checks the buffers XLA hands over, fills fastattn::AttentionParams, and runs
// the kernel on XLA's intra-op thread pool (ffi::ThreadPool), recording its
// plan (csrc/ffi/attention_attrs.h: RecordPlan).
#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>

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

ffi::Error AttentionCpuImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                            ffi::AnyBuffer v, ffi::AnyBuffer bias, ffi::Buffer<ffi::PRED> mask,
                            ffi::Buffer<ffi::S32> q_lens, ffi::Buffer<ffi::S32> kv_lens,
                            ffi::Result<ffi::AnyBuffer> out, ffi::ResultBuffer<ffi::F32> lse,
                            CallAttrs attrs) {
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
  p.rules = fastattn::RulesOf(attrs);
  fastattn::CpuWorkers workers;
  workers.count = std::max<int64_t>(pool.num_threads(), 1);
  workers.run = [&pool](std::function<void()> task) { pool.Schedule(std::move(task)); };
  fastattn::PlanFacts facts = {{"B", p.B}, {"T", p.T}, {"S", p.S}, {"N", p.N}, {"K", p.K},
                               {"H", p.H}, {"pool_threads", workers.count}};
  for (auto& fact : fastattn::attention_forward_cpu(p, workers).Facts()) {
    facts.push_back(std::move(fact));
  }
  fastattn::RecordPlan("cpu", std::move(facts));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttentionCpu, AttentionCpuImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
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
