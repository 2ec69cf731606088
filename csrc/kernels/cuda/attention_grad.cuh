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
// dO . v: P = e^(logit - LSE), dS = P (dp - D) times the soft cap's
// derivative 1 - tanh^2 (FA_EXTRAS: logit = softcap tanh(scale qk / softcap)
// + bias, and a false mask hides the pair; else logit = scale qk). `seen`:
// the index rules show key j to row i.
__device__ __forceinline__ void prob_and_ds(const FaGradParams& p, float qk, float dp, bool seen,
                                            int b, int n, int i, int j, float lse2, float delta,
                                            float* pe, float* ds) {
#if FA_EXTRAS
  float x = qk * p.rules.scale, slope = 1.f;
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
  *pe = seen ? fa_ex2(fmaf(x, kFaLog2e, -lse2)) : 0.f;
  *ds = seen ? *pe * (dp - delta) * slope : 0.f;
#else
  *pe = seen ? fa_ex2(fmaf(qk, p.rules.scale * kFaLog2e, -lse2)) : 0.f;
  *ds = seen ? *pe * (dp - delta) : 0.f;
#endif
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

// The query steps (head n, rows i0 .. i0 + rows) that see a key of block k,
// in order over its heads: fa_first_step, then fa_next_step until n ==
// k.n_end. The same for every thread.
__device__ __forceinline__ void fa_next_step(const FaParams& p, const FaKeyBlock& k, int rows,
                                             int& n, int& i0) {
  for (i0 += rows;; i0 += rows) {
    if (i0 >= k.q_len) {
      i0 = 0;
      if (++n >= k.n_end) return;
    }
    int lo, hi;
    fa_rows_keys(p.rules, k.q_len, k.kv_len, i0, i0 + rows, &lo, &hi);
    if (hi > k.j0 && lo < k.j1) return;
  }
}
__device__ __forceinline__ void fa_first_step(const FaParams& p, const FaKeyBlock& k, int rows,
                                              int& n, int& i0) {
  n = k.j0 < k.kv_len ? k.n_end - p.N / p.K : k.n_end;  // keys past the length: no step
  i0 = -rows;
  if (n < k.n_end) fa_next_step(p, k, rows, n, i0);
}

// LSE in the log2 domain, +inf for a row that sees no key (P = 0 there).
__device__ __forceinline__ float lse2_of(float lse) {
  return lse == FA_NEG_INF ? __int_as_float(0x7f800000) : lse * kFaLog2e;
}

}  // namespace
