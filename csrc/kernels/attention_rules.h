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

// The keys [*lo, *hi) that row i sees by the index rules (empty when
// *lo >= *hi, as for every row at or past q_len). Both bounds are
// nondecreasing in i over the rows below q_len.
template <class I>
FA_HOST_DEVICE void fa_row_keys(const FaRules& r, I q_len, I kv_len, I i, I* lo, I* hi) {
  const I pos = r.end_aligned ? i + kv_len - q_len : i;
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
