// Fused forward attention on 16-bit tensor cores: kernel 80 (mma.m16n8k16,
// fp16/bf16, cp.async pipeline) and kernel 75 (fp16, each k16 step issued as
// two mma.m16n8k8, global loads staged through registers).
//
// Each block owns Br query rows of one (batch, head) and walks the key tiles
// [lo, hi) that the tiling-mask says it can see, Bc keys at a time. Each warp
// owns 16 * kMt of the rows: S = Q K^T lands in mma accumulators, the online
// softmax runs on them in float32 (one ex2 per logit, FaUnits), and
// they are repacked in registers as the A operand of P V. Only tiles that
// straddle a causal / window / length edge pay for per-element masking.
//
// Shared memory rows are padded by 16 bytes: a row of H 16-bit values is then
// an odd number of 16-byte chunks apart from the next, so the 8 row addresses
// of an ldmatrix hit 8 distinct bank groups for every H that is a multiple
// of 16. An XOR swizzle (chunk c of row j at c ^ (j % 8)) would do the same
// without padding where H is a multiple of 64; the decode kernel switched to
// it because padded rows straddle 128-byte lines and made the L2 serve its
// cp.async sectors 1.5 times (attention_decode.cu, above kRowChunks). Not
// measured here.
#include "attention_merge.cuh"
#include "attention_m16n8.cuh"

#if FA_KERNEL_SM != 75 && FA_KERNEL_SM != 80
#error "attention_mma16.cu serves kernels 75 and 80"
#endif
#if FA_KERNEL_SM == 75 && FA_DTYPE != FA_F16
#error "kernel 75 is float16 only"
#endif

namespace {

constexpr int kH = FA_HEAD_DIM;
constexpr int kRowBytes = kH * 2 + 16;  // padded smem row
constexpr int kChunks = kH / 8;         // 16-byte chunks per row

// Tile shape (attention_tiles.cuh; kTile, kBr and kBc: attention_common.cuh).
// Up to H=128, two m-tiles per warp halve the K/V shared-memory reads per
// flop (each B fragment feeds two mma): with one, ldmatrix bandwidth, not the
// tensor cores, is the limit (bf16 on an H100 at S=16384: kernel 80 went from
// 212 to 286 TFLOP/s at H=64 and from 275 to 307 at H=128; kernel 75 from 147
// to 192 at H=128). The accumulators of two m-tiles leave no registers for Q
// fragments, which are reloaded from shared memory at every k-step, nor for
// kernel 75's prefetched tile.
constexpr int kThreads = kTile.threads;
constexpr int kMt = fa_mma16_m_tiles(kH);
constexpr int kKs = kH / 16;   // k16 steps of Q K^T
constexpr int kNs = kBc / 8;   // n8 tiles of S
constexpr int kNo = kH / 8;    // n8 tiles of O


#if FA_KERNEL_SM == 80
template <int ROWS>
__device__ __forceinline__ void tile_async(unsigned dst, const FaTileSrc& s, int tid) {
  fa_tile_async<ROWS, kChunks, kRowBytes, kThreads>(dst, s, tid);
}
#endif

// Global -> registers -> shared, for the path without cp.async.
template <int ROWS>
using TileRegs = FaTileRegs<ROWS, kChunks, kRowBytes, kThreads>;

}  // namespace

extern "C" __constant__ int fa_params_bytes = sizeof(FaParams);

extern "C" __global__ void __launch_bounds__(kThreads, 1)
    fa_forward(const FaParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;

  const FaBlock blk = fa_block(p, kBr, kBc);
  const int b = blk.b, n = blk.n, kvh = blk.kvh, m0 = blk.m0;
  const int q_len = blk.q_len, kv_len = blk.kv_len;

  // This warp's rows: tiles it cannot see at all are skipped, tiles it sees
  // whole skip the elementwise mask.
  const int w0 = m0 + warp * 16 * kMt, w1 = w0 + 16 * kMt;
  int wlo, whi;
  fa_rows_keys(p.rules, q_len, kv_len, w0, w1, &wlo, &whi);
  fa_segment_keys(p.features, p.T, b, w0, w1, &wlo, &whi);
  const int t_begin = blk.t_begin, t_end = blk.t_end;

  // K / V tile sources, their bases recomputed from the parameters each time
  // rather than held in registers across the loop.
  auto kv_src = [&](const void* kv, int tile) {
    const int j0 = tile * kBc;
    return FaTileSrc{static_cast<const unsigned short*>(kv) + fa_at(p.kv_stride, b, j0, kvh),
                     p.kv_stride[1], kv_len - j0, p.H};
  };

  const unsigned sbase = fa_smem_u32(smem);
  const unsigned sq = sbase;
  auto sk = [&](int st) { return sbase + (kBr + st * 2 * kBc) * kRowBytes; };
  auto sv = [&](int st) { return sk(st) + kBc * kRowBytes; };

  // Per-lane ldmatrix offsets (see the mma fragment layouts): Q as A
  // (row = lane % 16, col half = lane / 16), K as B non-transposed (key =
  // lane % 8 + 8 * (lane / 16), col half = (lane / 8) % 2), V as B transposed
  // (key = lane % 16, col half = lane / 16).
  const unsigned q_off =
      (warp * 16 * kMt + (lane & 15)) * kRowBytes + (lane >> 4) * 16;
  const unsigned k_off =
      ((lane & 7) + ((lane >> 4) << 3)) * kRowBytes + ((lane >> 3) & 1) * 16;
  const unsigned v_off = (lane & 15) * kRowBytes + (lane >> 4) * 16;

  float o[kMt][kNo][4];
  float row_m[kMt][2], row_l[kMt][2];
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt) {
#pragma unroll
    for (int i = 0; i < kNo; ++i)
      o[mt][i][0] = o[mt][i][1] = o[mt][i][2] = o[mt][i][3] = 0.f;
    row_m[mt][0] = row_m[mt][1] = FA_NEG_INF;
    row_l[mt][0] = row_l[mt][1] = 0.f;
  }
  // Variants without extras keep raw Q K^T logits and their row maxima
  // (scale > 0, so the maxima commute with scaling); those with extras map
  // every logit to its natural value first (FaUnits).
  const FaUnits units = fa_units(FA_EXTRAS ? 1.f : p.rules.scale);

  if (t_end > t_begin) {
    const FaTileSrc qsrc{static_cast<const unsigned short*>(p.q) + fa_at(p.q_stride, b, m0, n),
                         p.q_stride[1], p.T - m0, p.H};
#if FA_KERNEL_SM == 80
    tile_async<kBr>(sq, qsrc, tid);
    tile_async<kBc>(sk(0), kv_src(p.k, t_begin), tid);
    tile_async<kBc>(sv(0), kv_src(p.v, t_begin), tid);
    fa_cp_async_commit();
#else
    {
      TileRegs<kBr> rq;
      rq.load(qsrc, tid);
      rq.store(smem, tid);
      TileRegs<kBc> rk;
      rk.load(kv_src(p.k, t_begin), tid);
      rk.store(smem + (sk(0) - sbase), tid);
      rk.load(kv_src(p.v, t_begin), tid);
      rk.store(smem + (sv(0) - sbase), tid);
    }
    __syncthreads();
#endif

    for (int tile = t_begin; tile < t_end; ++tile) {
      const int n0 = tile * kBc;
      const bool has_next = tile + 1 < t_end;
#if FA_KERNEL_SM == 80
      const int st = (tile - t_begin) & 1;
      if (has_next) {
        tile_async<kBc>(sk(st ^ 1), kv_src(p.k, tile + 1), tid);
        tile_async<kBc>(sv(st ^ 1), kv_src(p.v, tile + 1), tid);
        fa_cp_async_commit();
        fa_cp_async_wait<1>();
      } else {
        fa_cp_async_wait<0>();
      }
      __syncthreads();
#else
      const int st = 0;
      // Path 75 has no cp.async: the next tile's K and V come through
      // registers and land in shared memory once every warp is done with the
      // current ones. Their loads go as early as registers allow, so that
      // math hides their latency: with one m-tile per warp, both before this
      // tile's math; with two, K's between the products and V's before P V
      // in plain variants up to H=64 (+15% on an H100), after it otherwise
      // (it would spill).
      constexpr bool kPrefetch = kMt == 1 && kH <= 192;
      constexpr bool kEarlyV = kPrefetch || (kH <= 64 && !FA_EXTRAS);
      TileRegs<kBc> nk;
      if (kPrefetch && has_next) nk.load(kv_src(p.k, tile + 1), tid);
#endif
      const bool warp_sees = n0 < whi && n0 + kBc > wlo;
      float s[kMt][kNs][4];
      if (warp_sees) {
        // S = Q K^T
#pragma unroll
        for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
          for (int i = 0; i < kNs; ++i)
            s[mt][i][0] = s[mt][i][1] = s[mt][i][2] = s[mt][i][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < kKs; ++kk) {
          unsigned a[kMt][4];
#pragma unroll
          for (int mt = 0; mt < kMt; ++mt)
            fa_ldsm_x4(sq + q_off + mt * 16 * kRowBytes + kk * 32, a[mt]);
#pragma unroll
          for (int np = 0; np < kNs / 2; ++np) {
            unsigned bk[4];
            fa_ldsm_x4(sk(st) + k_off + np * 16 * kRowBytes + kk * 32, bk);
#pragma unroll
            for (int mt = 0; mt < kMt; ++mt) {
              fa_mma16(s[mt][2 * np], a[mt], bk[0], bk[1]);
              fa_mma16(s[mt][2 * np + 1], a[mt], bk[2], bk[3]);
            }
          }
        }

        // The online softmax. Boundary tiles mask in a separate pass so that
        // whole tiles pay nothing for it.
        if (!fa_all_visible(p.rules, q_len, kv_len, w0, w1, n0, n0 + kBc)) {
#pragma unroll
          for (int mt = 0; mt < kMt; ++mt)
            fa_mask_rows(p.rules, s[mt], w0 + mt * 16 + g, n0, q_len, kv_len, t4);
        }
#pragma unroll
        for (int mt = 0; mt < kMt; ++mt)
          fa_softmax_step(p, s[mt], o[mt], row_m[mt], row_l[mt], b, n, w0 + mt * 16 + g, n0,
                          t4, units);
      }

#if FA_KERNEL_SM == 75
      __syncthreads();  // every warp is done with K
      TileRegs<kBc> nv;
      if (has_next) {
        if (!kPrefetch) nk.load(kv_src(p.k, tile + 1), tid);
        nk.store(smem + (sk(0) - sbase), tid);
        if (kEarlyV) nv.load(kv_src(p.v, tile + 1), tid);
      }
#endif

      if (warp_sees) {
        // O += P V, P straight from the S accumulators.
#pragma unroll
        for (int kk = 0; kk < kBc / 16; ++kk) {
          unsigned pa[kMt][4];
#pragma unroll
          for (int mt = 0; mt < kMt; ++mt) fa_pack_a(s[mt], kk, pa[mt]);
#pragma unroll
          for (int np = 0; np < kNo / 2; ++np) {
            unsigned bv[4];
            fa_ldsm_x4_t(sv(st) + v_off + kk * 16 * kRowBytes + np * 32, bv);
#pragma unroll
            for (int mt = 0; mt < kMt; ++mt) {
              fa_mma16(o[mt][2 * np], pa[mt], bv[0], bv[1]);
              fa_mma16(o[mt][2 * np + 1], pa[mt], bv[2], bv[3]);
            }
          }
        }
      }
      __syncthreads();  // the buffers of this tile are free again
#if FA_KERNEL_SM == 75
      // Visible to the P V of the next tile after its first barrier.
      if (has_next) {
        if (!kEarlyV) nv.load(kv_src(p.v, tile + 1), tid);
        nv.store(smem + (sv(0) - sbase), tid);
      }
#endif
    }
  }

  // The block's unit, recomputed rather than kept live across the loop.
  const FaBlock end = fa_block(p, kBr, kBc);
  const long long slot = fa_forward_slot(p, end);
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt)
    fa_write_rows(p, o[mt], row_m[mt], row_l[mt], end.b, end.n, end.m0, kBr, w0 + mt * 16 + g,
                  t4, units, slot);
}
