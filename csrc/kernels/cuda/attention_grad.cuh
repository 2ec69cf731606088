// What the backward kernels (attention_backward.cu, attention_backward_volta.cu,
// attention_backward_wgmma.cu) share: the probability and dS of one (query
// row, key) pair from its raw products, with the bias, mask and soft cap of
// FA_EXTRAS builds, and the stores of gradient elements.
#pragma once

#include "attention_split.cuh"

namespace {

// Runs body(true) for a tile whose every (row, key) pair the index rules
// show, else body(false): the body, inlined at each call with its argument a
// constant, then tests visibility per pair (`whole || fa_visible(...)`) only
// in the copy for partial tiles, rather than branching around every element
// of every tile. (A generic lambda would say it at compile time, but NVRTC
// rejects them in device code.)
template <class Body>
__device__ __forceinline__ void fa_if_whole(bool whole, Body&& body) {
  if (whole) {
    body(true);
  } else {
    body(false);
  }
}

// P and dS of one (row i, key j) from the raw products qk = q . k and dp =
// dO . v, in attention_common.cuh's units (FaUnits), as the forward
// computed them: logit x = scale qk (FA_EXTRAS: then softcap tanh(x /
// softcap), + bias, and a false mask hides the pair), P = e^(x - LSE), so
// exactly 1 where the forward's was; dS = P (dP - D) times the soft cap's
// derivative 1 - tanh^2 (then fa_one_hot_rounding over the tile). `seen`:
// the index rules show key j to row i; `lse`: lse_of the row's.
__device__ __forceinline__ void prob_and_ds(const FaGradParams& p, float qk, float dp, bool seen,
                                            int b, int n, int i, int j, float lse, float delta,
                                            float* pe, float* ds) {
  // Rounded on its own (no fma with what follows), as the forward rounds it.
  float x = __fmul_rn(qk, p.rules.scale);
#if FA_EXTRAS
  float slope = 1.f;
  if (seen && p.rules.softcap > 0.f) {
    const float t = fa_tanh(x / p.rules.softcap);
    x = p.rules.softcap * t;
    slope = 1.f - t * t;
  }
  if (seen && p.bias) {
    x += p.bias[b * p.bias_strides[0] + n * p.bias_strides[1] + i * p.bias_strides[2] +
                j * p.bias_strides[3]];
  }
  if (seen && p.mask) {
    seen = p.mask[b * p.mask_strides[0] + n * p.mask_strides[1] + i * p.mask_strides[2] +
                  j * p.mask_strides[3]];
  }
  if (seen) seen = fa_same_segment(p.features, p.T, p.S, b, i, j);
  if (seen) x = fa_add_alibi(x, fa_alibi_row(p, b, n, i), j);
#else
  constexpr float slope = 1.f;
#endif
  *pe = seen ? fa_weight(x, lse, kFaLog2e) : 0.f;
  *ds = seen ? *pe * (dp - delta) * slope : 0.f;
}

// attention_rules.h's one-hot rounding over a tile of a thread's P and dS
// (prob_and_ds's); magnitude_of(j, e): the caller's rowsum(|dO o O|) of
// entry (j, e)'s row (fa_magnitude_of). Where P = 1, O = V_j, so that is
// sum_h |dO_h V_jh|, and a dS within fa_one_hot_tolerance(H) of it becomes 0 (within it times the soft cap's
// derivative, which dS carries: at most the same absolute amount). A pass
// of its own after the tile's probabilities, and a branch taken only by a
// thread holding some P = 1 (a row's only visible key, or logits far apart),
// so the hot loop keeps its registers.
template <int kJ, int kE, class MagnitudeOf>
__device__ __forceinline__ void fa_one_hot_rounding(const float (&pr)[kJ][kE],
                                                    float (&ds)[kJ][kE], int H,
                                                    MagnitudeOf magnitude_of) {
  // Whether any P is 1: their maximum (one FMNMX per entry, where testing
  // each took two compares and a predicate merge).
  float top = 0.f;
#pragma unroll
  for (int j = 0; j < kJ; ++j)
#pragma unroll
    for (int e = 0; e < kE; ++e) top = fmaxf(top, pr[j][e]);
  if (!(top >= 1.f)) return;
  const float tol = fa_one_hot_tolerance(H);
#pragma unroll
  for (int j = 0; j < kJ; ++j)
#pragma unroll
    for (int e = 0; e < kE; ++e) {
      if (pr[j][e] != 1.f || ds[j][e] == 0.f) continue;
      const float m = magnitude_of(j, e);
      // A NaN or Inf (dO or V) is never rounded away.
      if (m < __int_as_float(0x7f800000) && fabsf(ds[j][e]) <= tol * m) ds[j][e] = 0.f;
    }
}

// Elements at and after `at` (even) of a gradient array of FA_OUT_DTYPE.
__device__ __forceinline__ void fa_store_pair(void* out, long long at, float x0, float x1) {
#if FA_OUT_DTYPE == FA_F32
  *reinterpret_cast<float2*>(static_cast<float*>(out) + at) = make_float2(x0, x1);
#elif FA_OUT_DTYPE == FA_BF16
  *reinterpret_cast<unsigned*>(static_cast<unsigned short*>(out) + at) = fa_pack_bf16(x0, x1);
#else
  *reinterpret_cast<unsigned*>(static_cast<unsigned short*>(out) + at) = fa_pack_f16(x0, x1);
#endif
}

// Rows row0 and row0 + 8 of a 16-row accumulator tile (the m16n8 layout of
// attention_m16n8.cuh, also wgmma's per warp) holding columns col0 .. col0 +
// 8 kNo, times `scale`, into (b, row, head) of a (B, L, heads, H) array of
// FA_OUT_DTYPE (rows >= L and columns >= H skipped).
template <int kNo>
__device__ __forceinline__ void fa_write_grad_rows(void* out, const long long (&stride)[3],
                                                   int b, int head, int row0, int col0, int rows,
                                                   int H, int t4, float scale,
                                                   const float (&acc)[kNo][4]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row0 + 8 * h;
    if (row >= rows) continue;
    const long long at = fa_at(stride, b, row, head);
#pragma unroll
    for (int nt = 0; nt < kNo; ++nt) {
      const int col = col0 + nt * 8 + 2 * t4;
      if (col >= H) continue;
      fa_store_pair(out, at + col, acc[nt][2 * h] * scale, acc[nt][2 * h + 1] * scale);
    }
  }
}

// fa_backward_dkdv's block: keys [j0, j0 + Bc) of (b, kvh), block `unit`
// of ceil(S / Bc) * K * B, read by the G = N / K query heads kvh G ..
// n_end; j1 = min(j0 + Bc, kv_len).
struct FaKeyBlock {
  int b, kvh, j0, j1, q_len, kv_len, n_end;
};

__device__ __forceinline__ FaKeyBlock fa_key_block(const FaParams& p, int Bc, int unit) {
  const int tiles = (p.S + Bc - 1) / Bc;
  FaKeyBlock k;
  k.kvh = unit / tiles % p.K, k.b = unit / tiles / p.K;
  k.j0 = unit % tiles * Bc;
  k.q_len = fa_q_len(p, k.b), k.kv_len = fa_kv_len(p, k.b);
  k.j1 = min(k.j0 + Bc, k.kv_len);
  k.n_end = (k.kvh + 1) * (p.N / p.K);
  return k;
}

// The first row of the steps over block k's rows: 0, or where the segment
// ids let its keys be seen from (fa_segment_rows), rounded down to a step.
__device__ __forceinline__ int fa_first_row(const FaParams& p, const FaKeyBlock& k, int rows) {
  int lo = 0, hi = k.q_len;
  fa_segment_rows(p.features, p.S, k.b, k.j0, k.j1, &lo, &hi);
  return lo / rows * rows;
}

// The query steps (head n, rows i0 .. i0 + rows) that see a key of block k,
// in order over its heads: fa_first_step, then fa_next_step until n ==
// k.n_end. The same for every thread.
__device__ __forceinline__ void fa_next_step(const FaParams& p, const FaKeyBlock& k, int rows,
                                             int& n, int& i0) {
  for (i0 += rows;; i0 += rows) {
    if (i0 >= k.q_len) {
      i0 = fa_first_row(p, k, rows);
      if (++n >= k.n_end) return;
    }
    int lo, hi;
    fa_rows_keys(p.rules, k.q_len, k.kv_len, i0, i0 + rows, &lo, &hi);
    fa_segment_keys(p.features, p.T, k.b, i0, i0 + rows, &lo, &hi);
    if (hi > k.j0 && lo < k.j1) return;
  }
}
__device__ __forceinline__ void fa_first_step(const FaParams& p, const FaKeyBlock& k, int rows,
                                              int& n, int& i0) {
  n = k.j0 < k.kv_len ? k.n_end - p.N / p.K : k.n_end;  // keys past the length: no step
  i0 = fa_first_row(p, k, rows) - rows;
  if (n < k.n_end) fa_next_step(p, k, rows, n, i0);
}

// The magnitude_of of fa_one_hot_rounding for kernels that read it from
// global memory: rows row_of(j, e) of head n of batch b.
template <class RowOf>
__device__ __forceinline__ auto fa_magnitude_of(const FaGradParams& p, int b, int n,
                                                RowOf row_of) {
  const float* magnitude = p.magnitude + fa_at(p.lse_stride, b, 0, n);
  const long long stride = p.lse_stride[1];
  return [=](int j, int e) { return magnitude[row_of(j, e) * stride]; };
}

// A row's LSE as prob_and_ds takes it: +inf for a row that sees no key (P =
// 0 there).
__device__ __forceinline__ float lse_of(float lse) {
  return lse == FA_NEG_INF ? __int_as_float(0x7f800000) : lse;
}

}  // namespace
