// The semantics of one attention call that every kernel implements, CPU and
// CUDA alike: the logit transform and the index rules (which keys a query row
// sees). The FFI handlers decode them once from the call's attributes
// (csrc/ffi/attention_attrs.h) and embed them in each kernel's parameters.
//
// Compiled by the host compiler (the CPU kernel, the handlers) and by NVRTC
// (the CUDA kernels): no includes.
//
// Row i of a batch whose lengths are q_len <= T and kv_len <= S sits at key
// position pos(i) = i (or i + kv_len - q_len, end_aligned: the last valid
// query at the last valid key, as when T new tokens attend over a cache that
// holds them) and sees key j iff
//   i < q_len, j < kv_len, (j <= pos(i) if causal),
//   pos(i) - window_left <= j <= pos(i) + window_right (each bound if >= 0),
// and the call's boolean mask, if any, allows it. The logit of a visible key
// is x = scale * (q_i . k_j), then x = softcap * tanh(x / softcap) if
// softcap > 0, then x += bias[b, n, i, j] if there is a bias. A row's output is
// softmax(x) . V over its visible keys; a row that sees none gets 0 and an LSE
// of -inf.
#pragma once

#if defined(__CUDACC_RTC__)
#define FA_HOST_DEVICE __host__ __device__ __forceinline__
#else
#include <cmath>  // the host's expf, log1pf (NVRTC has them built in)
#define FA_HOST_DEVICE inline
#endif

struct FaRules {
  float scale;
  float softcap;     // > 0: soft cap on; 0: off
  int causal;
  int end_aligned;
  int window_left;   // -1: unbounded; else in [0, kFaMaxWindow]
  int window_right;
};

// The backward's one-hot rounding, every kernel's: where a row's softmax is
// one-hot to float precision (P = 1 at key j, as for a row's only visible
// key) the exact dS = P (dP - D) is dLSE (D = dO . O - dLSE with O = V_j),
// but dP = dO . V_j is summed by the kernel and dO . O by the caller, each in
// an order of its own, which leaves up to about (2 H + 8) u sum_h |dO_h
// V_jh| of rounding in dP - D (u = 2^-24), and the scale multiplies it into
// dQ and dK, whose exact value there is 0 (XLA's softmax VJP, g - g, gives 0
// too). So a dP - D within this fraction of sum_h |dO_h V_jh| is taken as 0
// at such an entry: a dLSE below it is lost, as it would be in the rounding.
FA_HOST_DEVICE float fa_one_hot_tolerance(int H) {
  return static_cast<float>(2 * H + 8) * 5.9604644775390625e-8f;  // u = 2^-24
}

// Windows wider than this are as good as unbounded for any T + S the kernels
// take (both below 2^30), and keep pos(i) + 1 + window in an int.
constexpr long long kFaMaxWindow = 1ll << 30;

// The rules as the handlers decode them from the call's attributes: windows
// below 0 mean unbounded, wider ones are clamped to kFaMaxWindow.
FA_HOST_DEVICE FaRules fa_make_rules(float scale, float softcap, long long causal,
                                     long long end_aligned, long long window_left,
                                     long long window_right) {
  auto window = [](long long w) {
    return static_cast<int>(w < 0 ? -1 : w > kFaMaxWindow ? kFaMaxWindow : w);
  };
  return FaRules{scale, softcap, causal != 0, end_aligned != 0, window(window_left),
                 window(window_right)};
}

// Row i's key position pos(i), which the causal and window rules and ALiBi
// measure keys from.
template <class I>
FA_HOST_DEVICE I fa_row_pos(const FaRules& r, I q_len, I kv_len, I i) {
  return r.end_aligned ? i + kv_len - q_len : i;
}

// The keys [*lo, *hi) that row i sees by the index rules (empty when
// *lo >= *hi, as for every row at or past q_len). Both bounds are
// nondecreasing in i over the rows below q_len.
template <class I>
FA_HOST_DEVICE void fa_row_keys(const FaRules& r, I q_len, I kv_len, I i, I* lo, I* hi) {
  const I pos = fa_row_pos(r, q_len, kv_len, i);
  I l = 0, h = i < q_len ? kv_len : 0;
  if (r.causal && pos + 1 < h) h = pos + 1;
  if (r.window_right >= 0 && pos + 1 + r.window_right < h) h = pos + 1 + r.window_right;
  if (r.window_left >= 0 && pos - r.window_left > l) l = pos - r.window_left;
  *lo = l;
  *hi = h;
}

// The keys [*lo, *hi) that some row of [m0, m1) sees (empty if none does).
template <class I>
FA_HOST_DEVICE void fa_rows_keys(const FaRules& r, I q_len, I kv_len, I m0, I m1, I* lo, I* hi) {
  if (m1 > q_len) m1 = q_len;
  *lo = 0;
  *hi = 0;
  if (m1 <= m0) return;
  I unused;
  fa_row_keys(r, q_len, kv_len, m0, lo, &unused);
  fa_row_keys(r, q_len, kv_len, m1 - 1, &unused, hi);
}

// The keys [*lo, *hi) that every row of [m0, m1) sees (empty if some row
// past q_len, or none, is in the range).
template <class I>
FA_HOST_DEVICE void fa_common_keys(const FaRules& r, I q_len, I kv_len, I m0, I m1, I* lo, I* hi) {
  *lo = 0;
  *hi = 0;
  if (m1 > q_len || m1 <= m0) return;
  I unused;
  fa_row_keys(r, q_len, kv_len, m1 - 1, lo, &unused);
  fa_row_keys(r, q_len, kv_len, m0, &unused, hi);
}

// Whether every row of [m0, m1) sees every key of [n0, n1).
template <class I>
FA_HOST_DEVICE bool fa_all_visible(const FaRules& r, I q_len, I kv_len, I m0, I m1, I n0, I n1) {
  I lo, hi;
  fa_common_keys(r, q_len, kv_len, m0, m1, &lo, &hi);
  return lo < hi && n0 >= lo && n1 <= hi;
}

// The training features of a call, each null where absent (the operands
// fastattn_jax/custom_calls.py's feature_operands makes):
// - segment ids (packed sequences): row i of batch b sees key j only if
//   their ids are equal. Each row's span, q_spans + (b T + i) kFaSpan, holds
//   its id, the end of the run of equal ids that holds it, and the keys lo
//   and hi that bound those that rows >= i (lo) and rows <= i (hi) share a
//   segment with; each key's span in kv_spans likewise, with rows for keys.
// - sinks: a logit per (b, n) that joins each row's softmax denominator and
//   has no value row: the row's LSE becomes logaddexp(LSE, sink), its output
//   scales by e^(LSE - that) (fa_join_sink).
// - ALiBi: logit x of (i, j) += -slope |pos(i) - j|, after the soft cap.
struct FaFeatures {
  const int* q_spans;   // (B, T, kFaSpan)
  const int* kv_spans;  // (B, S, kFaSpan)
  const float* sinks;   // (b, n) at sinks[b * sinks_b + n]
  const float* alibi;   // slopes, (b, n) at alibi[b * alibi_b + n]
  int sinks_b, alibi_b;  // N, or 0 where broadcast over B
};

// A span's fields, kFaSpan ints per position.
enum FaSpanField { kFaSpanId, kFaSpanRunEnd, kFaSpanLo, kFaSpanHi, kFaSpan };

// Narrows [*lo, *hi) to the other side's positions that positions [p0, p1)
// of batch b can share a segment with (a bound: exact where the ids are
// sorted), from this side's spans (L per batch); unchanged without ids.
template <class I>
FA_HOST_DEVICE void fa_span_bounds(const int* spans, I L, I b, I p0, I p1, I* lo, I* hi) {
  if (p1 > L) p1 = L;
  if (!spans || p1 <= p0) return;
  const I first = spans[(b * L + p0) * kFaSpan + kFaSpanLo];
  const I last = spans[(b * L + p1 - 1) * kFaSpan + kFaSpanHi];
  if (first > *lo) *lo = first;
  if (last < *hi) *hi = last;
}

// Narrows keys [*lo, *hi) to those that rows [m0, m1) of batch b can share
// a segment with.
template <class I>
FA_HOST_DEVICE void fa_segment_keys(const FaFeatures& f, I T, I b, I m0, I m1, I* lo, I* hi) {
  fa_span_bounds(f.q_spans, T, b, m0, m1, lo, hi);
}

// Narrows rows [*lo, *hi) to those that keys [n0, n1) of batch b can share
// a segment with.
template <class I>
FA_HOST_DEVICE void fa_segment_rows(const FaFeatures& f, I S, I b, I n0, I n1, I* lo, I* hi) {
  fa_span_bounds(f.kv_spans, S, b, n0, n1, lo, hi);
}

// Whether rows [m0, m1) and keys [n0, n1) of batch b all hold one segment
// id (then no pair needs the test), or there are no segment ids.
template <class I>
FA_HOST_DEVICE bool fa_segment_whole(const FaFeatures& f, I T, I S, I b, I m0, I m1, I n0,
                                     I n1) {
  if (!f.q_spans) return true;
  if (m0 >= T || n0 >= S) return false;
  const int* q = f.q_spans + (b * T + m0) * kFaSpan;
  const int* k = f.kv_spans + (b * S + n0) * kFaSpan;
  return q[kFaSpanRunEnd] >= (m1 < T ? m1 : T) && k[kFaSpanRunEnd] >= (n1 < S ? n1 : S) &&
         q[kFaSpanId] == k[kFaSpanId];
}

// Whether row i and key j of batch b share a segment (true without ids).
template <class I>
FA_HOST_DEVICE bool fa_same_segment(const FaFeatures& f, I T, I S, I b, I i, I j) {
  return !f.q_spans || f.q_spans[(b * T + i) * kFaSpan + kFaSpanId] ==
                           f.kv_spans[(b * S + j) * kFaSpan + kFaSpanId];
}

// ALiBi's slope of (b, n); 0 without ALiBi.
FA_HOST_DEVICE float fa_alibi_slope(const FaFeatures& f, long long b, long long n) {
  return f.alibi ? f.alibi[b * f.alibi_b + n] : 0.f;
}

// ALiBi's term of a row at key position pos and key j.
template <class I>
FA_HOST_DEVICE float fa_alibi_term(float slope, I pos, I j) {
  return -slope * static_cast<float>(pos > j ? pos - j : j - pos);
}

// A finished row's LSE with the sink of (b, n) joined: *lse becomes
// logaddexp(*lse, sink); returns the factor e^(old - new) its normalized
// output takes (1 without sinks; 0 for a row that saw no key, LSE -inf).
FA_HOST_DEVICE float fa_join_sink(const FaFeatures& f, long long b, long long n, float* lse) {
  if (!f.sinks) return 1.f;
  const float sink = f.sinks[b * f.sinks_b + n];
  const float hi = *lse > sink ? *lse : sink;
  if (hi < -3.4028235e38f) return 1.f;  // both -inf: unchanged
#if defined(__CUDACC_RTC__)
  // The fast intrinsics (about 2^-21 relative): where the forward kernels
  // write a row, every output column is live, and log1pf's registers spill.
  const float joined = hi + __logf(1.f + __expf(-fabsf(*lse - sink)));
  const float factor = __expf(*lse - joined);
#else
  const float joined = hi + log1pf(expf(-fabsf(*lse - sink)));
  const float factor = expf(*lse - joined);
#endif
  *lse = joined;
  return factor;
}
