// What the tensor-core kernels share: the ldmatrix and mma.m16n8k16 wrappers,
// and the per-row work on accumulators in the mma.m16n8 C-fragment layout
// (the tiling-mask of a boundary tile, one online softmax step, and the final
// normalize-and-write). Used by attention_mma16.cu (mma.m16n8k16 / m16n8k8),
// attention_wgmma.cu (wgmma m64nN, whose accumulators each warp holds in the
// same layout for its 16 rows) and attention_decode.cu's build 80.
//
// For a 16-row tile a thread (g = lane / 4, t4 = lane % 4) holds, per block
// nt of 8 columns, c[nt][0..1] at row row0 = (tile row) + g and columns
// 8 nt + 2 t4 + {0, 1}, and c[nt][2..3] at row row0 + 8. Row statistics are
// per thread: the four threads of a quad share a row and combine by shuffles.
#pragma once

#include "attention_split.cuh"

// ldmatrix of four 8x8 16-bit matrices (.trans: each transposed) from the
// shared-memory rows whose addresses lanes 8i .. 8i + 7 give, into r[i].
__device__ __forceinline__ void fa_ldsm_x4(unsigned addr, unsigned (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

__device__ __forceinline__ void fa_ldsm_x4_t(unsigned addr, unsigned (&r)[4]) {
  asm volatile(
      "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
      : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

#if __CUDA_ARCH__ >= 800
// cp.async of a tile's ROWS rows into shared memory at dst, rows kRowBytes
// apart, each of kChunks 16-byte chunks, by kThreads threads (tid): rows
// past s.rows_valid and columns past s.cols land as zeros.
template <int ROWS, int kChunks, int kRowBytes, int kThreads>
__device__ __forceinline__ void fa_tile_async(unsigned dst, const FaTileSrc& s, int tid) {
#pragma unroll
  for (int i = 0; i < (ROWS * kChunks + kThreads - 1) / kThreads; ++i) {
    const int c = tid + i * kThreads;
    if (ROWS * kChunks % kThreads != 0 && c >= ROWS * kChunks) break;
    const int r = c / kChunks, ch = c % kChunks;
    const bool ok = r < s.rows_valid && ch * 8 < s.cols;
    // 32-bit offsets: a tile spans < 2^31 elements, and 64-bit ones per
    // chunk would pin dozens of registers across the loop.
    const unsigned short* src = s.base + (ok ? r * (int)s.ld + ch * 8 : 0);
    fa_cp_async16(dst + r * kRowBytes + ch * 16, src, ok);
  }
}
#endif

struct alignas(16) FaU4 {
  unsigned x, y, z, w;
};

// A tile's ROWS rows, global -> registers -> shared, for kernel 75 (no
// cp.async): rows and columns as fa_tile_async lays them out. load() and
// store() apart, so that math can hide the loads' latency.
template <int ROWS, int kChunks, int kRowBytes, int kThreads>
struct FaTileRegs {
  static constexpr int kN = (ROWS * kChunks + kThreads - 1) / kThreads;
  FaU4 v[kN];
  __device__ __forceinline__ void load(const FaTileSrc& s, int tid) {
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      int c = tid + i * kThreads;
      const int r = c / kChunks, ch = c % kChunks;
      v[i] = FaU4{0, 0, 0, 0};
      if (c < ROWS * kChunks && r < s.rows_valid && ch * 8 < s.cols)
        v[i] = *reinterpret_cast<const FaU4*>(s.base + r * (int)s.ld + ch * 8);
    }
  }
  __device__ __forceinline__ void store(unsigned char* dst, int tid) const {
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      int c = tid + i * kThreads;
      if (c < ROWS * kChunks)
        *reinterpret_cast<FaU4*>(dst + (c / kChunks) * kRowBytes + (c % kChunks) * 16) = v[i];
    }
  }
};

// c += a (16x16, row) * b (16x8, col) in float32.
__device__ __forceinline__ void fa_mma16(float (&c)[4], const unsigned (&a)[4],
                                         unsigned b0, unsigned b1) {
#if FA_KERNEL_SM == 80
#if FA_DTYPE == FA_BF16
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
      "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
      "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
#else
  // The k16 fragments split into two k8 ones: (a0, a1, b0) then (a2, a3, b1).
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
      "{%4,%5}, {%6}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(b0));
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
      "{%4,%5}, {%6}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[2]), "r"(a[3]), "r"(b1));
#endif
}

// Sets to -inf the logits of keys [n0, n0 + 8 kNs) that the index rules hide
// from rows row0 and row0 + 8: each row sees one interval of keys [lo, hi)
// (fa_row_keys), so an element costs two compares.
template <int kNs>
__device__ __forceinline__ void fa_mask_rows(const FaRules& rules, float (&s)[kNs][4], int row0,
                                             int n0, int q_len, int kv_len, int t4) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    int lo, hi;
    fa_row_keys(rules, q_len, kv_len, row0 + h * 8, &lo, &hi);
    const int lo_i = max(lo - n0, -1), hi_i = max(hi - n0, -1);
#pragma unroll
    for (int nt = 0; nt < kNs; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int jj = nt * 8 + 2 * t4 + e;  // key - n0
        if (jj < lo_i || jj >= hi_i) s[nt][2 * h + e] = FA_NEG_INF;
      }
  }
}

#if FA_FEATURES
// ALiBi in a features build (a plain kernel: raw q . k logits, units
// fa_units(scale)), read once per warp: the slope over the scale, and the
// key position r of the warp's first row. Causal calls see only keys j <=
// pos(i), where the term slope (j - pos(i)) splits into a key part, slope
// (j - r), added per tile (fa_feature_terms), and a row part, slope (r -
// pos(i)), the same on every tile: it is added to the row's maximum once,
// at the end (fa_alibi_rows_end), which puts it in the LSE (the output, a
// ratio, does not see it). r keeps the key part small where the weights
// are large, near the diagonal. Other calls add the whole |pos(i) - j| term.
struct FaAlibiWarp {
  float slope;  // slope / scale; 0 without ALiBi
  int r;
};

__device__ __forceinline__ FaAlibiWarp fa_alibi_warp(const FaParams& p, int b, int n, int w0) {
  const FaAlibiRow a = fa_alibi_row(p, b, n, w0);
  return {a.slope / p.rules.scale, a.pos};
}

// Segment ids and ALiBi (`alibi`, fa_alibi_warp) on the logits of rows row0
// and row0 + 8 over the key tile at n0, after fa_mask_rows. Keys of another
// segment than the row's become -inf, unless `whole` (fa_segment_whole of
// the warp's rows and the tile's keys). Rows >= T and keys >= S, already
// -inf, read the last one's span.
template <int kNs>
__device__ __forceinline__ void fa_feature_terms(const FaParams& p, float (&s)[kNs][4], int b,
                                                 int n, int row0, int n0, int t4, bool whole,
                                                 const FaAlibiWarp& alibi) {
  const FaFeatures& f = p.features;
  if (!whole) {
    const int* q_ids = f.q_spans + static_cast<long long>(b) * p.T * kFaSpan + kFaSpanId;
    const int* kv_ids = f.kv_spans + static_cast<long long>(b) * p.S * kFaSpan + kFaSpanId;
    const int id0 = q_ids[min(row0, p.T - 1) * kFaSpan];
    const int id8 = q_ids[min(row0 + 8, p.T - 1) * kFaSpan];
#pragma unroll
    for (int nt = 0; nt < kNs; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int id = kv_ids[min(n0 + nt * 8 + 2 * t4 + e, p.S - 1) * kFaSpan];
        if (id != id0) s[nt][e] = FA_NEG_INF;
        if (id != id8) s[nt][2 + e] = FA_NEG_INF;
      }
  }
  if (alibi.slope == 0.f) return;
  if (p.rules.causal) {
    // The key part: slope (j - r), one per key, shared by both rows.
    const float base = alibi.slope * static_cast<float>(n0 + 2 * t4 - alibi.r);
#pragma unroll
    for (int nt = 0; nt < kNs; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float key = fmaf(alibi.slope, static_cast<float>(nt * 8 + e), base);
        s[nt][e] += key;
        s[nt][2 + e] += key;
      }
    return;
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const FaAlibiRow a = fa_alibi_row(p, b, n, row0 + h * 8);
    const float d = static_cast<float>(a.pos - n0 - 2 * t4);  // pos - the thread's first key
#pragma unroll
    for (int nt = 0; nt < kNs; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        s[nt][2 * h + e] =
            fmaf(-alibi.slope, fabsf(d - static_cast<float>(nt * 8 + e)), s[nt][2 * h + e]);
  }
}

// A causal call's row part of ALiBi, slope (r - pos(i)) for rows row0 and
// row0 + 8, added to their maxima once the key tiles are done.
__device__ __forceinline__ void fa_alibi_rows_end(const FaParams& p, float (&m)[2], int b,
                                                  int n, int row0, const FaAlibiWarp& alibi) {
  if (alibi.slope == 0.f || !p.rules.causal) return;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int pos = fa_alibi_row(p, b, n, row0 + h * 8).pos;
    m[h] += alibi.slope * static_cast<float>(alibi.r - pos);  // -inf stays -inf
  }
}
#endif

// How fa_softmax_probs computes a tile's weights (one ex2 per logit in all;
// kernel 90 picks one per build, attention_wgmma.cu's kSoftmax):
//   kSubMul  2^((x - m) to_log2), fa_weight: a subtraction and a
//            multiplication, exact where x = m (2^0 = 1), as the backward's
//            P = 2^((x - LSE) log2 e) needs of the forward it follows
//            (design.md). The default (with the fma, kernel 80's H = 128
//            build spills: NVRTC 12.9, sm_80).
//   kFma     2^(x to_log2 - m to_log2), m to_log2 rounded once per row and
//            shared by its weights and rescale: one fma, but the top logit's
//            weight is 2^d, d that rounding (up to 2^-24 |m to_log2|).
//   kLean    kFma with the maximum and the sum in kAcc independent chains,
//            so that a warp has kAcc instructions to issue where one chain
//            would wait out each one's latency, and a stale maximum (below).
enum class FaSoftmax { kSubMul, kFma, kLean };

// The probabilities of one online-softmax step for rows row0 and row0 + 8
// over the key tile at n0: turns the Q K^T accumulators s into probabilities
// (FaSoftmax), updates the row maximum m and partial sum l, and returns in
// alpha the factor the output rows must be rescaled by (fa_rescale_rows),
// and whether they must (false: alpha is 1). Variants without extras
// (FA_EXTRAS 0) keep unscaled logits and maxima, units fa_units(scale);
// those with extras map each visible logit through fa_extras_logit first,
// units fa_units(1) (attention_common.cuh's FaUnits). Params: the kernel's
// parameters (the decode kernel's, which has no extras, too).
template <int kNs, class Params, FaSoftmax kForm = FaSoftmax::kSubMul>
__device__ __forceinline__ bool fa_softmax_probs(const Params& p, float (&s)[kNs][4],
                                                 float (&m)[2], float (&l)[2],
                                                 float (&alpha)[2], int b, int n, int row0,
                                                 int n0, int t4, const FaUnits& u) {
  constexpr bool kLean = kForm == FaSoftmax::kLean;
  constexpr bool kFma = kForm != FaSoftmax::kSubMul;
  constexpr int kAcc = kLean ? 4 : 1;
  float m_new[2] = {m[0], m[1]};  // grown below by the tile's row maxima
  // Row h's weights against its maximum (move) or the reference kept (not).
  auto weights = [&](int h, bool move) {
    const float m_ref = move ? m_new[h] : m[h];
    // A row with nothing visible yet keeps every exponent at -inf: subtract 0
    // rather than -inf so they give 0, not NaN.
    const float m_use = m_ref == FA_NEG_INF ? 0.f : m_ref;
    const float m_log2 = m_use * u.to_log2;
    alpha[h] = kFma ? fa_ex2(m[h] * u.to_log2 - m_log2) : fa_weight(m[h], m_use, u.to_log2);
    m[h] = m_ref;
    float sum[kAcc] = {};
#pragma unroll
    for (int nt = 0; nt < kNs; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float x = s[nt][2 * h + e];
        const float pe =
            kFma ? fa_ex2(fmaf(x, u.to_log2, -m_log2)) : fa_weight(x, m_use, u.to_log2);
        s[nt][2 * h + e] = pe;
        sum[(2 * nt + e) % kAcc] += pe;
      }
    }
    // Per-thread partial sums; the quad reduces once, in fa_write_rows.
#pragma unroll
    for (int a = 1; a < kAcc; a *= 2)
#pragma unroll
      for (int c = 0; c + a < kAcc; c += 2 * a) sum[c] += sum[c + a];
    l[h] = l[h] * alpha[h] + sum[0];
  };
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    [[maybe_unused]] const int i = row0 + h * 8;
#if FA_EXTRAS
    const FaAlibiRow alibi = fa_alibi_row(p, b, n, i);
#endif
    float mx[kAcc];
#pragma unroll
    for (int a = 0; a < kAcc; ++a) mx[a] = FA_NEG_INF;
#pragma unroll
    for (int nt = 0; nt < kNs; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float x = s[nt][2 * h + e];
#if FA_EXTRAS
        // Masked keys stay -inf; bias / mask are read only for visible
        // (i, j), the only ones in bounds.
        if (x != FA_NEG_INF) {
          x = fa_extras_logit(p, x, b, n, i, n0 + nt * 8 + 2 * t4 + e, alibi);
        }
        s[nt][2 * h + e] = x;
#endif
        mx[(2 * nt + e) % kAcc] = fmaxf(mx[(2 * nt + e) % kAcc], x);
      }
    }
    float row_mx = mx[0];
#pragma unroll
    for (int a = 1; a < kAcc; ++a) row_mx = fmaxf(row_mx, mx[a]);
    row_mx = fmaxf(row_mx, __shfl_xor_sync(0xffffffffu, row_mx, 1));
    row_mx = fmaxf(row_mx, __shfl_xor_sync(0xffffffffu, row_mx, 2));
    m_new[h] = fmaxf(m[h], row_mx);
    if (!kLean) weights(h, true);
  }
  if (!kLean) return true;
  // The reference maximum moves only when some row of the warp grew by more
  // than 2^8 (FlashAttention-4's conditional rescaling): weights stay below
  // 256, and the caller skips the output's rescale in most tiles.
  constexpr float kSlack = 8.f;  // log2 of the largest weight
  const bool grew = (m_new[0] - m[0]) * u.to_log2 > kSlack ||
                    (m_new[1] - m[1]) * u.to_log2 > kSlack;
  const bool move = __any_sync(0xffffffffu, grew);
  weights(0, move);
  weights(1, move);
  return move;
}

// Rescales output rows row0 (alpha[0]) and row0 + 8 (alpha[1]).
template <int kNo>
__device__ __forceinline__ void fa_rescale_rows(float (&o)[kNo][4], const float (&alpha)[2]) {
#pragma unroll
  for (int i = 0; i < kNo; ++i) {
    o[i][0] *= alpha[0];
    o[i][1] *= alpha[0];
    o[i][2] *= alpha[1];
    o[i][3] *= alpha[1];
  }
}

// One online-softmax step: fa_softmax_probs, then the rescale.
template <int kNs, int kNo, class Params>
__device__ __forceinline__ void fa_softmax_step(const Params& p, float (&s)[kNs][4],
                                                float (&o)[kNo][4], float (&m)[2],
                                                float (&l)[2], int b, int n, int row0,
                                                int n0, int t4, const FaUnits& u) {
  float alpha[2];
  fa_softmax_probs(p, s, m, l, alpha, b, n, row0, n0, t4, u);
  fa_rescale_rows(o, alpha);
}

// The mma.m16n8k16 A fragment (wgmma's register A has the same layout per
// warp) of P for keys 16 kk .. 16 kk + 15: accumulator n8 blocks 2 kk and
// 2 kk + 1, rounded to FA_DTYPE.
template <int kNs>
__device__ __forceinline__ void fa_pack_a(const float (&s)[kNs][4], int kk, unsigned (&a)[4]) {
  a[0] = fa_pack_in(s[2 * kk][0], s[2 * kk][1]);
  a[1] = fa_pack_in(s[2 * kk][2], s[2 * kk][3]);
  a[2] = fa_pack_in(s[2 * kk + 1][0], s[2 * kk + 1][1]);
  a[3] = fa_pack_in(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}

// Normalizes rows row0 and row0 + 8 of a unit whose first row is m0 (those
// < T) and writes them: unsplit (slot < 0), out and lse of (b, row, n);
// split, the segment's partial state in workspace slot `slot`
// (attention_split.cuh). Rows with no visible key have l == 0 exactly: they
// get 0 and -inf.
template <int kNo>
__device__ __forceinline__ void fa_write_rows(const FaParams& p, const float (&o)[kNo][4],
                                              const float (&m)[2], const float (&l)[2],
                                              int b, int n, int m0, int Br, int row0,
                                              int t4, const FaUnits& u, long long slot) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float lh = l[h];
    lh += __shfl_xor_sync(0xffffffffu, lh, 1);
    lh += __shfl_xor_sync(0xffffffffu, lh, 2);
    const int i = row0 + h * 8;
    float inv = lh == 0.f ? 0.f : 1.f / lh;
    float lse = fa_lse(m[h], lh, u.to_nat);
    if (i >= p.T) continue;
    if (slot < 0) inv *= fa_join_sink(p.features, b, n, &lse);  // split: at the merge
    if (slot >= 0) {
      const long long row = slot * Br + i - m0;
      float* dst = p.split.partial_out + row * p.H;
      if (t4 == 0) p.split.partial_lse[row] = lse;
#pragma unroll
      for (int nt = 0; nt < kNo; ++nt) {
        const int col = nt * 8 + 2 * t4;
        if (col < p.H) {
          dst[col] = o[nt][2 * h] * inv;
          dst[col + 1] = o[nt][2 * h + 1] * inv;
        }
      }
      continue;
    }
    if (t4 == 0) p.lse[fa_at(p.lse_stride, b, i, n)] = lse;
    const long long at = fa_at(p.out_stride, b, i, n);
#pragma unroll
    for (int nt = 0; nt < kNo; ++nt) {
      const int col = nt * 8 + 2 * t4;
      if (col >= p.H) continue;
      const float x0 = o[nt][2 * h] * inv, x1 = o[nt][2 * h + 1] * inv;
#if FA_OUT_DTYPE == FA_F32
      float* out = static_cast<float*>(p.out) + at + col;
      out[0] = x0;
      out[1] = x1;
#else
#if FA_OUT_DTYPE == FA_BF16
      const unsigned v = fa_pack_bf16(x0, x1);
#else
      const unsigned v = fa_pack_f16(x0, x1);
#endif
      *reinterpret_cast<unsigned*>(static_cast<unsigned short*>(p.out) + at + col) = v;
#endif
    }
  }
}
