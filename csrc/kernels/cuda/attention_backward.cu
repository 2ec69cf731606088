// Fused attention backward on 16-bit tensor cores, kernel 80 (mma.m16n8k16,
// fp16/bf16, cp.async) and kernel 75 (fp16, each k16 step as two
// mma.m16n8k8, loads through registers; attention_m16n8.cuh): FlashAttention-2's backward (Dao 2023, Algorithm 2)
// as two kernels that write disjoint outputs, so every sum has one order
// (deterministic, no atomics):
//
//   fa_backward_dkdv  a block owns Bc = 64 keys of one (batch, key/value
//                     head), 16 per warp, and walks every query row of the
//                     G heads that read it which sees one of them, kBq rows
//                     at a time. Keys are the rows of its products:
//                       S^T  = K Q^T        (A: K rows, B: Q rows)
//                       P^T  = e^(S^T scale - LSE)
//                       dP^T = V dO^T       (A: V rows, B: dO rows)
//                       dS^T = P^T (dP^T - D)
//                       dV  += P^T dO       (A: P^T from the accumulators)
//                       dK  += dS^T Q       (A: dS^T from the accumulators)
//                     so P^T and dS^T feed the next products from registers
//                     (fa_pack_a), as P does P V in the forward.
//   fa_backward_dq    a block owns Br = 64 query rows of one (batch, head),
//                     16 per warp, and walks the key tiles they see
//                     (fa_backward_dq_keys at a time):
//                       S = Q K^T, P, dP = dO V^T, dS = P (dP - D),
//                       dQ += dS K          (A: dS from the accumulators)
//                     S and dP are computed twice (once per kernel): 7
//                     products of 2 H flops per pair instead of 5, the price
//                     of no atomics.
//
// D = rowsum(dO o O) - dLSE comes precomputed (B, T, N) float32 from the
// caller (an XLA reduction over out and d_out). Rows that see no key have
// LSE -inf, taken as +inf: P = 0. FA_EXTRAS variants apply the bias, mask
// and soft cap per pair (prob_and_ds), the others the index rules alone.
// Shared-memory rows are padded by 16 bytes as in attention_mma16.cu.
#include "attention_grad.cuh"
#include "attention_m16n8.cuh"

#if FA_KERNEL_SM != 75 && FA_KERNEL_SM != 80
#error "attention_backward.cu is built as kernel 75 or 80"
#endif
#if FA_KERNEL_SM == 75 && FA_DTYPE != FA_F16
#error "kernel 75 is float16 only"
#endif

namespace {

constexpr int kH = FA_HEAD_DIM;
constexpr int kRowBytes = kH * 2 + 16;
constexpr int kChunks = kH / 8;
constexpr int kThreads = kTile.threads;
// kBr: fa_backward_dq's rows per block; kBc: fa_backward_dkdv's keys per block.
constexpr int kBcq = fa_backward_dq_keys(FA_KERNEL_SM, kH);  // fa_backward_dq: keys per step
constexpr int kBq = fa_backward_query_rows(FA_KERNEL_SM, kH);  // fa_backward_dkdv: rows per step
constexpr int kStages = fa_backward_stages(FA_KERNEL_SM, kH);  // query steps in flight
constexpr int kKs = kH / 16;                     // k16 steps over H
constexpr int kNo = kH / 8;                      // n8 tiles over H
constexpr int kParts = fa_backward_parts(FA_KERNEL_SM, kH);  // column parts of dK, dV
constexpr int kNoP = kNo / kParts;               // a part's n8 tiles
static_assert(kNoP % 2 == 0, "a part's columns in pairs of n8 tiles (ldmatrix x4)");

// ROWS rows of a tile into shared memory at dst (smem: the block's base):
// by cp.async on kernel 80, landed after loads_commit and loads_wait; through
// registers on kernel 75, landed on return, 16 rows at a time (8 registers a
// lane at H = 128: a whole 32-row step of Q took 16 and made
// fa_backward_dkdv spill beside dK and dV).
template <int ROWS>
__device__ __forceinline__ void tile_load(unsigned char* smem, unsigned dst, const FaTileSrc& s,
                                          int tid) {
#if FA_KERNEL_SM == 80
  fa_tile_async<ROWS, kChunks, kRowBytes, kThreads>(dst, s, tid);
#else
  constexpr int kPiece = 16;
  static_assert(ROWS % kPiece == 0, "tiles of whole 16-row pieces");
  unsigned char* base = smem + (dst - fa_smem_u32(smem));
#pragma unroll 1
  for (int r0 = 0; r0 < ROWS; r0 += kPiece) {
    FaTileRegs<kPiece, kChunks, kRowBytes, kThreads> r;
    r.load(FaTileSrc{s.base + r0 * s.ld, s.ld, s.rows_valid - r0, s.cols}, tid);
    r.store(base + r0 * kRowBytes, tid);
  }
#endif
}
__device__ __forceinline__ void loads_commit() {
#if FA_KERNEL_SM == 80
  fa_cp_async_commit();
#endif
}
__device__ __forceinline__ void loads_wait() {
#if FA_KERNEL_SM == 80
  fa_cp_async_wait<0>();
#endif
}
// All but the last committed group landed (kernel 80).
__device__ __forceinline__ void loads_wait_all_but_one() {
#if FA_KERNEL_SM == 80
  fa_cp_async_wait<1>();
#endif
}

// Per-lane ldmatrix offsets (attention_mma16.cu): rows as the A operand, rows
// as the non-transposed B operand (two n8 tiles per x4), rows as the
// transposed B operand (k = rows).
__device__ __forceinline__ unsigned a_offset(int row0, int lane) {
  return (row0 + (lane & 15)) * kRowBytes + (lane >> 4) * 16;
}
__device__ __forceinline__ unsigned b_offset(int lane) {
  return ((lane & 7) + ((lane >> 4) << 3)) * kRowBytes + ((lane >> 3) & 1) * 16;
}
__device__ __forceinline__ unsigned bt_offset(int lane) {
  return (lane & 15) * kRowBytes + (lane >> 4) * 16;
}

// c[n8 tiles of kCols columns] = A (16 rows at a_base) B^T (kCols rows at
// b_base), both row-major over H.
template <int kCols>
__device__ __forceinline__ void rows_times_rows(unsigned a_base, unsigned b_base, int lane,
                                                float (&c)[kCols / 8][4]) {
#pragma unroll
  for (int i = 0; i < kCols / 8; ++i) c[i][0] = c[i][1] = c[i][2] = c[i][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < kKs; ++kk) {
    unsigned a[4];
    fa_ldsm_x4(a_base + kk * 32, a);
#pragma unroll
    for (int np = 0; np < kCols / 16; ++np) {
      unsigned b[4];
      fa_ldsm_x4(b_base + b_offset(lane) + np * 16 * kRowBytes + kk * 32, b);
      fa_mma16(c[2 * np], a, b[0], b[1]);
      fa_mma16(c[2 * np + 1], a, b[2], b[3]);
    }
  }
}

// acc[kN n8 tiles] += pack(c) (16 x kK, the accumulators of rows_times_rows
// as the A operand) times the kK rows at b_base (from its first column).
template <int kK, int kN>
__device__ __forceinline__ void accumulate(const float (&c)[kK / 8][4], unsigned b_base, int lane,
                                           float (&acc)[kN][4]) {
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    unsigned a[4];
    fa_pack_a(c, kk, a);
#pragma unroll
    for (int np = 0; np < kN / 2; ++np) {
      unsigned b[4];
      fa_ldsm_x4_t(b_base + bt_offset(lane) + kk * 16 * kRowBytes + np * 32, b);
      fa_mma16(acc[2 * np], a, b[0], b[1]);
      fa_mma16(acc[2 * np + 1], a, b[2], b[3]);
    }
  }
}


}  // namespace

extern "C" __constant__ int fa_params_bytes = sizeof(FaGradParams);

extern "C" __global__ void __launch_bounds__(kThreads, 1)
    fa_backward_dkdv(const FaGradParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  // Column part `part` of dK and dV (fa_backward_parts), from column col0.
  const int part = blockIdx.x % kParts, col0 = part * kNoP * 8;
  const FaKeyBlock blk = fa_key_block(p, kBc, blockIdx.x / kParts);
  const int b = blk.b, kvh = blk.kvh, j0 = blk.j0, q_len = blk.q_len, kv_len = blk.kv_len;

  const unsigned sk = fa_smem_u32(smem), sv = sk + kBc * kRowBytes;
  // Stage st of the query steps: Q and dO rows, then (after both stages) the
  // rows' LSE (lse_of) and D.
  auto sq = [&](int st) { return sv + kBc * kRowBytes + st * 2 * kBq * kRowBytes; };
  auto sdo = [&](int st) { return sq(st) + kBq * kRowBytes; };
  float* s_lse = reinterpret_cast<float*>(smem + (2 * kBc + 2 * kStages * kBq) * kRowBytes);
  float* s_delta = s_lse + kStages * kBq;

  float dk[kNoP][4], dv[kNoP][4];
#pragma unroll
  for (int i = 0; i < kNoP; ++i) {
    dk[i][0] = dk[i][1] = dk[i][2] = dk[i][3] = 0.f;
    dv[i][0] = dv[i][1] = dv[i][2] = dv[i][3] = 0.f;
  }
  // This warp's keys: j0 + 16 warp + g and + 8.
  const int wk0 = j0 + 16 * warp, wk1 = wk0 + 16;
  const int n_end = blk.n_end;
  auto advance = [&](int& n, int& i0) { fa_next_step(p, blk, kBq, n, i0); };
  // Q and dO of a step into stage st, by cp.async (kernel 80) or through
  // registers (75); its LSE and D into registers, stored once the stage is
  // free (rows past the length: P = 0, D = 0).
  float next_lse = 0.f, next_delta = 0.f;
  auto load_step = [&](int st, int n, int i0) {
    tile_load<kBq>(smem, sq(st), FaTileSrc{static_cast<const unsigned short*>(p.q) +
                                               fa_at(p.q_stride, b, i0, n),
                                           p.q_stride[1], q_len - i0, p.H}, tid);
    tile_load<kBq>(smem, sdo(st), FaTileSrc{static_cast<const unsigned short*>(p.d_out) +
                                                fa_at(p.out_stride, b, i0, n),
                                            p.out_stride[1], q_len - i0, p.H}, tid);
    loads_commit();
    if (tid < kBq) {
      const bool live = i0 + tid < q_len;
      const long long at = fa_at(p.lse_stride, b, i0 + tid, n);
      next_lse = live ? lse_of(p.lse[at]) : __int_as_float(0x7f800000);
      next_delta = live ? p.delta[at] : 0.f;
    }
  };
  auto store_scalars = [&](int st) {
    if (tid < kBq) {
      s_lse[st * kBq + tid] = next_lse;
      s_delta[st * kBq + tid] = next_delta;
    }
  };
  static_assert(kBq <= kThreads, "a thread per row of a query step");

  int n, i0;
  fa_first_step(p, blk, kBq, n, i0);
  if (n < n_end) {
    const long long kv_at = fa_at(p.kv_stride, b, j0, kvh);
    tile_load<kBc>(smem, sk, FaTileSrc{static_cast<const unsigned short*>(p.k) + kv_at,
                                       p.kv_stride[1], kv_len - j0, p.H}, tid);
    tile_load<kBc>(smem, sv, FaTileSrc{static_cast<const unsigned short*>(p.v) + kv_at,
                                       p.kv_stride[1], kv_len - j0, p.H}, tid);
    load_step(0, n, i0);
    store_scalars(0);
  }
  // Two stages (kernel 80, H <= 64): step k + 1's loads fly while step k computes.
  // One (75): they follow step k.
  for (int st = 0; n < n_end; st = (st + 1) % kStages) {
    int nn = n, ni = i0;
    advance(nn, ni);
    const bool more = nn < n_end;
    if (kStages == 2 && more) {
      load_step(st ^ 1, nn, ni);
      loads_wait_all_but_one();
    } else {
      loads_wait();
    }
    __syncthreads();  // stage st (and, at first, K and V) landed for every warp
    if (wk0 < blk.j1) {
      int lo, hi;
      fa_rows_keys(p.rules, q_len, kv_len, i0, i0 + kBq, &lo, &hi);
      fa_segment_keys(p.features, p.T, blk.b, i0, i0 + kBq, &lo, &hi);
      if (hi > wk0 && lo < wk1) {  // a key of this warp is seen
        float s[kBq / 8][4], dp[kBq / 8][4];
        rows_times_rows<kBq>(sk + a_offset(16 * warp, lane), sq(st), lane, s);
        rows_times_rows<kBq>(sv + a_offset(16 * warp, lane), sdo(st), lane, dp);
        const float* lse = s_lse + st * kBq;
        const float* delta = s_delta + st * kBq;
        fa_if_whole(fa_all_visible(p.rules, q_len, kv_len, i0, i0 + kBq, wk0, wk1), [&](bool whole) {
#pragma unroll
          for (int nt = 0; nt < kBq / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int c = nt * 8 + 2 * t4 + e;  // query row i0 + c
#pragma unroll
              for (int h = 0; h < 2; ++h) {
                const int j = wk0 + g + 8 * h;
                const bool seen =
                    whole || fa_visible(p.rules, q_len, kv_len, i0 + c, j);
                prob_and_ds(p, s[nt][2 * h + e], dp[nt][2 * h + e], seen, b, n, i0 + c, j,
                            lse[c], delta[c], &s[nt][2 * h + e], &dp[nt][2 * h + e]);
              }
            }
        });
        fa_one_hot_rounding(s, dp, p.H, fa_magnitude_of(p, b, n, [&](int nt, int x) {
          return i0 + nt * 8 + 2 * t4 + (x & 1);
        }));
        accumulate<kBq>(s, sdo(st) + col0 * 2, lane, dv);
        accumulate<kBq>(dp, sq(st) + col0 * 2, lane, dk);
      }
    }
    __syncthreads();  // stage st is read: free for step k + 2 (k + 1 with one stage)
    if (more) {
      if (kStages == 1) load_step(0, nn, ni);
      store_scalars((st + 1) % kStages);
    }
    n = nn;
    i0 = ni;
  }
  fa_write_grad_rows(p.dk, p.dkv_stride, b, kvh, wk0 + g, col0, p.S, p.H, t4, p.rules.scale, dk);
  fa_write_grad_rows(p.dv, p.dkv_stride, b, kvh, wk0 + g, col0, p.S, p.H, t4, 1.f, dv);
}

extern "C" __global__ void __launch_bounds__(kThreads, 1)
    fa_backward_dq(const FaGradParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const FaBlock blk = fa_block(p, kBr, kBcq);
  const int b = blk.b, n = blk.n, kvh = blk.kvh, m0 = blk.m0;
  const int q_len = blk.q_len, kv_len = blk.kv_len;

  // Q and dO, then kStages stages of a K and a V tile.
  const unsigned sq = fa_smem_u32(smem), sdo = sq + kBr * kRowBytes;
  auto sk = [&](int st) { return sdo + kBr * kRowBytes + st * 2 * kBcq * kRowBytes; };
  auto sv = [&](int st) { return sk(st) + kBcq * kRowBytes; };
  auto load_kv = [&](int st, int tile) {
    const int n0 = tile * kBcq;
    const long long kv_at = fa_at(p.kv_stride, b, n0, kvh);
    tile_load<kBcq>(smem, sk(st), FaTileSrc{static_cast<const unsigned short*>(p.k) + kv_at,
                                            p.kv_stride[1], kv_len - n0, p.H}, tid);
    tile_load<kBcq>(smem, sv(st), FaTileSrc{static_cast<const unsigned short*>(p.v) + kv_at,
                                            p.kv_stride[1], kv_len - n0, p.H}, tid);
    loads_commit();
  };

  const int w0 = m0 + 16 * warp, w1 = w0 + 16;
  int wlo, whi;
  fa_rows_keys(p.rules, q_len, kv_len, w0, w1, &wlo, &whi);
  float lse[2], delta[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int i = w0 + g + 8 * h;
    const long long at = fa_at(p.lse_stride, b, i, n);
    lse[h] = i < q_len ? lse_of(p.lse[at]) : __int_as_float(0x7f800000);
    delta[h] = i < q_len ? p.delta[at] : 0.f;
  }
  float dq[kNo][4];
#pragma unroll
  for (int i = 0; i < kNo; ++i) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.f;

  // dQ += dS K over one tile of keys n0 .. n0 + kBcq in stage st.
  auto compute_tile = [&](int st, int n0) {
    float s[kBcq / 8][4], dp[kBcq / 8][4];
    rows_times_rows<kBcq>(sq + a_offset(16 * warp, lane), sk(st), lane, s);
    rows_times_rows<kBcq>(sdo + a_offset(16 * warp, lane), sv(st), lane, dp);
    fa_if_whole(fa_all_visible(p.rules, q_len, kv_len, w0, w1, n0, n0 + kBcq), [&](bool whole) {
#pragma unroll
      for (int nt = 0; nt < kBcq / 8; ++nt)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int i = w0 + g + 8 * h, j = n0 + nt * 8 + 2 * t4 + e;
            const bool seen = whole || fa_visible(p.rules, q_len, kv_len, i, j);
            prob_and_ds(p, s[nt][2 * h + e], dp[nt][2 * h + e], seen, b, n, i, j, lse[h],
                        delta[h], &s[nt][2 * h + e], &dp[nt][2 * h + e]);
          }
    });
    fa_one_hot_rounding(s, dp, p.H, fa_magnitude_of(p, b, n, [&](int, int x) {
      return w0 + g + 8 * (x >> 1);
    }));
    accumulate<kBcq>(dp, sk(st), lane, dq);
  };

  if (blk.t_end > blk.t_begin) {
    tile_load<kBr>(smem, sq, FaTileSrc{static_cast<const unsigned short*>(p.q) +
                                      fa_at(p.q_stride, b, m0, n),
                                  p.q_stride[1], q_len - m0, p.H}, tid);
    tile_load<kBr>(smem, sdo, FaTileSrc{static_cast<const unsigned short*>(p.d_out) +
                                       fa_at(p.out_stride, b, m0, n),
                                   p.out_stride[1], q_len - m0, p.H}, tid);
    load_kv(0, blk.t_begin);
    // Two stages (kernel 80, H <= 64): tile k + 1's K and V fly while tile k computes.
    for (int tile = blk.t_begin, st = 0; tile < blk.t_end; ++tile, st = (st + 1) % kStages) {
      const int n0 = tile * kBcq;
      const bool more = tile + 1 < blk.t_end;
      if (kStages == 2 && more) {
        load_kv(st ^ 1, tile + 1);
        loads_wait_all_but_one();
      } else {
        loads_wait();
      }
      __syncthreads();  // stage st (and, at first, Q and dO) landed for every warp
      if (n0 < whi && n0 + kBcq > wlo) compute_tile(st, n0);  // this warp's rows see the tile
      __syncthreads();  // stage st is read: free for tile k + 2 (k + 1 with one stage)
      if (kStages == 1 && more) load_kv(0, tile + 1);
    }
  }
  fa_write_grad_rows(p.dq, p.out_stride, b, n, w0 + g, 0, p.T, p.H, t4, p.rules.scale, dq);
}
