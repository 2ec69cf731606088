// XLA FFI handlers of the fused CPU attention, targets fastattn_attention_cpu
// (forward) and fastattn_attention_cpu_backward: each checks the buffers XLA
// hands over, fills fastattn::AttentionParams, and runs the kernel on XLA's
// intra-op thread pool (ffi::ThreadPool), recording its plan
// (csrc/ffi/attention_attrs.h: RecordPlan).
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
using fastattn::DtypeCode;

namespace {

// Fills the forward's operands of `p` (out and lse excepted) from the buffers and attributes;
// with a non-empty block table (the forward's), k and v are pools of pages; with non-empty scales
// (the forward's), k and v are a quantized cache.
ffi::Error FillParams(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer bias,
                      ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::S32> q_lens,
                      ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> q_spans,
                      ffi::Buffer<ffi::S32> kv_spans, ffi::Buffer<ffi::F32> sinks,
                      ffi::Buffer<ffi::F32> alibi, ffi::Buffer<ffi::S32>* block_table,
                      ffi::Buffer<ffi::F32>* k_scale, ffi::Buffer<ffi::F32>* v_scale,
                      const CallAttrs& attrs, fastattn::AttentionParams* p) {
  fastattn::QkvDims d;
  fastattn::PagedKv paged;
  if (auto err = block_table ? fastattn::CheckQkvPaged(q.dimensions(), k.dimensions(),
                                                       v.dimensions(), *block_table, &d, &paged)
                             : fastattn::CheckQkv(q.dimensions(), k.dimensions(), v.dimensions(),
                                                  &d);
      err.failure()) {
    return err;
  }
  p->B = d.B, p->T = d.T, p->S = d.S, p->N = d.N, p->K = d.K, p->H = d.H;
  p->block_table = paged.block_table;
  p->max_pages = paged.max_pages, p->pages = paged.pages, p->page_size = paged.page_size;
  fastattn::KvScales scales;
  if (k_scale) {
    if (auto err = fastattn::CheckKvScales(k.element_type(), k.dimensions(), *k_scale, *v_scale,
                                           &scales);
        err.failure()) {
      return err;
    }
  }
  const bool quantized = scales.dtype >= 0;
  if ((p->block_table || quantized) && !fastattn::cpu_reads_in_place(*p)) {
    return ffi::Error::InvalidArgument(
        "CPU attention: only the decode path (at most 64 query rows per key/value head) reads a "
        "paged or quantized cache");
  }
  const int dtype = DtypeCode(q.element_type());
  if (quantized) {
    if (v.element_type() != k.element_type() || dtype < 0) {
      return ffi::Error::InvalidArgument(
          "with scales, key and value must share one of S8, F8E4M3FN and the query be F32, F16 "
          "or BF16");
    }
    p->kv_dtype = static_cast<FaDtype>(scales.dtype);
    p->k_scale = scales.k, p->v_scale = scales.v;
    std::copy_n(scales.k_strides, 3, p->k_scale_strides);
    std::copy_n(scales.v_strides, 3, p->v_scale_strides);
  } else if (q.element_type() != k.element_type() || q.element_type() != v.element_type() ||
             dtype < 0) {
    return ffi::Error::InvalidArgument("query, key and value must share one of F32, F16, BF16");
  }
  p->dtype = static_cast<FaDtype>(dtype);
  p->q = q.untyped_data(), p->k = k.untyped_data(), p->v = v.untyped_data();

  const int64_t full[4] = {p->B, p->N, p->T, p->S};
  if (bias.element_count() > 0) {
    const int bias_dtype = DtypeCode(bias.element_type());
    if (bias_dtype < 0) return ffi::Error::InvalidArgument("bias must be F32, F16 or BF16");
    p->bias_dtype = static_cast<FaDtype>(bias_dtype);
    if (auto err = BroadcastStrides("bias", bias.dimensions(), full, p->bias_strides);
        err.failure()) {
      return err;
    }
    p->bias = bias.untyped_data();
  }
  if (mask.element_count() > 0) {
    if (auto err = BroadcastStrides("mask", mask.dimensions(), full, p->mask_strides);
        err.failure()) {
      return err;
    }
    p->mask = mask.typed_data();
  }
  if (auto err = fastattn::CheckLengths("query_seq_lengths", q_lens, p->B, &p->q_lens);
      err.failure()) {
    return err;
  }
  if (auto err = fastattn::CheckLengths("key_value_seq_lengths", kv_lens, p->B, &p->kv_lens);
      err.failure()) {
    return err;
  }
  if (auto err = fastattn::CheckFeatures(q_spans, kv_spans, sinks, alibi, d, &p->features);
      err.failure()) {
    return err;
  }
  p->rules = fastattn::RulesOf(attrs);
  return ffi::Error::Success();
}

// XLA's intra-op thread pool as the kernels' workers.
fastattn::CpuWorkers WorkersOf(ffi::ThreadPool& pool) {
  fastattn::CpuWorkers workers;
  workers.count = std::max<int64_t>(pool.num_threads(), 1);
  workers.run = [&pool](std::function<void()> task) { pool.Schedule(std::move(task)); };
  return workers;
}

// Records the plan a call of target `name` ran with, after the call's shape.
void Record(const char* name, const fastattn::AttentionParams& p, int64_t pool_threads,
            const fastattn::CpuPlan& plan) {
  fastattn::PlanFacts facts = {{"B", p.B}, {"T", p.T}, {"S", p.S}, {"N", p.N}, {"K", p.K},
                               {"H", p.H}, {"pool_threads", pool_threads}};
  for (auto& fact : plan.Facts()) facts.push_back(std::move(fact));
  fastattn::RecordPlan(name, std::move(facts));
}

ffi::Error AttentionCpuImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                            ffi::AnyBuffer v, ffi::AnyBuffer bias, ffi::Buffer<ffi::PRED> mask,
                            ffi::Buffer<ffi::S32> q_lens, ffi::Buffer<ffi::S32> kv_lens,
                            ffi::Buffer<ffi::S32> q_spans, ffi::Buffer<ffi::S32> kv_spans,
                            ffi::Buffer<ffi::F32> sinks, ffi::Buffer<ffi::F32> alibi,
                            ffi::Buffer<ffi::S32> block_table, ffi::Buffer<ffi::F32> k_scale,
                            ffi::Buffer<ffi::F32> v_scale, ffi::Result<ffi::AnyBuffer> out,
                            ffi::ResultBuffer<ffi::F32> lse, CallAttrs attrs) {
  fastattn::AttentionParams p;
  if (auto err = FillParams(q, k, v, bias, mask, q_lens, kv_lens, q_spans, kv_spans, sinks,
                            alibi, &block_table, &k_scale, &v_scale, attrs, &p);
      err.failure()) {
    return err;
  }
  // out in the inputs' type, or float32 (the unrounded output, for 16-bit inputs).
  if (out->element_type() != q.element_type() && out->element_type() != ffi::DataType::F32) {
    return ffi::Error::InvalidArgument("out must have the query's element type or F32");
  }
  if (out->element_count() != q.element_count() || lse->element_count() != p.B * p.T * p.N) {
    return ffi::Error::InvalidArgument("out must have the query's shape, lse (B, T, N)");
  }
  p.out_f32 = out->element_type() == ffi::DataType::F32;
  p.out = out->untyped_data();
  p.lse = lse->typed_data();
  const fastattn::CpuWorkers workers = WorkersOf(pool);
  Record("cpu", p, workers.count, fastattn::attention_forward_cpu(p, workers));
  return ffi::Error::Success();
}

ffi::Error AttentionCpuBackwardImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                                    ffi::AnyBuffer v, ffi::AnyBuffer bias,
                                    ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::S32> q_lens,
                                    ffi::Buffer<ffi::S32> kv_lens,
                                    ffi::Buffer<ffi::S32> q_spans,
                                    ffi::Buffer<ffi::S32> kv_spans, ffi::Buffer<ffi::F32> sinks,
                                    ffi::Buffer<ffi::F32> alibi, ffi::AnyBuffer d_out,
                                    ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> delta,
                                    ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                                    ffi::Result<ffi::AnyBuffer> dv, CallAttrs attrs) {
  fastattn::AttentionGradParams g;
  fastattn::AttentionParams& p = g.fwd;
  if (auto err = FillParams(q, k, v, bias, mask, q_lens, kv_lens, q_spans, kv_spans, sinks,
                            alibi, nullptr, nullptr, nullptr, attrs, &p);
      err.failure()) {
    return err;
  }
  for (auto type : {d_out.element_type(), dq->element_type(), dk->element_type(),
                    dv->element_type()}) {
    if (type != q.element_type()) {
      return ffi::Error::InvalidArgument(
          "d_out, dq, dk and dv must have the query's element type");
    }
  }
  if (d_out.element_count() != q.element_count() || lse.element_count() != p.B * p.T * p.N ||
      delta.element_count() != p.B * p.T * p.N) {
    return ffi::Error::InvalidArgument(
        "d_out must have the query's shape, lse and delta (B, T, N)");
  }
  p.lse = const_cast<float*>(lse.typed_data());  // read only: the forward's residual
  g.d_out = d_out.untyped_data();
  g.delta = delta.typed_data();
  g.dq = dq->untyped_data(), g.dk = dk->untyped_data(), g.dv = dv->untyped_data();
  const fastattn::CpuWorkers workers = WorkersOf(pool);
  Record("cpu_backward", p, workers.count, fastattn::attention_backward_cpu(g, workers));
  return ffi::Error::Success();
}

}  // namespace

namespace {

// The operands both targets start with.
auto BindOperands() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::AnyBuffer>()            // query
      .Arg<ffi::AnyBuffer>()            // key
      .Arg<ffi::AnyBuffer>()            // value
      .Arg<ffi::AnyBuffer>()            // bias or empty
      .Arg<ffi::Buffer<ffi::PRED>>()    // mask or empty
      .Arg<ffi::Buffer<ffi::S32>>()     // query lengths or empty
      .Arg<ffi::Buffer<ffi::S32>>()     // key lengths or empty
      .Arg<ffi::Buffer<ffi::S32>>()     // query segment spans or empty
      .Arg<ffi::Buffer<ffi::S32>>()     // key segment spans or empty
      .Arg<ffi::Buffer<ffi::F32>>()     // sinks or empty
      .Arg<ffi::Buffer<ffi::F32>>();    // ALiBi slopes or empty
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttentionCpu, AttentionCpuImpl,
                              BindOperands()
                                  .Arg<ffi::Buffer<ffi::S32>>()     // block table or empty
                                  .Arg<ffi::Buffer<ffi::F32>>()     // k_scale or empty
                                  .Arg<ffi::Buffer<ffi::F32>>()     // v_scale or empty
                                  .Ret<ffi::AnyBuffer>()            // out
                                  .Ret<ffi::Buffer<ffi::F32>>()     // lse
                                  .Attrs<CallAttrs>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttentionCpuBackward, AttentionCpuBackwardImpl,
                              BindOperands()
                                  .Arg<ffi::AnyBuffer>()            // d_out
                                  .Arg<ffi::Buffer<ffi::F32>>()     // lse
                                  .Arg<ffi::Buffer<ffi::F32>>()     // delta: rowsum(dO o O) - dLSE
                                  .Ret<ffi::AnyBuffer>()            // dq
                                  .Ret<ffi::AnyBuffer>()            // dk
                                  .Ret<ffi::AnyBuffer>()            // dv
                                  .Attrs<CallAttrs>());
