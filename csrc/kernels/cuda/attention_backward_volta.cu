// Fused attention backward for Volta (kernel 70: mma.m8n8k4, HMMA.884, fp16):
// FlashAttention-2's backward (Dao 2023, Algorithm 2) on the forward's Volta
// operand layouts (FastAttention, Volta part; attention_volta.cu derives
// them), as two kernels with disjoint outputs like attention_backward.cu's:
// every sum has one order, no atomics.
//
//   fa_backward_dkdv  a warp owns 8 kRG keys, each quad pair (QP) 8 of them,
//                     and walks the query rows of the group's heads that
//                     see a key of the block, kBq at a time. Keys are the
//                     rows of S^T = K Q^T and dP^T = V dO^T (.row.col, as
//                     the forward's S = Q K^T); volta_pack_a turns P^T and
//                     dS^T, in registers, into the A operands of dV += P^T dO
//                     and dK += dS^T Q (.row.row, as the forward's P V).
//                     With kRG = 2 (H > 64) QPs q and q + 2 compute the same
//                     S^T and dP^T blocks and split the columns of dK and dV,
//                     which keeps the two at 128 registers.
//   fa_backward_dq    a warp owns 8 kRG query rows: S = Q K^T and dP = dO V^T
//                     as the forward's S, dS packed as P is there, dQ += dS K
//                     (.row.row).
//
// D = rowsum(dO o O) - dLSE comes from the caller; rows that see no key have
// LSE -inf, taken as +inf (P = 0). Tiles are copied synchronously into the
// forward's padded shared-memory rows (load_rows), one step at a time.
#include "attention_grad.cuh"
#include "attention_volta.cuh"

#if FA_KERNEL_SM != 70 || FA_DTYPE != FA_F16
#error "attention_backward_volta.cu: kernel 70, float16 operands only"
#endif

namespace {

constexpr int kThreads = kTile.threads;
constexpr int kWarps = kThreads / 32;
constexpr int kKS = kH / 4;  // k4 steps over H

// fa_backward_dkdv: keys per warp and block, query rows per step.
constexpr int kRGk = fa_volta_backward_key_groups(kH);
constexpr int kHSk = 4 / kRGk;         // column parts of dK and dV
constexpr int kRWk = 8 * kRGk;
constexpr int kBq = kFaVoltaBackwardQueryRows;
constexpr int kNTOk = kH / 8 / kHSk;   // dK and dV n-tiles per lane

// fa_backward_dq: rows per warp and block, keys per step.
constexpr int kRGq = fa_volta_row_groups(kH);
constexpr int kHSq = 4 / kRGq;
constexpr int kRWq = 8 * kRGq;
constexpr int kBcq = fa_volta_backward_dq_keys(kH);
constexpr int kNTOq = kH / 8 / kHSq;

static_assert(kBc == kRWk * kWarps && kBr == kRWq * kWarps, "the tile of attention_tiles.cuh");

// A (kRows, H) block of a (B, L, heads, H) array, rows row0 .. row0 + kRows
// (zeros at or past `valid` rows), into the padded rows at dst.
template <int kRows>
__device__ __forceinline__ void load_tile(uint2* dst, const void* base,
                                          const long long (&stride)[3], int b, int row0,
                                          int head, int valid, int cols, int tid) {
  const unsigned short* src = static_cast<const unsigned short*>(base) + fa_at(stride, b, row0, head);
  for (int i = tid; i < kRows * kH / 8; i += kThreads)
    load_rows<kRows>(dst, src, stride[1], valid - row0, cols, i);
}

// Rows row0 and row0 + 2 of a lane's accumulators (C layout, kTiles n-tiles
// of column part `part` of kParts), times `scale`, into (b, row, head) of a
// (B, L, heads, H) array of FA_OUT_DTYPE (rows >= L skipped).
template <int kParts, int kTiles>
__device__ __forceinline__ void write_rows(void* out, const long long (&stride)[3], int b,
                                           int head, int row0, int rows, int H, int t1, int part,
                                           float scale, const float (&acc)[kTiles][8]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + 2 * r;
    if (row >= rows) continue;
    const long long at = fa_at(stride, b, row, head);
#pragma unroll
    for (int j = 0; j < kTiles; ++j)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int col = volta_col_tile<kParts, kTiles>(j, part) * 8 + 4 * half + 2 * t1;
        if (col >= H) continue;
        fa_store_pair(out, at + col, acc[j][4 * half + 2 * r] * scale,
                      acc[j][4 * half + 2 * r + 1] * scale);
      }
  }
}

// acc[n-tiles] += A (kK columns of packed f16 pairs, two per k4 step) times
// the kK rows of the padded tile b2 (.row.row): a lane reads row 4 kk + t,
// chunk 2 n-tile + h.
template <int kK, int kParts, int kTiles>
__device__ __forceinline__ void accumulate(const unsigned (&a)[kK / 4][2], const uint2* b2,
                                           int t, int h, int part, float (&acc)[kTiles][8]) {
#pragma unroll
  for (int kk = 0; kk < kK / 4; ++kk) {
    const uint2 ak = make_uint2(a[kk][0], a[kk][1]);
#pragma unroll
    for (int j = 0; j < kTiles; ++j)
      mma_rr(acc[j], ak, b2[chunk_at(kk * 4 + t, 2 * volta_col_tile<kParts, kTiles>(j, part) + h)]);
  }
}

// c[kCols / 8 n-tiles] = (8 rows of a2 at a_row, per QP) times (kCols rows of
// b2)^T (.row.col), and likewise d from a2d and b2d: the two products that
// share their rows' loop over H.
template <int kCols>
__device__ __forceinline__ void two_products(const uint2* a2, const uint2* b2, const uint2* a2d,
                                             const uint2* b2d, int a_row, int t, int h,
                                             float (&c)[kCols / 8][8], float (&d)[kCols / 8][8]) {
#pragma unroll
  for (int j = 0; j < kCols / 8; ++j)
#pragma unroll
    for (int e = 0; e < 8; ++e) c[j][e] = d[j][e] = 0.f;
#pragma unroll 4
  for (int ks = 0; ks < kKS; ++ks) {
    const uint2 a = a2[chunk_at(a_row, ks)], ad = a2d[chunk_at(a_row, ks)];
#pragma unroll
    for (int j = 0; j < kCols / 8; ++j) {
      mma_rc(c[j], a, b2[chunk_at(j * 8 + t + 4 * h, ks)]);
      mma_rc(d[j], ad, b2d[chunk_at(j * 8 + t + 4 * h, ks)]);
    }
  }
}

}  // namespace

extern "C" __constant__ int fa_params_bytes = sizeof(FaGradParams);

extern "C" __global__ void __launch_bounds__(kThreads, 1) fa_backward_dkdv(const FaGradParams p) {
  extern __shared__ uint4 smem[];
  uint2* sk2 = reinterpret_cast<uint2*>(smem);
  uint2* sv2 = sk2 + fa_volta_tile_bytes(kBc, kH) / 8;
  uint2* sq2 = sv2 + fa_volta_tile_bytes(kBc, kH) / 8;
  uint2* sdo2 = sq2 + fa_volta_tile_bytes(kBq, kH) / 8;
  float* s_lse = reinterpret_cast<float*>(sdo2 + fa_volta_tile_bytes(kBq, kH) / 8);
  float* s_delta = s_lse + kBq;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int t = lane & 3, t0 = lane & 1, t1 = (lane >> 1) & 1, h = lane >> 4;
  const int qp = (lane >> 2) & 3, rg = qp % kRGk, part = qp / kRGk;
  const FaKeyBlock blk = fa_key_block(p, kBc, blockIdx.x);
  const int b = blk.b, kvh = blk.kvh, j0 = blk.j0, j1 = blk.j1;
  const int q_len = blk.q_len, kv_len = blk.kv_len;

  // This warp's keys, the lane's A row (a key of the block's tile) and C rows
  // (keys, two).
  const int wk0 = j0 + warp * kRWk, wk1 = wk0 + kRWk;
  const int a_row = warp * kRWk + h * 4 * kRGk + rg * 4 + t;
  const int c_key0 = j0 + warp * kRWk + h * 4 * kRGk + rg * 4 + t0;  // and c_key0 + 2

  float dk[kNTOk][8], dv[kNTOk][8];
#pragma unroll
  for (int j = 0; j < kNTOk; ++j)
#pragma unroll
    for (int e = 0; e < 8; ++e) dk[j][e] = dv[j][e] = 0.f;

  int n, i0;
  fa_first_step(p, blk, kBq, n, i0);
  if (n < blk.n_end) {
    load_tile<kBc>(sk2, p.k, p.kv_stride, b, j0, kvh, kv_len, p.H, tid);
    load_tile<kBc>(sv2, p.v, p.kv_stride, b, j0, kvh, kv_len, p.H, tid);
    for (; n < blk.n_end; fa_next_step(p, blk, kBq, n, i0)) {
      int lo, hi;
      fa_rows_keys(p.rules, q_len, kv_len, i0, i0 + kBq, &lo, &hi);
      __syncthreads();  // the previous step is done with Q, dO and the scalars
      load_tile<kBq>(sq2, p.q, p.q_stride, b, i0, n, q_len, p.H, tid);
      load_tile<kBq>(sdo2, p.d_out, p.out_stride, b, i0, n, q_len, p.H, tid);
      for (int r = tid; r < kBq; r += kThreads) {
        const bool live = i0 + r < q_len;
        const long long at = fa_at(p.lse_stride, b, i0 + r, n);
        s_lse[r] = live ? lse_of(p.lse[at]) : __int_as_float(0x7f800000);
        s_delta[r] = live ? p.delta[at] : 0.f;
      }
      __syncthreads();
      if (wk0 >= j1 || hi <= wk0 || lo >= wk1) continue;  // no key of this warp is seen

      float s[kBq / 8][8], dp[kBq / 8][8];
      two_products<kBq>(sk2, sq2, sv2, sdo2, a_row, t, h, s, dp);
      fa_if_whole(fa_all_visible(p.rules, q_len, kv_len, i0, i0 + kBq, wk0, wk1), [&](bool whole) {
#pragma unroll
        for (int j = 0; j < kBq / 8; ++j)
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            const int key = c_key0 + (e & 2), c = j * 8 + (e & 4) + (e & 1) + 2 * t1;
            const bool seen =
                whole || fa_visible(p.rules, q_len, kv_len, i0 + c, key);
            prob_and_ds(p, s[j][e], dp[j][e], seen, b, n, i0 + c, key, s_lse[c], s_delta[c],
                        &s[j][e], &dp[j][e]);
          }
      });
      fa_one_hot_rounding(s, dp, p.H, fa_magnitude_of(p, b, n, [&](int j, int e) {
        return i0 + j * 8 + (e & 4) + (e & 1) + 2 * t1;
      }));
      unsigned pa[kBq / 4][2], da[kBq / 4][2];
#pragma unroll
      for (int j = 0; j < kBq / 8; ++j) {
        volta_pack_a(s[j], t1, pa[2 * j], pa[2 * j + 1]);
        volta_pack_a(dp[j], t1, da[2 * j], da[2 * j + 1]);
      }
      accumulate<kBq, kHSk, kNTOk>(pa, sdo2, t, h, part, dv);
      accumulate<kBq, kHSk, kNTOk>(da, sq2, t, h, part, dk);
    }
  }
  write_rows<kHSk, kNTOk>(p.dk, p.dkv_stride, b, kvh, c_key0, p.S, p.H, t1, part, p.rules.scale,
                          dk);
  write_rows<kHSk, kNTOk>(p.dv, p.dkv_stride, b, kvh, c_key0, p.S, p.H, t1, part, 1.f, dv);
}

extern "C" __global__ void __launch_bounds__(kThreads) fa_backward_dq(const FaGradParams p) {
  extern __shared__ uint4 smem[];
  uint2* sq2 = reinterpret_cast<uint2*>(smem);
  uint2* sdo2 = sq2 + fa_volta_tile_bytes(kBr, kH) / 8;
  uint2* sk2 = sdo2 + fa_volta_tile_bytes(kBr, kH) / 8;
  uint2* sv2 = sk2 + fa_volta_tile_bytes(kBcq, kH) / 8;

  const FaBlock blk = fa_block(p, kBr, kBcq);
  const int b = blk.b, n = blk.n, kvh = blk.kvh, m0 = blk.m0;
  const int q_len = blk.q_len, kv_len = blk.kv_len;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int t = lane & 3, t0 = lane & 1, t1 = (lane >> 1) & 1, h = lane >> 4;
  const int qp = (lane >> 2) & 3, rg = qp % kRGq, part = qp / kRGq;

  // This warp's rows, the lane's A row and C rows (two).
  const int wm0 = m0 + warp * kRWq;
  const int a_row = warp * kRWq + h * 4 * kRGq + rg * 4 + t;
  const int c_row0 = wm0 + h * 4 * kRGq + rg * 4 + t0;  // and c_row0 + 2
  int wlo, whi;
  fa_rows_keys(p.rules, q_len, kv_len, wm0, wm0 + kRWq, &wlo, &whi);
  float lse[2], delta[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = c_row0 + 2 * r;
    const long long at = fa_at(p.lse_stride, b, i, n);
    lse[r] = i < q_len ? lse_of(p.lse[at]) : __int_as_float(0x7f800000);
    delta[r] = i < q_len ? p.delta[at] : 0.f;
  }
  float dq[kNTOq][8];
#pragma unroll
  for (int j = 0; j < kNTOq; ++j)
#pragma unroll
    for (int e = 0; e < 8; ++e) dq[j][e] = 0.f;

  if (blk.t_end > blk.t_begin) {
    load_tile<kBr>(sq2, p.q, p.q_stride, b, m0, n, q_len, p.H, tid);
    load_tile<kBr>(sdo2, p.d_out, p.out_stride, b, m0, n, q_len, p.H, tid);
    for (int tile = blk.t_begin; tile < blk.t_end; ++tile) {
      const int n0 = tile * kBcq;
      __syncthreads();  // the previous tile's K and V are no longer read
      load_tile<kBcq>(sk2, p.k, p.kv_stride, b, n0, kvh, kv_len, p.H, tid);
      load_tile<kBcq>(sv2, p.v, p.kv_stride, b, n0, kvh, kv_len, p.H, tid);
      __syncthreads();
      if (n0 >= whi || n0 + kBcq <= wlo) continue;  // this warp's rows see none of the tile

      float s[kBcq / 8][8], dp[kBcq / 8][8];
      two_products<kBcq>(sq2, sk2, sdo2, sv2, a_row, t, h, s, dp);
      fa_if_whole(fa_all_visible(p.rules, q_len, kv_len, wm0, wm0 + kRWq, n0, n0 + kBcq),
                  [&](bool whole) {
#pragma unroll
        for (int j = 0; j < kBcq / 8; ++j)
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            const int r = (e >> 1) & 1, i = c_row0 + 2 * r;
            const int key = n0 + j * 8 + (e & 4) + (e & 1) + 2 * t1;
            const bool seen = whole || fa_visible(p.rules, q_len, kv_len, i, key);
            prob_and_ds(p, s[j][e], dp[j][e], seen, b, n, i, key, lse[r], delta[r], &s[j][e],
                        &dp[j][e]);
          }
      });
      fa_one_hot_rounding(s, dp, p.H, fa_magnitude_of(p, b, n, [&](int, int e) {
        return c_row0 + 2 * ((e >> 1) & 1);
      }));
      unsigned da[kBcq / 4][2];
#pragma unroll
      for (int j = 0; j < kBcq / 8; ++j) volta_pack_a(dp[j], t1, da[2 * j], da[2 * j + 1]);
      accumulate<kBcq, kHSq, kNTOq>(da, sk2, t, h, part, dq);
    }
  }
  write_rows<kHSq, kNTOq>(p.dq, p.out_stride, b, n, c_row0, p.T, p.H, t1, part, p.rules.scale,
                          dq);
}
