// What the FFI handlers share: the attributes of one call
// (fastattn_jax/backends.py and cuda.py build them), decoded into the index
// rules once, the kernels' codes of XLA's element types, the checks of the
// operands' shapes, and the record of the plan each target ran its latest
// call with.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "kernels/attention_dtypes.h"
#include "kernels/attention_rules.h"
#include "xla/ffi/api/ffi.h"

namespace fastattn {

// The custom call's attributes: the logit transform and index rules
// (FaRules), and on CUDA the kernel variant the lowering chose
// (csrc/cuda/variants.h: PlanCall) and whether it folds heads into rows.
struct CallAttrs {
  float scale;
  float softcap;
  int64_t is_causal;
  int64_t end_aligned;
  int64_t window_left;
  int64_t window_right;
  int64_t variant;     // KernelVariant::Key(); 0 on the CPU
  int64_t fold_heads;  // CallPlan::fold_heads; 0 on the CPU
};

// The rules of any attribute struct with the six rule fields (CallAttrs, the
// Ascend targets' AscendAttrs).
template <class Attrs>
FaRules RulesOf(const Attrs& a) {
  return fa_make_rules(a.scale, a.softcap, a.is_causal, a.end_aligned, a.window_left,
                       a.window_right);
}

// The kernels' code of an XLA element type (FaDtype), or -1 for a type no
// kernel takes.
inline int DtypeCode(xla::ffi::DataType type) {
  switch (type) {
    case xla::ffi::DataType::F16: return kFaF16;
    case xla::ffi::DataType::BF16: return kFaBF16;
    case xla::ffi::DataType::F32: return kFaF32;
    default: return -1;
  }
}

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

// A paged cache's block table, read from the operands of a call.
struct PagedKv {
  const int32_t* block_table = nullptr;  // (B, max_pages), or null: not paged
  int64_t max_pages = 0, pages = 0, page_size = 0;
  int64_t page_shift = 0;  // log2(page_size)
};

// The smallest page a paged cache may have: the CUDA decode kernel reads
// tiles of 16 keys from at most two pages (attention_decode.cu).
constexpr int64_t kMinPageSize = 16;

// Reads (B, T, N, H) x (B, S, K, H) as CheckQkv does, or, with a non-empty
// block table (B, max_pages), a paged cache: key and value pools of
// (pages, page_size, K, H), page_size a power of two >= kMinPageSize, and S =
// max_pages * page_size.
inline xla::ffi::Error CheckQkvPaged(xla::ffi::Span<const int64_t> qd,
                                     xla::ffi::Span<const int64_t> kd,
                                     xla::ffi::Span<const int64_t> vd,
                                     xla::ffi::Buffer<xla::ffi::S32>& table, QkvDims* d,
                                     PagedKv* paged) {
  *paged = PagedKv{};
  if (table.element_count() == 0) return CheckQkv(qd, kd, vd, d);
  auto td = table.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || td.size() != 2 || td[0] != qd[0] ||
      !std::equal(vd.begin(), vd.end(), kd.begin(), kd.end()) || kd[3] != qd[3] ||
      kd[2] == 0 || qd[2] % kd[2] != 0 || kd[1] < kMinPageSize || (kd[1] & (kd[1] - 1))) {
    return xla::ffi::Error::InvalidArgument(
        "query " + DimsString(qd) + ", key/value pages " + DimsString(kd) +
        " and block table " + DimsString(td) +
        " do not fit (B, T, N, H) x (pages, page_size, K, H) x (B, max_pages) with page_size a "
        "power of two >= " + std::to_string(kMinPageSize));
  }
  *d = QkvDims{qd[0], qd[1], td[1] * kd[1], qd[2], kd[2], qd[3]};
  int64_t shift = 0;
  while ((int64_t{1} << shift) < kd[1]) ++shift;
  *paged = PagedKv{table.typed_data(), td[1], kd[0], kd[1], shift};
  return xla::ffi::Error::Success();
}

// A quantized cache (kFaI8 or kFaF8E4M3) and its scales, read from the
// operands of a call: the dequantized key is key * k_scale (value likewise),
// the scales float32 and broadcast over the cache's first three dims, (B, S,
// K) or a paged cache's (pages, page_size, K).
struct KvScales {
  int dtype = -1;  // the cache's FaDtype; -1: not quantized
  const float* k = nullptr;
  const float* v = nullptr;
  int64_t k_strides[3] = {0, 0, 0};  // elements per step of each dim; 0 where broadcast
  int64_t v_strides[3] = {0, 0, 0};
};

// Reads the scales of the cache `kd` of element type `kv_type`: empty scale
// operands, no quantization (the cache then has the query's type); else the
// cache int8 or float8_e4m3fn and each scale 3-D, every dim 1 or the cache's.
inline xla::ffi::Error CheckKvScales(xla::ffi::DataType kv_type, xla::ffi::Span<const int64_t> kd,
                                     xla::ffi::Buffer<xla::ffi::F32>& k_scale,
                                     xla::ffi::Buffer<xla::ffi::F32>& v_scale, KvScales* s) {
  *s = KvScales{};
  if (k_scale.element_count() == 0 && v_scale.element_count() == 0) {
    return xla::ffi::Error::Success();
  }
  if (kv_type == xla::ffi::DataType::S8) {
    s->dtype = kFaI8;
  } else if (kv_type == xla::ffi::DataType::F8E4M3FN) {
    s->dtype = kFaF8E4M3;
  } else {
    return xla::ffi::Error::InvalidArgument(
        "a cache with scales must be S8 or F8E4M3FN");
  }
  auto strides = [&](xla::ffi::Span<const int64_t> dims, int64_t out[3]) {
    if (dims.size() != 3 || kd.size() != 4) return false;
    int64_t stride = 1;
    for (int d = 2; d >= 0; --d) {
      if (dims[d] != 1 && dims[d] != kd[d]) return false;
      out[d] = dims[d] == 1 ? 0 : stride;
      stride *= dims[d];
    }
    return true;
  };
  if (!strides(k_scale.dimensions(), s->k_strides) ||
      !strides(v_scale.dimensions(), s->v_strides)) {
    return xla::ffi::Error::InvalidArgument(
        "k_scale " + DimsString(k_scale.dimensions()) + " and v_scale " +
        DimsString(v_scale.dimensions()) + " must broadcast to the cache's first dims of " +
        DimsString(kd));
  }
  s->k = k_scale.typed_data();
  s->v = v_scale.typed_data();
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

// The training features from their four operands (fastattn_jax/custom_calls.py:
// feature_operands), each empty where absent: the segment spans (B, T,
// kFaSpan) and (B, S, kFaSpan) int32, both or neither; sinks and ALiBi
// slopes (B|1, N) float32.
inline xla::ffi::Error CheckFeatures(xla::ffi::Buffer<xla::ffi::S32>& q_spans,
                                     xla::ffi::Buffer<xla::ffi::S32>& kv_spans,
                                     xla::ffi::Buffer<xla::ffi::F32>& sinks,
                                     xla::ffi::Buffer<xla::ffi::F32>& alibi, const QkvDims& d,
                                     FaFeatures* f) {
  *f = FaFeatures{};
  if ((q_spans.element_count() == 0) != (kv_spans.element_count() == 0)) {
    return xla::ffi::Error::InvalidArgument("segment spans come for query and keys or neither");
  }
  if (q_spans.element_count() > 0) {
    const std::vector<int64_t> want_q = {d.B, d.T, kFaSpan}, want_kv = {d.B, d.S, kFaSpan};
    if (!std::equal(q_spans.dimensions().begin(), q_spans.dimensions().end(), want_q.begin(),
                    want_q.end()) ||
        !std::equal(kv_spans.dimensions().begin(), kv_spans.dimensions().end(),
                    want_kv.begin(), want_kv.end())) {
      return xla::ffi::Error::InvalidArgument(
          "segment spans " + DimsString(q_spans.dimensions()) + " and " +
          DimsString(kv_spans.dimensions()) + " must be (B, T, 4) and (B, S, 4)");
    }
    f->q_spans = q_spans.typed_data();
    f->kv_spans = kv_spans.typed_data();
  }
  auto per_head = [&](const char* name, xla::ffi::Buffer<xla::ffi::F32>& x, const float** data,
                      int* b_stride) {
    if (x.element_count() == 0) return xla::ffi::Error::Success();
    auto dims = x.dimensions();
    if (dims.size() != 2 || dims[1] != d.N || (dims[0] != 1 && dims[0] != d.B)) {
      return xla::ffi::Error::InvalidArgument(std::string(name) + " " + DimsString(dims) +
                                              " must be (B, N) or (1, N)");
    }
    *data = x.typed_data();
    *b_stride = dims[0] == 1 ? 0 : static_cast<int>(d.N);
    return xla::ffi::Error::Success();
  };
  if (auto err = per_head("sinks", sinks, &f->sinks, &f->sinks_b); err.failure()) return err;
  return per_head("alibi_slopes", alibi, &f->alibi, &f->alibi_b);
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

// The launch plan a target ran its latest call with, as named integers: what
// the handler asked the plan functions (csrc/cuda/variants.h,
// csrc/kernels/cpu/attention_cpu.h) and launched. Python reads them with
// fastattn_jax._ffi.recorded_plans(), to check and explain what ran.
using PlanFacts = std::vector<std::pair<std::string, int64_t>>;

struct PlanRecords {
  std::mutex mu;
  std::map<std::string, PlanFacts> latest;  // by target
};

inline PlanRecords& Records() {
  static auto* records = new PlanRecords();
  return *records;
}

// Replaces `target`'s record. Thread-safe.
inline void RecordPlan(const std::string& target, PlanFacts facts) {
  std::lock_guard<std::mutex> lock(Records().mu);
  Records().latest[target] = std::move(facts);
}

// Every target's latest record.
inline std::map<std::string, PlanFacts> RecordedPlans() {
  std::lock_guard<std::mutex> lock(Records().mu);
  return Records().latest;
}

}  // namespace fastattn

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(fastattn::CallAttrs,
                                      StructMember<float>("scale"),
                                      StructMember<float>("softcap"),
                                      StructMember<int64_t>("is_causal"),
                                      StructMember<int64_t>("end_aligned"),
                                      StructMember<int64_t>("window_left"),
                                      StructMember<int64_t>("window_right"),
                                      StructMember<int64_t>("variant"),
                                      StructMember<int64_t>("fold_heads"));
