// Fused attention forward for Volta (sm_70): FastAttention, "Extend
// FlashAttention2 to NPUs and Low-resource GPUs", section 4 (two-level tiling,
// tiling-mask) and its Volta part (operand layout for mma.m8n8k4). Runs
// unchanged on sm_75..sm_90, where m8n8k4 is emulated (correct but slow).
//
// Tiling. A CTA of kWarps warps owns Br = kBr query rows of one (b, n) and
// walks the key tiles of Bc = kBc keys that fa_rows_keys allows (first level:
// the CTA shares each K/V tile through shared memory). Each warp owns a slice
// of Bb = kRW rows and keeps its own online-softmax state in float32 registers
// (second level); a warp skips the tiles outside its own key range and masks
// elementwise only on tiles that fa_all_visible rejects.
//
// mma.m8n8k4 (HMMA.884). A warp runs four independent 8x8x4 products, one
// per quad pair QP q = lanes {4q..4q+3} (low quad, h = 0) and {4q+16..4q+19}
// (high quad, h = 1). With t = lane & 3 = (t1 t0) in bits, per quad pair:
//   A .row   lane holds row t + 4h, k = 0..3
//   B .col   lane holds col t + 4h, k = 0..3
//   B .row   lane holds row k = t, cols 4h + 0..3
//   C .f32   lane holds rows {t0, t0 + 2} + 4h x cols {0, 1, 4, 5} + 2 t1
// S = Q K^T uses .row.col (Q rows and K rows are both read as 8-byte runs of
// a shared-memory row); O += P V uses .row.row (V rows, likewise).
//
// S accumulators -> P operand, in registers. In the f32 C layout, lane bit 0
// selects a row and lane bit 1 a column; in any f16 operand layout both bits
// select the same dimension. So no permutation of keys or rows alone makes a
// lane's S elements the P elements it supplies (lanes t and t^2 share their two
// rows in C but need distinct rows as A). Half the elements have to cross the
// bit-1 partner once, which we do with one warp shuffle per f16x2 register:
// for S block (8 rows x keys 0..7), lane t keeps row t0 + 2 t1 (its A row) and
//   t1 = 0: keeps row t0   keys {0,1},{4,5}; sends row t0+2 keys {0,1},{4,5}
//   t1 = 1: keeps row t0+2 keys {2,3},{6,7}; sends row t0   keys {2,3},{6,7}
// after which it holds its A row for keys 0..3 and 4..7 in natural order: two
// P V k-steps per S n-tile, no key permutation, no trip through shared memory,
// 2 SHFL per 8x8 block of S, which took H / 4 mma to compute. The O
// accumulator (C layout again) then holds rows {t0, t0 + 2}, the same rows as
// the lane's S, so the rescale by
// exp(m_old - m_new) uses the lane's own row maxima. Row max and row sum are
// reduced over the bit-1 partner only (a QP covers all keys of its rows).
//
// Rows of a QP. QP q's mma row m maps to warp row (m >> 2) * 4 kRG + 4 r + (m
// & 3), where r = q % kRG is its row group: each half-warp then reads the
// A operand from 4 kRG consecutive rows (below: needed for bank-conflict-free
// LDS.64). For H > 128, kRG = 2: QPs q and q + 2 compute the same S block
// (duplicated QK^T work) and split the O columns, so O stays at 128 registers.
//
// Shared memory. Rows of Q, K, V are H / 4 chunks of 8 bytes plus one chunk
// of padding: row r starts at chunk r * kS, kS = H / 4 + 1 odd. A warp's
// 8-byte fragment loads run as two half-warps of 16 lanes, and each half-warp
// reads one chunk column of 16 (Q), 4 (K, V) or 2 x 4 (V, kRG = 2, columns 8 or
// 20 or 28 chunks apart) consecutive rows: an odd stride puts those on distinct
// bank pairs. The padding keeps every fragment address a per-lane base plus an
// immediate (an XOR swizzle would not). Tile copies store each 16-byte global
// load as two 8-byte halves, grouped per half-warp as item_rc describes.
#include "attention_merge.cuh"
#include "attention_volta.cuh"

#if FA_KERNEL_SM != 70 || FA_DTYPE != FA_F16
#error "attention_volta.cu: kernel 70, float16 operands only"
#endif

namespace {

constexpr int kThreads = kTile.threads;
constexpr int kWarps = kThreads / 32;
constexpr int kRG = fa_volta_row_groups(kH);  // row groups (of 8 rows) per warp
constexpr int kHS = 4 / kRG;           // column parts of O per row group
constexpr int kRW = 8 * kRG;           // Bb: rows per warp
static_assert(kBr == kRW * kWarps, "the tile of attention_tiles.cuh");
// kBc (attention_tiles.cuh: fa_volta_Bc): 64 keys halve the barriers per key
// while O is small; 32 keep H = 128 at 128 + 32 + 16 registers, and 16 keep
// H >= 224 (O at 128 again) out of spills.
constexpr int kNTS = kBc / 8;          // S n-tiles
constexpr int kKS = kH / 4;            // QK^T k-steps
constexpr int kKK = kBc / 4;           // PV k-steps
constexpr int kNTO = kH / 8 / kHS;     // O n-tiles per lane
constexpr int kChunksKV = kBc * kH / 8;  // 16-byte chunks of a K or V tile
constexpr int kLoadsKV = (kChunksKV + kThreads - 1) / kThreads;
constexpr int kSmemQ = fa_volta_tile_bytes(kBr, kH);
constexpr int kSmemKV = fa_volta_tile_bytes(kBc, kH);
// V100 gives 96 KB of shared memory to an SM: where Q, K and V would keep a
// second CTA out (H = 128, 192), V reuses K's buffer for one more barrier.
constexpr bool kOneKV = fa_volta_one_kv(kH);

// O n-tile (8 columns) of a lane's j-th accumulator; `part` is its column part.
__device__ __forceinline__ int o_tile(int j, int part) { return volta_col_tile<kHS, kNTO>(j, part); }

// S accumulators -> kept logits (FaUnits: raw q.k without extras, natural
// logits with them). Element e of n-tile j is (row
// row0 + (e & 2), key key0 + 8 j + (e & 4) + (e & 1)). Only tiles that
// fa_all_visible rejects (kMasked) test the index rules, and there hidden
// elements are set to -inf, not computed: a NaN key stays out of the rows that
// cannot see it, and bias / mask are never read out of range.
template <bool kMasked>
__device__ __forceinline__ void to_logits(float (&s)[kNTS][8], const FaParams& p,
                                          int b, int n, int q_len, int kv_len,
                                          int row0, int key0) {
#if FA_EXTRAS
  const FaAlibiRow alibi[2] = {fa_alibi_row(p, b, n, row0), fa_alibi_row(p, b, n, row0 + 2)};
#endif
#pragma unroll
  for (int j = 0; j < kNTS; ++j)
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int i = row0 + (e & 2), key = key0 + j * 8 + (e & 4) + (e & 1);
      const bool vis = !kMasked || fa_visible(p.rules, q_len, kv_len, i, key);
#if FA_EXTRAS
      s[j][e] = vis ? fa_extras_logit(p, s[j][e], b, n, i, key, alibi[(e & 2) >> 1]) : FA_NEG_INF;
#else
      if (!vis) s[j][e] = FA_NEG_INF;
#endif
    }
}

}  // namespace

extern "C" __constant__ int fa_params_bytes = sizeof(FaParams);

extern "C" __global__ void __launch_bounds__(kThreads) fa_forward(const FaParams p) {
  extern __shared__ uint4 smem[];
  uint2* sq2 = reinterpret_cast<uint2*>(smem);
  uint2* sk2 = sq2 + kSmemQ / 8;
  uint2* sv2 = kOneKV ? sk2 : sk2 + kSmemKV / 8;

  const FaBlock blk = fa_block(p, kBr, kBc);
  const int b = blk.b, n = blk.n, kvh = blk.kvh, m0 = blk.m0;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int t = lane & 3, t0 = lane & 1, t1 = (lane >> 1) & 1, h = lane >> 4;
  const int qp = (lane >> 2) & 3, rg = qp % kRG, part = qp / kRG;

  const int q_len = blk.q_len, kv_len = blk.kv_len;
  const long long kv_stride = p.kv_stride[1];
  const unsigned short* qg = static_cast<const unsigned short*>(p.q) + fa_at(p.q_stride, b, m0, n);
  const unsigned short* kg = static_cast<const unsigned short*>(p.k) + fa_at(p.kv_stride, b, 0, kvh);
  const unsigned short* vg = static_cast<const unsigned short*>(p.v) + fa_at(p.kv_stride, b, 0, kvh);

  // Warp rows and this lane's rows: A row, and C rows (two).
  const int wm0 = m0 + warp * kRW;
  const int a_row = warp * kRW + h * 4 * kRG + rg * 4 + t;
  const int c_row0 = wm0 + h * 4 * kRG + rg * 4 + t0;  // and c_row0 + 2

  int wlo, whi;
  fa_rows_keys(p.rules, q_len, kv_len, wm0, wm0 + kRW, &wlo, &whi);

  for (int i = tid; i < kBr * kH / 8; i += kThreads)
    load_rows<kBr>(sq2, qg, p.q_stride[1], min(kBr, p.T - m0), p.H, i);

  float o[kNTO][8];
#pragma unroll
  for (int j = 0; j < kNTO; ++j)
#pragma unroll
    for (int e = 0; e < 8; ++e) o[j][e] = 0.f;
  float m_run[2] = {FA_NEG_INF, FA_NEG_INF}, l_run[2] = {0.f, 0.f};
  const FaUnits units = fa_units(FA_EXTRAS ? 1.f : p.rules.scale);

  const int t_begin = blk.t_begin, t_end = blk.t_end;
  const int n_begin = t_begin * kBc, n_end = t_end * kBc;
  uint4 pre[kLoadsKV];
  auto fetch = [&](const unsigned short* g, int n0) {
#pragma unroll
    for (int i = 0; i < kLoadsKV; ++i) {
      const int idx = tid + i * kThreads;
      int r, j;
      item_rc<kBc>(idx, r, j);
      pre[i] = make_uint4(0, 0, 0, 0);
      if ((kChunksKV % kThreads == 0 || idx < kChunksKV) && n0 + r < kv_len && j * 8 < p.H)
        pre[i] = *reinterpret_cast<const uint4*>(g + (long long)(n0 + r) * kv_stride + j * 8);
    }
  };
  auto stash = [&](uint2* dst) {
#pragma unroll
    for (int i = 0; i < kLoadsKV; ++i) {
      const int idx = tid + i * kThreads;
      int r, j;
      item_rc<kBc>(idx, r, j);
      if (kChunksKV % kThreads == 0 || idx < kChunksKV) put16(dst, r, j, pre[i]);
    }
  };

  if (n_begin < n_end) {
    fetch(kg, n_begin);
    stash(sk2);
  }
  __syncthreads();

  for (int n0 = n_begin; n0 < n_end; n0 += kBc) {
    fetch(vg, n0);  // V of this tile lands while QK^T runs
    const bool active = n0 < whi && n0 + kBc > wlo;
    unsigned pa[kKK][2];
    if (active) {
      float s[kNTS][8];
#pragma unroll
      for (int j = 0; j < kNTS; ++j)
#pragma unroll
        for (int e = 0; e < 8; ++e) s[j][e] = 0.f;
#pragma unroll
      for (int ks = 0; ks < kKS; ++ks) {
        uint2 a = sq2[chunk_at(a_row, ks)];
#pragma unroll
        for (int j = 0; j < kNTS; ++j) mma_rc(s[j], a, sk2[chunk_at(j * 8 + t + 4 * h, ks)]);
      }

      if (fa_all_visible(p.rules, q_len, kv_len, wm0, wm0 + kRW, n0, n0 + kBc))
        to_logits<false>(s, p, b, n, q_len, kv_len, c_row0, n0 + 2 * t1);
      else
        to_logits<true>(s, p, b, n, q_len, kv_len, c_row0, n0 + 2 * t1);

      float mx[2] = {m_run[0], m_run[1]};
#pragma unroll
      for (int j = 0; j < kNTS; ++j)
#pragma unroll
        for (int e = 0; e < 8; ++e) mx[(e >> 1) & 1] = fmaxf(mx[(e >> 1) & 1], s[j][e]);
      float base[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], shfl_xor2f(mx[r]));
        base[r] = mx[r] == FA_NEG_INF ? 0.f : mx[r];  // no (-inf) - (-inf)
        const float alpha = fa_weight(m_run[r], base[r], units.to_log2);
        m_run[r] = mx[r];
        l_run[r] *= alpha;
#pragma unroll
        for (int j = 0; j < kNTO; ++j) {
          o[j][2 * r] *= alpha;
          o[j][2 * r + 1] *= alpha;
          o[j][2 * r + 4] *= alpha;
          o[j][2 * r + 5] *= alpha;
        }
      }
      // P = e^(x - m) (fa_weight), rounded to f16 pairs, then the bit-1 exchange above
      // (volta_pack_a).
#pragma unroll
      for (int j = 0; j < kNTS; ++j) {
        float e_[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          e_[e] = fa_weight(s[j][e], base[(e >> 1) & 1], units.to_log2);
          l_run[(e >> 1) & 1] += e_[e];
        }
        volta_pack_a(e_, t1, pa[2 * j], pa[2 * j + 1]);
      }
    }

    __syncthreads();  // QK^T has read K; last tile's P V has read V
    stash(sv2);
    const bool more = n0 + kBc < n_end;
    if (more) fetch(kg, n0 + kBc);  // lands while P V runs
    __syncthreads();

    if (active) {
#pragma unroll
      for (int kk = 0; kk < kKK; ++kk) {
        const uint2 a = make_uint2(pa[kk][0], pa[kk][1]);
#pragma unroll
        for (int j = 0; j < kNTO; ++j) {
          mma_rr(o[j], a, sv2[chunk_at(kk * 4 + t, 2 * o_tile(j, part) + h)]);
        }
      }
    }
    if (more) {
      if (kOneKV) __syncthreads();  // P V has read the buffer K goes to
      stash(sk2);
      __syncthreads();
    }
  }

  // Epilogue: the row sums are split over the bit-1 partner. The block's unit
  // is recomputed rather than kept live across the loop.
  const FaBlock end = fa_block(p, kBr, kBc);
  const long long slot = fa_forward_slot(p, end);
  float inv[2], lse[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float l = l_run[r] + shfl_xor2f(l_run[r]);
    inv[r] = l == 0.f ? 0.f : 1.f / l;
    lse[r] = fa_lse(m_run[r], l, units.to_nat);
    // The sinks join unsplit rows here, split ones at the merge.
    if (slot < 0) inv[r] *= fa_join_sink(p.features, end.b, end.n, &lse[r]);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = c_row0 + 2 * r;
    if (i >= p.T) continue;
    const bool lse_lane = t1 == 0 && part == 0;
    if (slot >= 0) {
      const long long row = slot * kBr + i - end.m0;
      if (lse_lane) p.split.partial_lse[row] = lse[r];
      float* orow = p.split.partial_out + row * p.H;
#pragma unroll
      for (int j = 0; j < kNTO; ++j) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int col = o_tile(j, part) * 8 + 4 * half + 2 * t1;
          if (col < p.H) {
            orow[col] = o[j][4 * half + 2 * r] * inv[r];
            orow[col + 1] = o[j][4 * half + 2 * r + 1] * inv[r];
          }
        }
      }
      continue;
    }
    if (lse_lane) p.lse[fa_at(p.lse_stride, end.b, i, end.n)] = lse[r];
    char* orow = static_cast<char*>(p.out) +
                 fa_at(p.out_stride, end.b, i, end.n) * (FA_OUT_DTYPE == FA_F32 ? 4 : 2);
#pragma unroll
    for (int j = 0; j < kNTO; ++j) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int col = o_tile(j, part) * 8 + 4 * half + 2 * t1;
        if (col >= p.H) continue;
        const float v0 = o[j][4 * half + 2 * r] * inv[r], v1 = o[j][4 * half + 2 * r + 1] * inv[r];
#if FA_OUT_DTYPE == FA_F32
        *reinterpret_cast<float2*>(orow + col * 4) = make_float2(v0, v1);
#elif FA_OUT_DTYPE == FA_BF16
        *reinterpret_cast<unsigned*>(orow + col * 2) = fa_pack_bf16(v0, v1);
#else
        *reinterpret_cast<unsigned*>(orow + col * 2) = fa_pack_f16(v0, v1);
#endif
      }
    }
  }
}
