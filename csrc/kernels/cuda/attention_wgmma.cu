// Fused forward attention on Hopper's warpgroup tensor cores: kernel 90
// (wgmma.mma_async, sm_90a), fp16/bf16, kernel head dims multiples of 64.
//
// The kernel is persistent, as FlashAttention-3's (Shah et al., 2024): its
// grid is at most one wave (PlanLaunch, csrc/cuda/variants.cc) and each
// block walks the work blocks fa_persistent_index gives it (fa_block_at:
// Br = 128 query rows of one (batch, head) and a split of their key tiles),
// so the next one's Q and first K and V tiles load while this one's last
// products, softmax and stores run. A block is warp specialized: a producer
// warpgroup loads Q, then K and V tile by tile, into a ring of kStages
// shared-memory stages with the tensor memory accelerator (TMA,
// cp.async.bulk.tensor), and two consumer warpgroups of 64 rows compute.
// mbarriers link them: the producer's loads complete a stage's "full"
// barrier, each consumer warp arrives on its "empty" one once its wgmma has
// read it (Q's once the work block's last S = Q K^T is done). The ring's
// stages and phases run on across work blocks. The producer gives most of
// its registers to the consumers (setmaxnreg).
//
// TMA zero-fills rows past T and S and columns past H, but keys in [kv_len,
// S) hold whatever the caller left there (NaN included), and P V must see
// zeros for them: the one tile that crosses kv_len is copied with cp.async,
// which zero-fills by row.
//
// Per key tile of Bc keys, a consumer warpgroup computes S = Q K^T with
// wgmma reading Q and K from shared memory, runs the online softmax on the
// accumulators in float32 (the accumulator layout of m64nN is that of
// mma.m16n8 per warp: attention_m16n8.cuh), and issues O += P V with P
// straight from registers and V from shared memory. The products of one tile
// are issued together with those of the next, so that the softmax of tile j
// runs while the tensor cores compute P(j-1) V(j-1).
//
// Shared memory: every tile (Q, K, V) is stored as H / 64 panels of 128-byte
// rows (64 elements), 16-byte chunks XOR-swizzled by row % 8: the 128-byte
// swizzle that TMA writes and wgmma reads; a panel is one TMA box. Q and K
// are K-major operands; V, the B operand of P V, is N-major (H contiguous)
// and read with the transpose flag.
#include "attention_merge.cuh"
#include "attention_wgmma.cuh"

namespace {

constexpr int kWG = 2;                     // warpgroups of 64 rows
constexpr int kThreads = kTile.threads;    // (kWG + 1) * 128: + the producer warpgroup
// Registers per thread after setmaxnreg, all the 168 * 384 of the launch:
// 128 * 40 + 256 * 232 (the producer spills in 32 with NVRTC 13).
constexpr int kProducerRegs = 40, kConsumerRegs = 232;
constexpr int kStages = fa_wgmma_stages(kH, FA_EXTRAS);
constexpr int kQBytes = kBr * kH * 2;
constexpr int kKVBytes = kBc * kH * 2;
constexpr int kNs = kBc / 8;  // n8 blocks of S
constexpr int kNo = kH / 8;   // n8 blocks of O
static_assert(kThreads == (kWG + 1) * 128 && kBr == kWG * 64, "tile");
// fa_softmax_probs's weights by fma (3-7% faster at H = 64), and the lean
// softmax at H = 128 without extras (faster there, slower at H = 64; with
// extras its registers would spill: H100, docs/performance.md); but the
// exact form in the float32-out builds, which serve the VJP's forward (whose
// P the backward recomputes from the LSE) and float32 callers.
constexpr FaSoftmax kSoftmax = FA_OUT_DTYPE == FA_F32    ? FaSoftmax::kSubMul
                               : !FA_EXTRAS && kH == 128 ? FaSoftmax::kLean
                                                         : FaSoftmax::kFma;

// The producer's cp.async copy of a tile into its swizzled panels (the tile
// that crosses kv_len): 16-byte chunks, chunk c of the tile to thread
// c % 128; rows past rows_valid become zeros. Not unrolled: the producer runs
// on few registers (the backward's load_tile, which keeps a chunk column and
// steps rows, spills here).
template <int ROWS>
__device__ __forceinline__ void tile_async(unsigned dst, const FaTileSrc& s,
                                           int tid) {
#pragma unroll 1
  for (int c = tid; c < ROWS * kChunks; c += kLoaders) {
    const int r = c / kChunks, ch = c % kChunks;
    const bool ok = r < s.rows_valid && ch * 8 < s.cols;
    const unsigned short* src = s.base + (ok ? r * (int)s.ld + ch * 8 : 0);
    fa_cp_async16(dst + swz(ROWS, r, ch), src, ok);
  }
}

// TMA load of the box at coordinates (c0, c1, c2, c3) of `map` (innermost
// first) into dst; its bytes complete the transaction count of `bar`.
__device__ __forceinline__ void tma_load_4d(unsigned dst, const FaTensorMap& map, int c0, int c1,
                                            int c2, int c3, unsigned bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];" ::"r"(dst),
      "l"(reinterpret_cast<unsigned long long>(&map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
      "r"(bar)
      : "memory");
}

// TMA load of ROWS rows from `row` of head `head`, batch b: one box per
// 64-column panel.
template <int ROWS>
__device__ __forceinline__ void tile_tma(unsigned dst, const FaTensorMap& map, int head, int row,
                                         int b, unsigned bar) {
#pragma unroll
  for (int c = 0; c < kH / 64; ++c) {
    tma_load_4d(dst + c * ROWS * 128, map, c * 64, head, row, b, bar);
  }
}

}  // namespace

extern "C" __constant__ int fa_params_bytes = sizeof(FaParams);

extern "C" __global__ void __launch_bounds__(kThreads, 1)
    fa_forward(const FaParams p, const __grid_constant__ FaTmaMaps maps) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wg = warp >> 2;
  const int g = lane >> 2, t4 = lane & 3;

  // The work blocks (every unit's splits) and this block's share of them.
  const int num_m = (p.T + kBr - 1) / kBr;
  const int work = static_cast<int>(fa_forward_units(p, kBr)) * p.split.parts;
  auto next = [&](int k) {
    return fa_persistent_index(p.rules.causal, num_m, work, gridDim.x, blockIdx.x, k);
  };

  const unsigned sbase = (fa_smem_u32(smem) + 1023) & ~1023u;
  const unsigned sq = sbase;
  auto sk = [&](int st) { return sbase + kQBytes + st * 2 * kKVBytes; };
  auto sv = [&](int st) { return sk(st) + kKVBytes; };
  const unsigned bars = sbase + kQBytes + kStages * 2 * kKVBytes;
  const unsigned q_full = bars;
  const unsigned q_empty = bars + 8 + 4 * kStages * 8;
  auto k_full = [&](int st) { return bars + 8 + st * 8; };
  auto v_full = [&](int st) { return bars + 8 + (kStages + st) * 8; };
  auto k_empty = [&](int st) { return bars + 8 + (2 * kStages + st) * 8; };
  auto v_empty = [&](int st) { return bars + 8 + (3 * kStages + st) * 8; };
  if (tid == 0) {
    mbar_init(q_full, 1);
    mbar_init(q_empty, kWG * 4);
    for (int st = 0; st < kStages; ++st) {
      mbar_init(k_full(st), kLoaders);
      mbar_init(v_full(st), kLoaders);
      mbar_init(k_empty(st), kWG * 4);
      mbar_init(v_empty(st), kWG * 4);
    }
  }
  __syncthreads();

  if (wg == kWG) {
    // Producer warpgroup: per work block, Q once the consumers have released
    // the last one, then K and V tile by tile into the stages they have
    // released. The block's u-th tile in all uses stage u % kStages for the
    // (u / kStages)-th time; a first use waits for nothing.
    set_max_regs_dec<kProducerRegs>();
    const int ltid = tid - kWG * 128;
    const bool lead = ltid == 0;  // issues the TMA loads
    // A K or V tile into a stage: TMA when all its keys are below kv_len;
    // else cp.async by every producer thread. The full barrier counts one
    // arrival per producer thread either way.
    auto load_kv = [&](unsigned dst, const FaTensorMap& map, const void* src, int b, int kvh,
                       int kv_len, int j0, unsigned full) {
      if (j0 + kBc <= kv_len) {
        if (lead) {
          mbar_arrive_expect_tx(full, kKVBytes);
          tile_tma<kBc>(dst, map, kvh, j0, b, full);
        } else {
          mbar_arrive(full);
        }
      } else {
        tile_async<kBc>(dst, FaTileSrc{static_cast<const unsigned short*>(src) +
                                           fa_at(p.kv_stride, b, j0, kvh),
                                       p.kv_stride[1], kv_len - j0, p.H},
                        ltid);
        mbar_arrive_cp_async(full);
      }
    };
    int u = 0, qu = 0;  // tiles and Q tiles loaded
    for (int k = 0, i; (i = next(k)) < work; ++k) {
      if (i < 0) continue;
      const FaBlock blk = fa_block_at(p, kBr, kBc, i);
      if (blk.t_end <= blk.t_begin) continue;
      if (lead) {
        mbar_wait(q_empty, (qu & 1) ^ 1);
        mbar_arrive_expect_tx(q_full, kQBytes);
        tile_tma<kBr>(sq, maps.q, blk.n, blk.m0, blk.b, q_full);
      }
      ++qu;
      for (int tile = blk.t_begin; tile < blk.t_end; ++tile, ++u) {
        const int st = u % kStages, ph = (u / kStages) & 1;
        mbar_wait(k_empty(st), ph ^ 1);
        load_kv(sk(st), maps.k, p.k, blk.b, blk.kvh, blk.kv_len, tile * kBc, k_full(st));
        mbar_wait(v_empty(st), ph ^ 1);
        load_kv(sv(st), maps.v, p.v, blk.b, blk.kvh, blk.kv_len, tile * kBc, v_full(st));
      }
    }
    return;
  }

  set_max_regs_inc<kConsumerRegs>();
  const FaUnits units = fa_units(FA_EXTRAS ? 1.f : p.rules.scale);  // FaUnits
  float o[kNo][4];
  float row_m[2], row_l[2];
  float s[kNs][4];
  unsigned pa[kBc / 16][4];  // P of the previous tile, as wgmma A fragments
  float alpha[2];
  // S = Q K^T for a tile: H / 16 k-steps; a k-step is 32 bytes into a
  // 128-byte row, every fourth one starts the next panel.
  const unsigned long long qd = desc(sq + wg * 64 * 128, 16, 1024);
  auto issue_s = [&](int st) {
    const unsigned long long kd = desc(sk(st), 16, 1024);
#pragma unroll
    for (int kk = 0; kk < kH / 16; ++kk) {
      wgmma_ss<kBc>(&s[0][0], desc_at(qd, (kk >> 2) * kBr * 128 + (kk & 3) * 32),
                    desc_at(kd, (kk >> 2) * kBc * 128 + (kk & 3) * 32), kk > 0);
    }
    wg_commit();
  };
  // O += P V for the tile whose P is in pa.
  auto issue_pv = [&](int st) {
    // N-major: LBO steps between 64-column panels, SBO between 8-key atoms.
    const unsigned long long vd = desc(sv(st), kBc * 128, 1024);
#pragma unroll
    for (int kk = 0; kk < kBc / 16; ++kk) wgmma_rs<kH>(&o[0][0], pa[kk], desc_at(vd, kk * 2048));
    wg_commit();
  };
  auto pack = [&]() {
#pragma unroll
    for (int kk = 0; kk < kBc / 16; ++kk) fa_pack_a(s, kk, pa[kk]);
  };

  int u = 0, qu = 0;  // tiles and Q tiles consumed, as the producer counts them
  for (int k = 0, i; (i = next(k)) < work; ++k) {
    if (i < 0) continue;
    const FaBlock blk = fa_block_at(p, kBr, kBc, i);
    const int b = blk.b, n = blk.n, q_len = blk.q_len, kv_len = blk.kv_len;
    // This warp's 16 rows decide the elementwise mask.
    const int w0 = blk.m0 + wg * 64 + (warp & 3) * 16, w1 = w0 + 16;
#pragma unroll
    for (int c = 0; c < kNo; ++c) o[c][0] = o[c][1] = o[c][2] = o[c][3] = 0.f;
    row_m[0] = row_m[1] = FA_NEG_INF;
    row_l[0] = row_l[1] = 0.f;
#if FA_FEATURES
    const FaAlibiWarp alibi = fa_alibi_warp(p, b, n, w0);
#endif
    // The softmax of S: probabilities in s, the rescale factors in alpha;
    // whether the output needs them.
    auto probs = [&](int tile) {
      const int n0 = tile * kBc;
      if (!fa_all_visible(p.rules, q_len, kv_len, w0, w1, n0, n0 + kBc))
        fa_mask_rows(p.rules, s, w0 + g, n0, q_len, kv_len, t4);
#if FA_FEATURES
      fa_feature_terms(p, s, b, n, w0 + g, n0, t4,
                       fa_segment_whole(p.features, p.T, p.S, b, w0, w1, n0, n0 + kBc), alibi);
#endif
      return fa_softmax_probs<kNs, FaParams, kSoftmax>(p, s, row_m, row_l, alpha, b, n, w0 + g,
                                                       n0, t4, units);
    };

    if (blk.t_end > blk.t_begin) {
      // Software pipeline: while the tensor cores run O += P(j-1) V(j-1), the
      // softmax of S(j) runs on the CUDA cores.
      mbar_acquire(q_full, qu & 1);
      ++qu;
      for (int tile = blk.t_begin; tile < blk.t_end; ++tile, ++u) {
        const bool first = tile == blk.t_begin;
        const int st = u % kStages, ph = (u / kStages) & 1;
        const int pu = first ? 0 : u - 1, pst = pu % kStages, pph = (pu / kStages) & 1;
        mbar_acquire(k_full(st), ph);
        if (!first) mbar_acquire(v_full(pst), pph);
        reg_fence<kNo * 4>(&o[0][0]);
        wg_fence();
        issue_s(st);
        if (!first) issue_pv(pst);
        if (!first) wg_wait<1>(); else wg_wait<0>();
        reg_fence<kNs * 4>(&s[0][0]);
        mbar_release_warp(k_empty(st), lane);
        if (tile == blk.t_end - 1) mbar_release_warp(q_empty, lane);
        const bool rescale = probs(tile);
        wg_wait<0>();
        reg_fence<kNo * 4>(&o[0][0]);
        if (!first) mbar_release_warp(v_empty(pst), lane);
        if (rescale) fa_rescale_rows(o, alpha);
        pack();
      }
      // The last tile's P V; its stage goes back for the next work block.
      const int last = u - 1;
      mbar_acquire(v_full(last % kStages), (last / kStages) & 1);
      reg_fence<kNo * 4>(&o[0][0]);
      wg_fence();
      issue_pv(last % kStages);
      wg_wait<0>();
      reg_fence<kNo * 4>(&o[0][0]);
      mbar_release_warp(v_empty(last % kStages), lane);
    }
    // The work block, recomputed rather than kept live across the loop.
    const FaBlock end = fa_block_at(p, kBr, kBc, i);
    const int row0 = end.m0 + wg * 64 + (warp & 3) * 16 + g;
#if FA_FEATURES
    fa_alibi_rows_end(p, row_m, end.b, end.n, row0, alibi);
#endif
    fa_write_rows(p, o, row_m, row_l, end.b, end.n, end.m0, kBr, row0, t4, units,
                  fa_forward_slot(p, end));
  }
}
