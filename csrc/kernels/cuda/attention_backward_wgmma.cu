// Fused attention backward on Hopper's warpgroup tensor cores, kernel 90
// (wgmma.mma_async, sm_90a), fp16/bf16, kernel head dims 64 and 128:
// FlashAttention-2's backward (Dao 2023, Algorithm 2) as the two kernels of
// attention_backward.cu (disjoint outputs, every sum in one order), each
// shaped like the forward of attention_wgmma.cu: a producer warpgroup fills
// kStages shared-memory stages (cp.async, which zero-fills rows past a
// length and columns past H), two consumer warpgroups of 64 rows compute, and
// mbarriers link them.
//
//   fa_backward_dkdv  a block owns Bc = 128 keys of one (batch, key/value
//                     head), 64 per consumer warpgroup, with K and V
//                     resident, and walks the steps of kStep query rows of
//                     the G heads that see one of its keys. Keys are the
//                     rows (wgmma's M) of
//                       S^T  = K Q^T, dP^T = V dO^T      (A and B from shared memory)
//                       P^T  = e^(S^T scale - LSE), dS^T = P^T (dP^T - D)
//                       dV  += P^T dO, dK += dS^T Q      (A from registers, B
//                                                         N-major: transposed)
//                     as S = Q K^T and O += P V are in the forward, so P^T
//                     and dS^T feed the next products from registers.
//                     With FA_ATOMIC_DQ (the default build; FlashAttention-2's
//                     choice) it also adds each step's
//                       dQ += dS K                        (both from shared memory)
//                     into a float32 dQ by bulk reductions (add_dq): both warpgroups store
//                     their dS^T rows (keys by the step's queries), from
//                     which dK += dS^T Q takes its A operand instead, and at
//                     the start of the next step, once both stored theirs
//                     (an mbarrier), each multiplies all 128 keys into its
//                     share of dQ (with 64-row steps half of dQ's columns,
//                     with 128-row steps its 64 of the rows).
//
// kStep (fa_wgmma_backward_step): 128 rows up to H = 64, else 64.
//   fa_backward_dq    (the deterministic build) a block owns Br = 128 query
//                     rows of one (batch, head), 64 per consumer warpgroup,
//                     with Q, dO, LSE and D resident, and walks the tiles of
//                     kStep keys they see:
//                       S = Q K^T, dP = dO V^T, dS = P (dP - D), dQ += dS K.
//
// D = rowsum(dO o O) - dLSE comes precomputed from the caller. Rows that see
// no key, and rows past the query length, have LSE +inf: P = 0.
#include "attention_grad.cuh"
#include "attention_wgmma.cuh"

namespace {

constexpr int kWG = 2;                   // consumer warpgroups of 64 rows
constexpr int kThreads = kTile.threads;  // + the producer warpgroup
constexpr int kProducerRegs = 24, kConsumerRegs = 240;
// kBr: fa_backward_dq's query rows per block; kBc: fa_backward_dkdv's keys per block.
constexpr int kStep = fa_wgmma_backward_step(kH);
constexpr int kStages = kFaWgmmaBackwardStages;
constexpr int kBlockBytes = 128 * kH * 2;  // a resident tile of 128 rows
constexpr int kStepBytes = kStep * kH * 2;
constexpr int kNs = kStep / 8;  // n8 blocks of S^T, dP^T (dK/dV) or S, dP (dQ)
constexpr int kNo = kH / 8;     // n8 blocks of a gradient row
static_assert(kThreads == (kWG + 1) * 128 && kBr == kWG * 64 && kBc == kWG * 64, "tile");
static_assert(kH == 64 || kH == 128, "the backward kernels take kernel head dims 64 and 128");
constexpr int kDsBytes = kBc * kStep * 2;  // one step's dS^T: kBc rows of kStep queries
constexpr int kDsBuffers = kFaWgmmaBackwardDsBuffers;
// Atomic dQ's staging in shared memory (both builds lay it out).
constexpr int kDqPitch = fa_wgmma_backward_dq_pitch(kH);  // floats
constexpr int kDqStageBytes = fa_wgmma_backward_dq_stage_bytes(kH);
static_assert(kStep == 64 || kStep == 128, "dS^T rows of one or two 128-byte panels");

// A tile of ROWS rows of a (B, L, heads, H) array, from row `row` of `head`
// (rows at or past `valid` and columns past H load as zeros), into its
// swizzled panels at dst, by cp.async. Every tile of the backward comes this
// way, so unlike the forward's tile_async (one tile per work block) a
// producer thread keeps one 16-byte chunk column and steps kLoaders / kChunks
// rows a pass, with 32-bit offsets: no division or 64-bit product per chunk.
template <int ROWS>
__device__ __forceinline__ void load_tile(unsigned dst, const void* base,
                                          const long long (&stride)[3], int b, int row,
                                          int head, int valid, int H, int ltid) {
  constexpr int kRowStep = kLoaders / kChunks;
  static_assert(kLoaders % kChunks == 0 && ROWS % kRowStep == 0, "whole passes of the loaders");
  const unsigned short* src = static_cast<const unsigned short*>(base) + fa_at(stride, b, row, head);
  const int ch = ltid % kChunks, ld = static_cast<int>(stride[1]), rows = valid - row;
  const bool col_ok = ch * 8 < H;
  int at = (ltid / kChunks) * ld + ch * 8;  // elements past src
#pragma unroll 1
  for (int r = ltid / kChunks; r < ROWS; r += kRowStep, at += kRowStep * ld) {
    const bool ok = col_ok && r < rows;
    fa_cp_async16(dst + swz(ROWS, r, ch), src + (ok ? at : 0), ok);
  }
}

// ROWS rows' LSE (lse_of: +inf past the query length), D and
// rowsum(|dO o O|), from query row `row` of head n, into lse[0..ROWS),
// lse[ROWS..2 ROWS) and lse[2 ROWS..3 ROWS).
template <int ROWS>
__device__ __forceinline__ void load_scalars(float* lse, const FaGradParams& p, int b, int n,
                                             int row, int q_len, int ltid) {
  static_assert(ROWS <= kLoaders, "a producer thread per row");
  if (ltid < ROWS) {
    const bool live = row + ltid < q_len;
    const long long at = fa_at(p.lse_stride, b, row + ltid, n);
    lse[ltid] = live ? lse_of(p.lse[at]) : __int_as_float(0x7f800000);
    lse[ROWS + ltid] = live ? p.delta[at] : 0.f;
    lse[2 * ROWS + ltid] = live ? p.magnitude[at] : 0.f;
  }
}

// c = A B^T and d = A' B'^T over H (wgmma's K): A, A' the warpgroup's 64 rows
// at a, ad (tiles of kARows rows), B, B' kStep rows at bb, bd; K-major
// operands, one 128-byte-swizzled panel per 64 columns.
template <int kARows>
__device__ __forceinline__ void two_products(unsigned a, unsigned ad, unsigned bb, unsigned bd,
                                             int wg, float (&c)[kNs][4], float (&d)[kNs][4]) {
  const unsigned long long da = desc(a + wg * 64 * 128, 16, 1024);
  const unsigned long long dad = desc(ad + wg * 64 * 128, 16, 1024);
  const unsigned long long db = desc(bb, 16, 1024), dbd = desc(bd, 16, 1024);
#pragma unroll
  for (int kk = 0; kk < kH / 16; ++kk) {
    const unsigned ao = (kk >> 2) * kARows * 128 + (kk & 3) * 32;
    const unsigned bo = (kk >> 2) * kStep * 128 + (kk & 3) * 32;
    wgmma_ss<kStep>(&c[0][0], desc_at(da, ao), desc_at(db, bo), kk > 0);
    wgmma_ss<kStep>(&d[0][0], desc_at(dad, ao), desc_at(dbd, bo), kk > 0);
  }
  wg_commit();
}

// acc += A B, A the packed rows of a (kStep columns = wgmma's K), B the kStep
// rows of the tile at bb read N-major (transposed): steps of 16 rows, 2048
// bytes; 64-column panels kStep * 128 bytes apart.
__device__ __forceinline__ void product_rs(float (&acc)[kNo][4], const unsigned (&a)[kStep / 16][4],
                                           unsigned bb) {
  const unsigned long long db = desc(bb, kStep * 128, 1024);
#pragma unroll
  for (int kk = 0; kk < kStep / 16; ++kk) wgmma_rs<kH>(&acc[0][0], a[kk], desc_at(db, kk * 2048));
}

__device__ __forceinline__ void zero(float (&acc)[kNo][4]) {
#pragma unroll
  for (int i = 0; i < kNo; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
}

#if FA_ATOMIC_DQ
// Atomic dQ: with 64-row steps each warpgroup takes half of dQ's columns for
// all the step's rows, with 128-row steps all columns for its 64 rows.
constexpr bool kDqByRows = kStep == 128;
constexpr int kDqCols = fa_wgmma_backward_dq_cols(kH);
constexpr int kNq = kDqCols / 8;  // n8 blocks of a warpgroup's dQ columns
static_assert(kDqCols == 64, "dQ's panels (fa_wgmma_backward_dq_panels) are a warpgroup's columns");

// Stores this warp's dS^T fragments (packed A operands: rows kr and kr + 8
// of the block's keys, query columns 16 kk + 2 t4 (+ 8)) into the swizzled
// dS^T tile at ds: one row of kStep queries per key.
__device__ __forceinline__ void store_ds(unsigned ds, int kr, int t4, const unsigned (&da)[kStep / 16][4]) {
#pragma unroll
  for (int kk = 0; kk < kStep / 16; ++kk)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = kr + 8 * (e & 1), chunk = 2 * kk + (e >> 1);
      asm volatile("st.shared.b32 [%0], %1;" ::"r"(ds + swz(kBc, r, chunk) + 4 * t4), "r"(da[kk][e])
                   : "memory");
    }
}

// acc += dS^T Q: A this warpgroup's 64 key rows of the dS^T tile at ds
// (K-major: kStep queries per row), B the step's Q tile at sq read N-major.
__device__ __forceinline__ void product_dk(float (&acc)[kNo][4], unsigned ds, unsigned sq, int wg) {
  const unsigned long long da = desc(ds + wg * 64 * 128, 16, 1024);
  const unsigned long long db = desc(sq, kStep * 128, 1024);
#pragma unroll
  for (int kk = 0; kk < kStep / 16; ++kk) {
    wgmma_ss<kH, 0, 1>(&acc[0][0], desc_at(da, (kk >> 2) * kBc * 128 + (kk & 3) * 32),
                       desc_at(db, kk * 2048), 1);
  }
}

// acc = this warpgroup's share of dS K (kDqByRows: its 64 of the step's rows,
// all of H; else all 64 rows, its half of H): A the step's dS^T tile at ds
// (MN-major: key rows of kStep queries, the share's 64-query panel), B the
// resident K tile at sk (MN-major: key rows of H), over the block's kBc keys.
__device__ __forceinline__ void product_dq(float (&acc)[kNq][4], unsigned ds, unsigned sk, int wg) {
  const int col = kDqByRows ? 0 : wg * kDqCols;  // first dQ column of this warpgroup
  const unsigned a0 = ds + (kDqByRows ? wg * kBc * 128 : 0);
  const unsigned b0 = sk + (col / 64) * kBc * 128 + (col % 64) * 2;
  const unsigned long long da = desc(a0, kBc * 128, 1024), db = desc(b0, kBc * 128, 1024);
#pragma unroll
  for (int kk = 0; kk < kBc / 16; ++kk) {
    wgmma_ss<kDqCols, 1, 1>(&acc[0][0], desc_at(da, kk * 2048), desc_at(db, kk * 2048), kk > 0);
  }
}

// dQ goes out through shared memory: each warp stages its 16 rows of acc
// (times scale) at sdq, kDqPitch floats apart, and its lane 0 adds them into
// the float32 dQ with one bulk reduction (cp.reduce.async.bulk, the copy
// engine's add) of all 16 rows with their pitch: dQ has the staging's layout
// (fa_wgmma_backward_dq_rows), so the rows are contiguous there too. The
// warps' registers are free again as soon as the stores are, where
// per-thread atomics held them until the memory system took each one, and
// the warp issues one reduction, where one per row took a loop of 16 (the
// operands of a bulk copy are uniform registers). The pitch
// (fa_wgmma_backward_dq_pitch) puts 8 consecutive rows in 2 wavefronts of
// stores and keeps rows 16-byte aligned; the 8 floats past a row's 64 are
// zeros (zero_dq_pitch), added into columns the caller drops.

__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}

// Zeros this warp's staging past each row's kDqCols floats, once.
__device__ __forceinline__ void zero_dq_pitch(unsigned sdq, int lane) {
  static_assert(kDqPitch - kDqCols == 8, "two lanes of 4 floats per row");
  const unsigned at = sdq + ((lane >> 1) * kDqPitch + kDqCols + 4 * (lane & 1)) * 4;
  asm volatile("st.shared.v4.f32 [%0], {%1, %1, %1, %1};" ::"r"(at), "f"(0.f) : "memory");
}

// Stages this warp's rows (row0 + r, r < 16, of head n; panel col0 / kDqCols)
// and adds them into dQ. The previous call's reduction must have read sdq:
// lane 0 waits first.
__device__ __forceinline__ void add_dq(const FaGradParams& p, int b, int n, int row0, int col0,
                                       unsigned sdq, int lane, const float (&acc)[kNq][4]) {
  const int g = lane >> 2, t4 = lane & 3;
  const float scale = p.rules.scale;
  if (lane == 0) bulk_wait_read();
  __syncwarp();
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int j = 0; j < kNq; ++j) {
      asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(sdq + ((g + 8 * h) * kDqPitch + 8 * j + 2 * t4) * 4),
                   "f"(acc[j][2 * h] * scale), "f"(acc[j][2 * h + 1] * scale)
                   : "memory");
    }
  fence_async_smem();
  __syncwarp();
  if (lane == 0) {
    const long long rows = fa_wgmma_backward_dq_rows(p.T);
    const long long panel =
        (static_cast<long long>(b) * p.N + n) * fa_wgmma_backward_dq_panels(kH) + col0 / kDqCols;
    float* const at = static_cast<float*>(p.dq) + (panel * rows + row0) * kDqPitch;
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(at),
                 "r"(sdq), "r"(16 * kDqPitch * 4)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
  }
}
#endif

}  // namespace

extern "C" __constant__ int fa_params_bytes = sizeof(FaGradParams);

extern "C" __global__ void __launch_bounds__(kThreads, 1)
    fa_backward_dkdv(const FaGradParams p) {
  extern __shared__ __align__(1024) unsigned char smem[];
  // warp and wg from lane 0: warp-uniform to the compiler, so that shared
  // memory descriptors built from them stay in uniform registers.
  const int tid = threadIdx.x, lane = tid & 31, warp = __shfl_sync(~0u, tid >> 5, 0), wg = warp >> 2;
  const int g = lane >> 2, t4 = lane & 3;
  const FaKeyBlock blk = fa_key_block(p, kBc, blockIdx.x);
  const int b = blk.b, kvh = blk.kvh, j0 = blk.j0, q_len = blk.q_len, kv_len = blk.kv_len;

  const unsigned sbase = (fa_smem_u32(smem) + 1023) & ~1023u;
  const unsigned sk = sbase, sv = sk + kBlockBytes;
  auto sq = [&](int st) { return sv + kBlockBytes + st * 2 * kStepBytes; };
  auto sdo = [&](int st) { return sq(st) + kStepBytes; };
  // kDsBuffers buffers of dS^T with atomic dQ (step u uses u % kDsBuffers),
  // none without.
  const unsigned sds = sv + kBlockBytes + kStages * 2 * kStepBytes;
  // Then with atomic dQ the staging of dQ rows, 16 per consumer warp.
  const unsigned sdq = sds + kDsBuffers * kDsBytes + warp * 16 * kDqPitch * 4;
  float* const scalars = reinterpret_cast<float*>(
      smem + (sbase - fa_smem_u32(smem)) + 2 * kBlockBytes + kStages * 2 * kStepBytes +
      FA_ATOMIC_DQ * (kDsBuffers * kDsBytes + kDqStageBytes));
  auto s_lse = [&](int st) { return scalars + st * 3 * kStep; };  // then D, magnitude
  const unsigned bars = fa_smem_u32(scalars + kStages * 3 * kStep);
  const unsigned kv_full = bars;
  auto q_full = [&](int st) { return bars + 8 + st * 8; };
  auto q_empty = [&](int st) { return bars + 8 + (kStages + st) * 8; };
  // dS^T buffer x: full once every consumer thread stored its rows.
  auto ds_full = [&](int x) { return bars + 8 + (2 * kStages + x) * 8; };
  static_assert(8 + (2 * kStages + kDsBuffers) * 8 <= 128, "the mbarriers fit the tile's 128 bytes");
  if (tid == 0) {
    mbar_init(kv_full, kLoaders);
    for (int st = 0; st < kStages; ++st) {
      mbar_init(q_full(st), 2 * kLoaders);  // the copies' and the scalars' arrivals
      mbar_init(q_empty(st), kWG * 128);  // every consumer thread read the stage's LSE and D
    }
    for (int x = 0; x < FA_ATOMIC_DQ * kDsBuffers; ++x) mbar_init(ds_full(x), kWG * 128);
  }
  __syncthreads();

  const int n_end = blk.n_end;
  auto advance = [&](int& n, int& i0) { fa_next_step(p, blk, kStep, n, i0); };
  int n, i0;
  fa_first_step(p, blk, kStep, n, i0);

  if (wg == kWG) {
    // Producer: K and V once, then each step's Q, dO, LSE and D into the
    // stage the consumers released. Step u uses stage u % kStages for the
    // (u / kStages)-th time; its first use waits for nothing.
    set_max_regs_dec<kProducerRegs>();
    const int ltid = tid - kWG * 128;
    if (n < n_end) {
      load_tile<kBc>(sk, p.k, p.kv_stride, b, j0, kvh, kv_len, p.H, ltid);
      load_tile<kBc>(sv, p.v, p.kv_stride, b, j0, kvh, kv_len, p.H, ltid);
      mbar_arrive_cp_async(kv_full);
    }
    for (int u = 0; n < n_end; ++u, advance(n, i0)) {
      const int st = u % kStages, ph = (u / kStages) & 1;
      mbar_wait(q_empty(st), ph ^ 1);
      load_tile<kStep>(sq(st), p.q, p.q_stride, b, i0, n, q_len, p.H, ltid);
      load_tile<kStep>(sdo(st), p.d_out, p.out_stride, b, i0, n, q_len, p.H, ltid);
      mbar_arrive_cp_async(q_full(st));
      load_scalars<kStep>(s_lse(st), p, b, n, i0, q_len, ltid);
      mbar_arrive(q_full(st));
    }
    return;
  }

  set_max_regs_inc<kConsumerRegs>();
  // This warp's 16 keys: rows g and g + 8 of its accumulators.
  const int wk0 = j0 + wg * 64 + (warp & 3) * 16, wk1 = wk0 + 16;
  float dk[kNo][4], dv[kNo][4];
  zero(dk);
  zero(dv);
  if (n < n_end) mbar_acquire(kv_full, 0);
#if FA_ATOMIC_DQ
  // Step u's dQ is taken at the start of step u + 1. The other warpgroup
  // stored its dS^T rows of step u in the middle of its step u, so either
  // warpgroup may run that far ahead of the other, and one's softmax can
  // overlap the other's products (a barrier of both after the stores kept
  // them in lockstep). Two buffers suffice: a warpgroup stores step u + 2's
  // dS^T only after the other stored step u + 1's, which it did after
  // taking step u's dQ. (n_dq, i_dq): step u's rows.
  int n_dq = n, i_dq = i0;
  auto issue_dq = [&](float(&dq)[kNq][4], int v) {
    mbar_acquire(ds_full(v % kDsBuffers), (v / kDsBuffers) & 1);
    product_dq(dq, sds + (v % kDsBuffers) * kDsBytes, sk, wg);
    wg_commit();
  };
  auto finish_dq = [&](float(&dq)[kNq][4]) {  // after the wait for dQ's product
    reg_fence<kNq * 4>(&dq[0][0]);
    add_dq(p, b, n_dq, i_dq + (kDqByRows ? wg * 64 : 0) + (warp & 3) * 16,
           kDqByRows ? 0 : wg * kDqCols, sdq, lane, dq);
  };
  zero_dq_pitch(sdq, lane);
#endif
  int u = 0;
  for (; n < n_end; ++u, advance(n, i0)) {
    const int st = u % kStages, ph = (u / kStages) & 1;
    mbar_acquire(q_full(st), ph);
    float s[kNs][4], dp[kNs][4];
    wg_fence();
#if FA_ATOMIC_DQ
    if (u > 0) {
      float dq[kNq][4];
      issue_dq(dq, u - 1);
      wg_wait<0>();
      finish_dq(dq);
      wg_fence();
    }
#endif
    two_products<kBc>(sk, sv, sq(st), sdo(st), wg, s, dp);
    wg_wait<0>();
    reg_fence<kNs * 4>(&s[0][0]);
    reg_fence<kNs * 4>(&dp[0][0]);

    // LSE and D of this thread's query columns 8 j + 2 t4 and + 1, in pairs.
    const float2* lse = reinterpret_cast<const float2*>(s_lse(st)) + t4;
    fa_if_whole(fa_all_visible(p.rules, q_len, kv_len, i0, i0 + kStep, wk0, wk1), [&](bool whole) {
#pragma unroll
      for (int j = 0; j < kNs; ++j) {
        const float2 l2 = lse[4 * j], d = lse[kStep / 2 + 4 * j];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = wk0 + g + 8 * (e >> 1), c = 8 * j + 2 * t4 + (e & 1);
          const bool seen = whole || fa_visible(p.rules, q_len, kv_len, i0 + c, key);
          prob_and_ds(p, s[j][e], dp[j][e], seen, b, n, i0 + c, key, e & 1 ? l2.y : l2.x,
                      e & 1 ? d.y : d.x, &s[j][e], &dp[j][e]);
        }
      }
    });
    fa_one_hot_rounding(s, dp, p.H, [&](int j, int e) {
      return s_lse(st)[2 * kStep + 8 * j + 2 * t4 + (e & 1)];
    });
    unsigned pa[kStep / 16][4], da[kStep / 16][4];
#pragma unroll
    for (int kk = 0; kk < kStep / 16; ++kk) {
      fa_pack_a(s, kk, pa[kk]);
      fa_pack_a(dp, kk, da[kk]);
    }
#if FA_ATOMIC_DQ
    // dS^T to shared memory: dK's A operand for this warpgroup's keys and,
    // once both warpgroups stored theirs, dQ's for all 128 (next step).
    const int x = u % kDsBuffers;
    const unsigned ds = sds + x * kDsBytes;
    store_ds(ds, wg * 64 + (warp & 3) * 16 + g, t4, da);
    fence_async_smem();
    mbar_arrive(ds_full(x));
    asm volatile("bar.sync %0, 128;" ::"r"(2 + wg) : "memory");  // this warpgroup's rows
    reg_fence<kNo * 4>(&dv[0][0]);
    reg_fence<kNo * 4>(&dk[0][0]);
    wg_fence();
    product_rs(dv, pa, sdo(st));
    product_dk(dk, ds, sq(st), wg);
    wg_commit();
    wg_wait<0>();
    reg_fence<kNo * 4>(&dv[0][0]);
    reg_fence<kNo * 4>(&dk[0][0]);
    mbar_arrive(q_empty(st));
    n_dq = n;
    i_dq = i0;
#else
    reg_fence<kNo * 4>(&dv[0][0]);
    reg_fence<kNo * 4>(&dk[0][0]);
    wg_fence();
    product_rs(dv, pa, sdo(st));
    product_rs(dk, da, sq(st));
    wg_commit();
    wg_wait<0>();
    reg_fence<kNo * 4>(&dv[0][0]);
    reg_fence<kNo * 4>(&dk[0][0]);
    mbar_arrive(q_empty(st));
#endif
  }
#if FA_ATOMIC_DQ
  if (u > 0) {
    float dq[kNq][4];
    wg_fence();
    issue_dq(dq, u - 1);
    wg_wait<0>();
    finish_dq(dq);
  }
  if (lane == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");  // before shared memory goes
#endif
  fa_write_grad_rows(p.dk, p.dkv_stride, b, kvh, wk0 + g, 0, p.S, p.H, t4, p.rules.scale, dk);
  fa_write_grad_rows(p.dv, p.dkv_stride, b, kvh, wk0 + g, 0, p.S, p.H, t4, 1.f, dv);
}

#if !FA_ATOMIC_DQ  // that build adds dQ in fa_backward_dkdv
extern "C" __global__ void __launch_bounds__(kThreads, 1)
    fa_backward_dq(const FaGradParams p) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
  const int g = lane >> 2, t4 = lane & 3;
  const FaBlock blk = fa_block(p, kBr, kStep);
  const int b = blk.b, n = blk.n, kvh = blk.kvh, m0 = blk.m0;
  const int q_len = blk.q_len, kv_len = blk.kv_len;

  const unsigned sbase = (fa_smem_u32(smem) + 1023) & ~1023u;
  const unsigned sq = sbase, sdo = sq + kBlockBytes;
  auto sk = [&](int st) { return sdo + kBlockBytes + st * 2 * kStepBytes; };
  auto sv = [&](int st) { return sk(st) + kStepBytes; };
  float* const s_lse = reinterpret_cast<float*>(smem + (sbase - fa_smem_u32(smem)) +
                                                2 * kBlockBytes + kStages * 2 * kStepBytes);
  const unsigned bars = fa_smem_u32(s_lse + 3 * kBr);  // after LSE, D and magnitude
  const unsigned q_full = bars;
  auto kv_full = [&](int st) { return bars + 8 + st * 8; };
  auto kv_empty = [&](int st) { return bars + 8 + (kStages + st) * 8; };
  if (tid == 0) {
    mbar_init(q_full, 2 * kLoaders);  // the copies' and the scalars' arrivals
    for (int st = 0; st < kStages; ++st) {
      mbar_init(kv_full(st), kLoaders);
      mbar_init(kv_empty(st), kWG * 4);
    }
  }
  __syncthreads();

  if (wg == kWG) {
    // Producer: Q, dO, LSE and D once, then the K and V tiles into the
    // stages the consumers released.
    set_max_regs_dec<kProducerRegs>();
    const int ltid = tid - kWG * 128;
    if (blk.t_end > blk.t_begin) {
      load_tile<kBr>(sq, p.q, p.q_stride, b, m0, n, q_len, p.H, ltid);
      load_tile<kBr>(sdo, p.d_out, p.out_stride, b, m0, n, q_len, p.H, ltid);
      mbar_arrive_cp_async(q_full);
      load_scalars<kBr>(s_lse, p, b, n, m0, q_len, ltid);
      mbar_arrive(q_full);
    }
    for (int tile = blk.t_begin; tile < blk.t_end; ++tile) {
      const int u = tile - blk.t_begin, st = u % kStages, ph = (u / kStages) & 1;
      mbar_wait(kv_empty(st), ph ^ 1);
      load_tile<kStep>(sk(st), p.k, p.kv_stride, b, tile * kStep, kvh, kv_len, p.H, ltid);
      load_tile<kStep>(sv(st), p.v, p.kv_stride, b, tile * kStep, kvh, kv_len, p.H, ltid);
      mbar_arrive_cp_async(kv_full(st));
    }
    return;
  }

  set_max_regs_inc<kConsumerRegs>();
  // This warp's 16 rows: g and g + 8 of its accumulators.
  const int r0 = wg * 64 + (warp & 3) * 16, w0 = m0 + r0;
  float dq[kNo][4];
  zero(dq);
  if (blk.t_end > blk.t_begin) {
    mbar_acquire(q_full, 0);
    const float lse[2] = {s_lse[r0 + g], s_lse[r0 + g + 8]};
    const float delta[2] = {s_lse[kBr + r0 + g], s_lse[kBr + r0 + g + 8]};
    for (int tile = blk.t_begin; tile < blk.t_end; ++tile) {
      const int u = tile - blk.t_begin, st = u % kStages, ph = (u / kStages) & 1;
      const int n0 = tile * kStep;
      mbar_acquire(kv_full(st), ph);
      float s[kNs][4], dp[kNs][4];
      wg_fence();
      two_products<kBr>(sq, sdo, sk(st), sv(st), wg, s, dp);
      wg_wait<0>();
      reg_fence<kNs * 4>(&s[0][0]);
      reg_fence<kNs * 4>(&dp[0][0]);

      fa_if_whole(fa_all_visible(p.rules, q_len, kv_len, w0, w0 + 16, n0, n0 + kStep), [&](bool whole) {
#pragma unroll
        for (int j = 0; j < kNs; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int i = w0 + g + 8 * (e >> 1), key = n0 + 8 * j + 2 * t4 + (e & 1);
            const bool seen = whole || fa_visible(p.rules, q_len, kv_len, i, key);
            prob_and_ds(p, s[j][e], dp[j][e], seen, b, n, i, key, lse[e >> 1], delta[e >> 1],
                        &s[j][e], &dp[j][e]);
          }
      });
      fa_one_hot_rounding(s, dp, p.H, [&](int, int e) {
        return s_lse[2 * kBr + r0 + g + 8 * (e >> 1)];
      });
      unsigned da[kStep / 16][4];
#pragma unroll
      for (int kk = 0; kk < kStep / 16; ++kk) fa_pack_a(dp, kk, da[kk]);
      reg_fence<kNo * 4>(&dq[0][0]);
      wg_fence();
      product_rs(dq, da, sk(st));
      wg_commit();
      wg_wait<0>();
      reg_fence<kNo * 4>(&dq[0][0]);
      mbar_release_warp(kv_empty(st), lane);
    }
  }
  fa_write_grad_rows(p.dq, p.out_stride, b, n, w0 + g, 0, p.T, p.H, t4, p.rules.scale, dq);
}
#endif
