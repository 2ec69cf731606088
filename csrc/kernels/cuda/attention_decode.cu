// Decode attention: the few query rows of a decode step (T new tokens times
// the G = N / K query heads sharing one key/value head, T * G <= kRows) over
// a long KV cache, with split-KV and the split merge in one launch. Every
// CUDA path (sm_70 and newer) uses it for such steps.
//
// The work is memory-bound (about 2 * T * G flops per byte of K and V): what
// matters is streaming K and V once, at full bandwidth, from enough blocks to
// keep every multiprocessor busy to the end, with few enough instructions
// per key that issue never limits it. A unit of work is the T * G rows of one
// (b, kvh) and their walk over the keys they see, in steps of kBc
// keys; the launch is one wave of blocks, and block i takes the i-th equal
// share of all units' steps, flattened in unit order (a lean, stream-K
// partition, attention_split.cuh): a share may end one unit and start the
// next, so no multiprocessor idles while others finish (with one block per
// (b, kvh, split) instead, B = 8, S = 64K on the H100 kept 128 of 132 busy).
// Its warps take turns over a segment's keys and each keeps its own online
// softmax (FlashAttention-2); above 16 rows (build 80) the warps of a key
// group take 16 rows each of the same keys, which they load together into
// one shared ring (attention_tiles.cuh). Three builds of that walk:
//
// Build 80 (the sm_80 and sm_90 paths), tensor cores: each warp copies tiles
// of kTileKeys keys into its own shared-memory ring with cp.async, one tile
// ahead, and runs mma.m16n8k16 on them: S = Q K^T with the rows in the 16 A
// rows (zeros past the block's rows), the probabilities repacked in
// registers as the A operand of P V. About 10 warp instructions per key at
// H = 128, where the lane-split dot products of the CUDA-core walk took 75
// and made it issue-bound (2.7 TB/s at best on the H100).
//
// Build 90 (the sm_90 path above 16 rows; sm_90a), warpgroup tensor cores:
// each of the block's two warpgroups is a key group of 64 rows (one wgmma
// m64 tile, zeros past the block's rows) and walks tiles of 64 keys (32 at H
// = 256), copied by its threads with cp.async into its own ring of
// 128-byte-swizzled panels; S = Q K^T reads Q's rows from shared memory, P V
// takes P from registers, as in the forward kernel 90 (attention_wgmma.cu).
// Where build 80 has each of four warps repeat a tile's softmax
// bookkeeping and issue 32 mma.sync for its 16 rows, a warpgroup issues 12
// wgmma per 64 keys and rescales O once: at 64 rows build 80 was
// issue-bound (B = 8, S = 32K, H = 128 on an H200: 549 us against 246 at
// one token, build 90 261).
//
// Build 75 (the sm_70 and sm_75 paths; sm_75 has no bfloat16 mma), CUDA
// cores in float32: kLanesPerKey lanes share one key, each holding a 16-byte
// chunk of its K and V rows, loaded kSteps steps ahead into registers; each
// key's q . k is summed over its lanes by butterfly shuffles, so every lane
// of the key holds the logit and updates its own O chunk.
//
// The elementwise mask runs only on a segment's last keys, or when there are
// per-row rules (causal among T > 1 rows, windows). The warps' softmaxes are
// merged by their maxima through shared memory. Build 80 keeps its logits
// and maxima in attention_common.cuh's units (FaUnits), the backward's, whose
// tensor-core sums its own equal bit for bit; build 75 keeps them in log2
// units (q scaled by scale log2 e up front, one subtraction per logit), as
// its sums on CUDA cores are not the backward's anyway. The LSE is natural
// in both. A segment that is its unit's
// whole walk writes out and lse; the others write their partial state, and
// the last of a unit's segments to finish merges them (attention_split.cuh).
// On sm_90 the host launches a unit's segments (up to 8) as one thread block
// cluster; when every unit has the same steps the shares fall on the
// clusters' bounds, and the segments write their partial states into rank
// 0's shared memory, which merges them (in the H100's jitted loops, 1.5-2.5
// us less per call than the workspace's fence, counter and L2 round trip:
// PlanLaunch); build 90's 64 rows by 8 segments would not fit there, so each
// segment keeps its own and every rank merges a share of the rows from all
// of them (PlanLaunch says when build 90 takes clusters). Otherwise the same
// launch merges through the workspace.
// The index rules (end-aligned causal among the T rows, window, key lengths)
// are attention_rules.h's.
//
// A paged cache (FaPages: pools of pages of at least kTileKeys positions and
// a block table) is read in place by the paged build (FA_DECODE_PAGED 1): a
// key's row is looked up in its sequence's row of the block table, so a
// tile's keys come from at most two pages; everything else is the
// contiguous walk. The contiguous build has none of it: the lookups' few
// instructions a tile cost 13-19% at B = 1 on the H200 (43.8 against 50.4
// us at S = 32K), where a block's walk is latency-bound.
//
// A quantized cache (FA_KV_QUANT: int8 or float8_e4m3fn values, float32
// scales per position or per head, FaKvScales; build 80, H a multiple of 16)
// is read as 8-bit rows, half the bytes, into rings of twice the stages (the
// same bytes in flight), and converted in registers: Q K^T on float16 tensor
// cores, q scaled by a power of two that puts the warp's largest entry near
// 2^13 (float16 holds bf16's values there, exactly), the int8 keys exactly
// (0x6400 | byte is 1024 + byte) and the float8 ones by their bits (value /
// 256), each logit then times its key's scale; P V on bfloat16 ones, each
// probability times its value's scale (bfloat16's range: no scale makes it
// overflow or lose bits the way float16's would), the int8 values exactly
// (through float32's 0x4B0000xx = 2^23 + byte), the float8 ones by their
// bits (value * 2^-120, a power of two moved into the probabilities and the
// output). To read 8-bit rows whole, the k16 steps' columns are permuted:
// lane t4 of Q K^T reads 8 bytes of a key row at 8 (t4 + 4 u), which are
// k columns {2 t4, 2 t4 + 1, 2 t4 + 8, 2 t4 + 9} of steps 2 u and 2 u + 1,
// and q is loaded in that order; the keys are permuted so that the four a
// lane's P fragment holds are rows 4 t4 .. 4 t4 + 3 of the tile, whose bytes
// [g H / 8, (g + 1) H / 8) hold column g of the H / 8 column blocks of P V.
//
// Compile-time options beyond attention_common.cuh's: FA_DECODE_ROWS (a
// power of two up to fa_decode_max_rows), the rows a block holds;
// FA_DECODE_PAGED 0 or 1, a contiguous or paged cache; FA_KV_QUANT 0, FA_I8
// or FA_F8E4M3, a 16-bit or a quantized cache (build 80);
// FA_KERNEL_SM 75, 80 or 90, the build (fa_decode_build). Any scale and the soft cap are handled
// at run time; bias and mask are not supported (the host never sends them
// here). H need only be a multiple of 8 up to FA_HEAD_DIM.
#if FA_KERNEL_SM == 90
#include "attention_wgmma.cuh"  // kH, kChunks, the wgmma wrappers and swizzle
#else
#include "attention_m16n8.cuh"
#endif

namespace {

constexpr int kRows = FA_DECODE_ROWS;
constexpr bool kPaged = FA_DECODE_PAGED;
constexpr bool kQuant = FA_KV_QUANT != 0;
template <bool kCond, class A, class B>
struct FaIf {
  using type = A;
};
template <class A, class B>
struct FaIf<false, A, B> {
  using type = B;
};
// A K or V element as the kernel reads it from memory.
using KvElem = typename FaIf<kQuant, unsigned char, unsigned short>::type;
#if FA_KERNEL_SM != 90
constexpr int kH = FA_HEAD_DIM;
constexpr int kChunks = kH / 8;  // 16-byte chunks of a row
#endif
// Warps (attention_tiles.cuh): on build 80, two stages (one tile in flight
// per warp while the other is computed) and as many warps (up to 8) as
// shared memory allows. Measured on the H100 at H = 128 (B = 1 / 8, S = 4K
// and 256K): 8 warps x 2 stages beat 4 warps x 3, 4, 5 or 6 stages and 8 x
// 3, by up to 9% at S = 4K and 1-2% at 256K.
constexpr int kWarps = kTile.threads / 32;
constexpr int kThreads = kTile.threads;
// Build 80 above 16 rows: warp w takes rows [16 rg, 16 rg + 16) (rg = w %
// kRowGroups) of the tiles of key group w / kRowGroups. The block's O rows,
// maxima and sums are kept per key group.
constexpr int kRowGroups = fa_decode_row_groups(FA_KERNEL_SM, kRows);
constexpr int kKeyGroups = kWarps / kRowGroups;
// Build 90's and the quantized walk's rings check their fit against it.
[[maybe_unused]] constexpr int kSmemBytes = kTile.smem_bytes;
// Most segments of a unit in one cluster (1: no clusters; attention_tiles.cuh).
constexpr int kClusterMax = fa_decode_cluster_max(FA_KERNEL_SM, kRows, kFaCc);
// Build 80's clusters merge in rank 0 (a slot per segment), build 90's in
// every rank (one slot, its own segment's: fa_decode_cluster_slots).
constexpr bool kSpreadMerge = fa_decode_cluster_slots(FA_KERNEL_SM, kRows, kFaCc) == 1;
#if FA_KERNEL_SM == 90
constexpr int kWgKeys = fa_decode_wg_keys(kH);  // keys per tile of a warpgroup
constexpr int kStages = fa_decode_wg_stages(kH, kFaCc);
constexpr int kKvBytes = fa_decode_wg_tile_bytes(kH);  // a tile of K, and again of V
// A thread's 16-byte copies of a tile, of K and again of V.
constexpr int kCopies = kWgKeys * kChunks / 128;
static_assert(kKeyGroups == 2 && kThreads == 256 && kCopies * 128 == kWgKeys * kChunks &&
                  kStages >= 2 &&
                  kFaDecodeWgAlign + fa_decode_wg_q_bytes(kH) + 2 * kStages * 2 * kKvBytes <=
                      kSmemBytes,
              "two warpgroups, whose rings and Q fit the tile's shared memory");
#elif FA_KERNEL_SM >= 80
constexpr int kTileKeys = kFaDecodeTileKeys;  // keys per tile (one k16 step of P V)
// The m16 tile's halves that hold rows: rows 0..7 of the warp's (g), and
// 8..15 (g + 8) when the block holds 16 or more.
constexpr int kHalves = kRows > 8 ? 2 : 1;
// A key's row in a ring stage (attention_tiles.cuh). Either layout puts the
// 8 rows of an ldmatrix in 8 distinct bank groups, but padding (rows an odd
// number of chunks apart) also puts most rows across two 128-byte lines of
// shared memory, and a cp.async whose lanes of one 32-byte global sector
// write to two lines reads that sector from the L2 twice. Where rows are
// whole lines, chunk c of key j sits at chunk c ^ (j % 8) of its row
// instead. Measured on one H100 (B = 8, H = 128, bf16): padded, the L2 served
// 1.5 times the bytes of K and V (ncu, S = 64K) and the L2 was the limit
// (DRAM at 88.7% of peak, 723 us); swizzled, DRAM at 91.8%, 699 us; in the
// decode benchmark at S = 256K, 2903 us against 2796 us (cuDNN: 2803, 2813).
// The L2::256B prefetch hint that helped the padded rows (2951 -> 2891 us)
// does nothing for these: 2815 / 2799 us with it, 2802 / 2797 without.
constexpr int kRowChunks = fa_decode_row_chunks(kH);
constexpr bool kSwizzled = kRowChunks == kChunks;
constexpr int kTileBytes = fa_decode_tile_bytes(kH);  // of K, and again of V
constexpr int kStages = fa_decode_stages(80, kRows, kH, kFaCc, kQuant);
// A warp's 16-byte copies of a tile, of K and again of V.
#if !FA_KV_QUANT
constexpr int kCopies = (kTileKeys * kChunks + 32 * kRowGroups - 1) / (32 * kRowGroups);
#endif
#else
constexpr int kLanesPerKey = fa_decode_lanes_per_key(kH);
constexpr int kKeysPerWarp = 32 / kLanesPerKey;
// Plain loads of kSteps steps into registers, all issued before any is used;
// more rows mean more registers for q and O, and more math per byte to hide
// the latency behind. (One row with 8 steps made ptxas cap sm_75 at 96
// registers and spill.)
constexpr int kSteps = fa_decode_steps(kRows);
#endif
// The segments' partial rows the merging block has in flight at once: 16 (80
// registers) on tensor cores; fewer in the CUDA-core build, whose ptxas caps
// the registers sooner (eight rows: the walk holds q and O of all eight; one
// row: capped at 128, 8 loads spilled 16 bytes from H = 160 on sm_80 and
// sm_90, where 4 take 72 registers in all).
constexpr int kMergeLoads = FA_KERNEL_SM >= 80 ? 16 : kRows == 1 ? 4 : 8;

struct alignas(16) Chunk {
  unsigned w[4];
};
struct alignas(8) Word2 {
  unsigned w[2];
};

// (m, l) of two online softmaxes over disjoint keys -> the merged one; the
// weights a and c to apply to their O.
__device__ __forceinline__ void merge_stats(float& m, float& l, float m_o, float l_o, float& a,
                                            float& c, float to_log2) {
  const float mx = fmaxf(m, m_o);
  const float mu = mx == FA_NEG_INF ? 0.f : mx;  // both empty: weights 0, not NaN
  a = fa_weight(m, mu, to_log2);
  c = fa_weight(m_o, mu, to_log2);
  l = l * a + l_o * c;
  m = mx;
}

// What a block walks: keys [k0, k1) of key/value head kvh of batch b, for
// rows r = (t, g) = (r / G, r % G) < rows.
struct DecodeBlock {
  int b, kvh, G, rows, kv_len, k0, k1;
  bool per_row;      // rules beyond [k0, k1): causal among several rows, windows
  // The keys [whole_lo, whole_hi) below k1 that every row sees
  // (fa_common_keys): a tile inside needs no test per key.
  int whole_lo, whole_hi;
  // Build 80: fa_units(scale), or fa_units(1) under a soft cap; build 75:
  // log2 units, {ln 2, 1}.
  FaUnits units;
  // Head kvh of key 0 (of page 0 where paged); a page's keys key_stride
  // apart.
  const KvElem* k_head;
  const KvElem* v_head;
  long long key_stride;
  const int* pages;  // paged: sequence b's row of the block table
  int page_shift, page_count;
  long long page_stride;
  // A quantized cache: the scales of head kvh (of sequence b, or of page 0).
  const float* k_scale;
  const float* v_scale;

  // The page that holds key j (paged).
  __device__ __forceinline__ int page_of(int j) const {
    return min(max(__ldg(pages + (j >> page_shift)), 0), page_count - 1);
  }
  // The offset (elements) of key j's row from k_head / v_head.
  __device__ __forceinline__ long long key_at(int j) const {
    if (!kPaged) return j * key_stride;
    return page_of(j) * page_stride + (j & ((1 << page_shift) - 1)) * key_stride;
  }
#if FA_KV_QUANT
  // The offset of key j's scale from k_scale or v_scale, by that scale's
  // strides (FaKvScales).
  __device__ __forceinline__ long long scale_at(int j, const long long (&stride)[3]) const {
    if (!kPaged) return j * stride[1];
    return page_of(j) * stride[0] + (j & ((1 << page_shift) - 1)) * stride[1];
  }
#endif

  // Row r's offset (elements) in q / out, and in lse.
  __device__ long long q_at(const FaDecodeParams& p, int r) const {
    return fa_at(p.q_stride, b, r / G, kvh * G + r % G);
  }
  __device__ long long out_at(const FaDecodeParams& p, int r) const {
    return fa_at(p.out_stride, b, r / G, kvh * G + r % G);
  }
  __device__ long long lse_at(const FaDecodeParams& p, int r) const {
    return fa_at(p.lse_stride, b, r / G, kvh * G + r % G);
  }
  // The keys [*lo, *hi) below k1 that row r sees (fa_row_keys): logit's
  // rule as an interval, for a test of two compares per element. (logit
  // keeps fa_visible: asking this there made ptxas spill 8 bytes in build
  // 75's one-row walk on sm_75.)
#if FA_KERNEL_SM == 90
  __device__ __forceinline__ void row_keys(const FaDecodeParams& p, int r, int* lo,
                                           int* hi) const {
    *lo = 0;
    *hi = k1;
    if (per_row) {
      int l, h;
      fa_row_keys(p.rules, p.T, kv_len, r / G, &l, &h);
      *lo = l;
      *hi = min(h, k1);
    }
  }
#endif
  // The kept logit of row r and key j from the dot product (build 80: raw
  // q . k, soft-capped as the backward does it; build 75: already in log2
  // units), then the index rules on `edge`.
  __device__ float logit(const FaDecodeParams& p, float x, int r, int j, bool edge) const {
    if (p.rules.softcap > 0.f) {
#if FA_KERNEL_SM >= 80
      x = __fmul_rn(x, p.rules.scale);
      x = p.rules.softcap * fa_tanh(x / p.rules.softcap);
#else
      const float cap2 = p.rules.softcap * kFaLog2e;
      x = cap2 * fa_tanh(x / cap2);
#endif
    }
    if (edge && !(j < k1 && (!per_row || fa_visible(p.rules, p.T, kv_len, r / G, j)))) {
      x = FA_NEG_INF;
    }
    return x;
  }
};

#if FA_KERNEL_SM >= 80
#if FA_KERNEL_SM == 80 && !FA_KV_QUANT
// Byte offset of chunk c of key j's row in a ring stage.
__device__ __forceinline__ unsigned ring_at(int j, int c) {
  return (j * kRowChunks + (kSwizzled ? c ^ (j % 8) : c)) * 16;
}
#endif

// The warps of key group `group` wait for one another (named barrier 1 +
// group; one warp: __syncwarp).
__device__ __forceinline__ void group_sync(int group) {
  if (kRowGroups == 1) {
    __syncwarp();
  } else {
    asm volatile("bar.sync %0, %1;" ::"r"(1 + group), "n"(32 * kRowGroups) : "memory");
  }
}

#if FA_KERNEL_SM == 90
// Walks the block's keys on warpgroup tensor cores (build 90, see the top of
// the file); leaves the same as the other walks. Warpgroup `group` takes the
// tiles n * 2 + group of kWgKeys keys; its 128 threads copy each tile into
// their ring, kStages - 1 ahead, and run S = Q K^T (Q's 64 rows from shared
// memory), the online softmax of their rows g and g + 8 (the m64nN
// accumulators are per warp those of mma.m16n8), and O += P V with P from
// registers, as the forward kernel 90 does (attention_wgmma.cu).
__device__ __forceinline__ void walk_keys(const FaDecodeParams& p, const DecodeBlock& d,
                                          float (*s_o)[kRows][kH], float (*s_m)[kRows],
                                          float (*s_l)[kRows], Chunk* smem) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = warp / 4, wt = threadIdx.x % 128;
  // C fragment: rows g and g + 8 of the block, keys / columns 2 t4 + {0, 1}.
  const int g = 16 * (warp % 4) + lane / 4, t4 = lane % 4;
  const unsigned sq = (fa_smem_u32(smem) + kFaDecodeWgAlign - 1) & ~(kFaDecodeWgAlign - 1u);
  const unsigned ring = sq + fa_decode_wg_q_bytes(kH) + group * kStages * 2 * kKvBytes;

  // Q's 64 rows into shared memory (zeros past the block's rows and H), one
  // commit group ahead of the first tiles', whose loads its wait overlaps;
  // the previous walk's readers of s_o, which lies here, passed a
  // __syncthreads.
#pragma unroll
  for (int i = 0; i < 64 * kChunks / kThreads; ++i) {
    const int c = kThreads * i + threadIdx.x, r = c / kChunks, ch = c % kChunks;
    const bool valid = r < d.rows && ch * 8 < p.H;
    fa_cp_async16(sq + swz(64, r, ch),
                  static_cast<const unsigned short*>(p.q) + (valid ? d.q_at(p, r) + ch * 8 : 0),
                  valid);
  }
  fa_cp_async_commit();

  const int tiles = d.k1 > d.k0 ? (d.k1 - d.k0 + kWgKeys - 1) / kWgKeys : 0;
  const int my_tiles = tiles > group ? (tiles - group + kKeyGroups - 1) / kKeyGroups : 0;
  const int h_chunks = p.H / 8;
  auto tile_key = [&](int n) { return d.k0 + (n * kKeyGroups + group) * kWgKeys; };
  // Copies this thread's part of tile n into ring stage n % kStages (zeros
  // past the keys and past H), one commit group per call, empty past the
  // last tile. Paged, a tile inside one page looks it up once; one across
  // pages (pages of fewer keys than a tile, or a tile off their bounds)
  // looks up each key's.
  auto issue = [&](int n) {
    if (n < my_tiles) {
      const int key0 = tile_key(n);
      const unsigned stage = ring + (n % kStages) * 2 * kKvBytes;
      const int last = min(key0 + kWgKeys, d.k1) - 1;
      const bool one_page = !kPaged || (key0 >> d.page_shift) == (last >> d.page_shift);
      const long long first = one_page ? d.key_at(key0) : 0;
#pragma unroll
      for (int i = 0; i < kCopies; ++i) {
        const int at = 128 * i + wt, key = at / kChunks, c = at % kChunks;
        const bool valid = key0 + key < d.k1 && c < h_chunks;
        const long long row = one_page ? first + key * d.key_stride : d.key_at(key0 + key);
        const long long src = valid ? row + c * 8 : 0;
        const unsigned dst = stage + swz(kWgKeys, key, c);
        fa_cp_async16(dst, d.k_head + src, valid);
        fa_cp_async16(dst + kKvBytes, d.v_head + src, valid);
      }
    }
    fa_cp_async_commit();
  };
#pragma unroll
  for (int n = 0; n < kStages - 1; ++n) issue(n);
  fa_cp_async_wait<kStages - 1>();  // Q's group
  fence_async_smem();
  __syncthreads();

  constexpr int kNs = kWgKeys / 8, kNo = kH / 8;  // n8 blocks of S and of O
  float o[kNo][4];
#pragma unroll
  for (int i = 0; i < kNo; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m[2] = {FA_NEG_INF, FA_NEG_INF}, l[2] = {0.f, 0.f};
  for (int n = 0; n < my_tiles; ++n) {
    fa_cp_async_wait<kStages - 2>();  // this thread's copies of tile n
    fence_async_smem();               // ... visible to wgmma's reads
    // Every thread's copies of tile n; every warp's reads of tile n - 1,
    // whose stage the next copies refill.
    group_sync(group);
    issue(n + kStages - 1);
    const unsigned kt = ring + (n % kStages) * 2 * kKvBytes, vt = kt + kKvBytes;
    float s[kNs][4];
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < kH / 16; ++kk) {
      // A k16 step is 32 bytes into a 128-byte row; every fourth starts the
      // next panel.
      wgmma_ss<kWgKeys>(&s[0][0], desc(sq + (kk >> 2) * 64 * 128 + (kk & 3) * 32, 16, 1024),
                        desc(kt + (kk >> 2) * kWgKeys * 128 + (kk & 3) * 32, 16, 1024), kk > 0);
    }
    wg_commit();
    wg_wait<0>();
    reg_fence<kNs * 4>(&s[0][0]);

    const int key0 = tile_key(n);
    if (p.rules.softcap > 0.f) {
#pragma unroll
      for (int nb = 0; nb < kNs; ++nb) {
#pragma unroll
        for (int i = 0; i < 4; ++i) s[nb][i] = d.logit(p, s[nb][i], 0, 0, false);
      }
    }
    if (key0 < d.whole_lo || key0 + kWgKeys > d.whole_hi) {
      // A row sees one interval of keys (DecodeBlock::logit's rules): two
      // compares an element.
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        int lo = 0, hi = d.k1;
        d.row_keys(p, g + 8 * half, &lo, &hi);
#pragma unroll
        for (int nb = 0; nb < kNs; ++nb) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int j = key0 + 8 * nb + 2 * t4 + e;
            if (j < lo || j >= hi) s[nb][2 * half + e] = FA_NEG_INF;
          }
        }
      }
    }
    // The online softmax step of the forward kernels (attention_m16n8.cuh;
    // no extras are compiled in here).
    fa_softmax_step(p, s, o, m, l, 0, 0, 0, 0, t4, d.units);
    unsigned pa[kWgKeys / 16][4];  // P as wgmma A fragments
#pragma unroll
    for (int kk = 0; kk < kWgKeys / 16; ++kk) fa_pack_a(s, kk, pa[kk]);
    reg_fence<kNo * 4>(&o[0][0]);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < kWgKeys / 16; ++kk) {
      // V is N-major (H contiguous): LBO steps between 64-column panels, SBO
      // between 8-key atoms.
      wgmma_rs<kH>(&o[0][0], pa[kk], desc(vt + kk * 2048, kWgKeys * 128, 1024));
    }
    wg_commit();
    wg_wait<0>();
    reg_fence<kNo * 4>(&o[0][0]);
  }
  fa_cp_async_wait<0>();

#pragma unroll
  for (int half = 0; half < 2; ++half) {
    l[half] += __shfl_xor_sync(0xffffffffu, l[half], 1);
    l[half] += __shfl_xor_sync(0xffffffffu, l[half], 2);
  }
  __syncthreads();  // s_o lies over Q and the rings
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = g + 8 * half;
    if (r < kRows) {
#pragma unroll
      for (int nt = 0; nt < kNo; ++nt) {
        s_o[group][r][8 * nt + 2 * t4] = o[nt][2 * half];
        s_o[group][r][8 * nt + 2 * t4 + 1] = o[nt][2 * half + 1];
      }
      if (t4 == 0) s_m[group][r] = m[half], s_l[group][r] = l[half];
    }
  }
}
#elif FA_KV_QUANT
// --- a quantized cache (see the top of the file) ---
constexpr int kQRowChunks = kH / 16;  // 16-byte chunks of a key's 8-bit row
// Rows of whole 128-byte lines are XOR-swizzled by 32-byte pairs of chunks:
// the four rows one quarter of Q K^T's lanes reads at once, and the four one
// quarter of P V's reads, then lie in distinct banks.
constexpr bool kQSwizzled = kQRowChunks == 8 || kQRowChunks == 16;
constexpr int kQTileBytes = kTileKeys * kH;  // of K, and again of V
constexpr int kQStageBytes = fa_decode_stage_bytes(kH, 1);
constexpr int kQCopies = (kTileKeys * kQRowChunks + 32 * kRowGroups - 1) / (32 * kRowGroups);
constexpr int kQSpan = kH / 8;  // bytes of a V row one lane reads: one per column block
// float8 to float16 by cvt (sm_89 and newer), else by its bits, which read
// as float16 are value / 256: the unit the converted values stand in.
constexpr bool kCvtF8 = FA_KV_QUANT == FA_F8E4M3 && __CUDA_ARCH__ >= 890;
constexpr float kUnit = FA_KV_QUANT == FA_F8E4M3 && !kCvtF8 ? 256.f : 1.f;
static_assert(kH % 32 == 0 && kStages >= 3 && kQStageBytes * kStages * kKeyGroups <= kSmemBytes,
              "the quantized rings fit the tile's shared memory");

__device__ __forceinline__ unsigned prmt(unsigned a, unsigned b, unsigned sel) {
  unsigned r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

// Byte offset of byte `at` of key j's row in a stage's K or V tile.
__device__ __forceinline__ int qring_at(int j, int at) {
  if (!kQSwizzled) return j * kH + at;
  const int turn = 2 * (((j >> 2) + 2 * (j & 1)) & 3);
  return j * kH + ((((at >> 4) ^ turn)) << 4) + (at & 15);
}

__device__ __forceinline__ void cp_async4(unsigned dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src),
               "r"(valid ? 4 : 0));
}

// Four 8-bit keys' values of one row (bytes 0..3 of w) as the B fragment
// halves of Q K^T: b0 = float16x2 of values 0, 1, b1 of 2, 3.
__device__ __forceinline__ void key_pairs(unsigned w, unsigned& b0, unsigned& b1) {
#if FA_KV_QUANT == FA_I8
  // Offset binary (byte + 128) under 0x64: 1024 + 128 + value, exactly.
  const unsigned x = w ^ 0x80808080u;
  const unsigned bias = 0x64806480u;  // 1152, 1152
  asm("sub.f16x2 %0, %1, %2;" : "=r"(b0) : "r"(prmt(x, 0x64646464u, 0x4140)), "r"(bias));
  asm("sub.f16x2 %0, %1, %2;" : "=r"(b1) : "r"(prmt(x, 0x64646464u, 0x4342)), "r"(bias));
#elif __CUDA_ARCH__ >= 890
  asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %2;\n cvt.rn.f16x2.e4m3x2 %0, lo;\n"
      " cvt.rn.f16x2.e4m3x2 %1, hi;\n}" : "=r"(b0), "=r"(b1) : "r"(w));
#else
  // e4m3 (s eeee mmm) into float16 (s eeeee mmmmmmmmmm) one exponent bit
  // lower: value / 256, subnormals included.
  const unsigned r0 = prmt(w, w, 0x1000), r1 = prmt(w, w, 0x3020);
  b0 = ((r0 >> 1) & 0x3f803f80u) | (r0 & 0x80008000u);
  b1 = ((r1 >> 1) & 0x3f803f80u) | (r1 & 0x80008000u);
#endif
}

// Bytes e and e + 1 (e even) of two rows' words (wa, wb; int8 already in
// offset binary) as B fragment halves of P V: lo = float16x2 of row a's,
// row b's byte e; hi = of byte e + 1 (int8: exactly; float8: value / 256).
template <int e>
__device__ __forceinline__ void value_pairs(unsigned wa, unsigned wb, unsigned& lo,
                                            unsigned& hi) {
#if FA_KV_QUANT == FA_I8
  const unsigned t = prmt(wa, wb, e == 0 ? 0x5140 : 0x7362);  // a_e, b_e, a_e+1, b_e+1
  const unsigned bias = 0x64806480u;
  asm("sub.f16x2 %0, %1, %2;" : "=r"(lo) : "r"(prmt(t, 0x64646464u, 0x4140)), "r"(bias));
  asm("sub.f16x2 %0, %1, %2;" : "=r"(hi) : "r"(prmt(t, 0x64646464u, 0x4342)), "r"(bias));
#elif __CUDA_ARCH__ >= 890
  const unsigned t = prmt(wa, wb, e == 0 ? 0x5140 : 0x7362);  // a_e, b_e, a_e+1, b_e+1
  asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %2;\n cvt.rn.f16x2.e4m3x2 %0, lo;\n"
      " cvt.rn.f16x2.e4m3x2 %1, hi;\n}" : "=r"(lo), "=r"(hi) : "r"(t));
#else
  const unsigned r0 = prmt(wa, wb, ((4 + e) << 12) | ((4 + e) << 8) | (e << 4) | e);
  const unsigned r1 = prmt(wa, wb, ((5 + e) << 12) | ((5 + e) << 8) | ((e + 1) << 4) | (e + 1));
  lo = ((r0 >> 1) & 0x3f803f80u) | (r0 & 0x80008000u);
  hi = ((r1 >> 1) & 0x3f803f80u) | (r1 & 0x80008000u);
#endif
}

__device__ __forceinline__ void mma_f16(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                        unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
      "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The kQSpan bytes of key j's row from byte `at` (4-byte aligned), as words.
__device__ __forceinline__ void load_span(const unsigned char* tile, int j, int at,
                                          unsigned (&w)[kQSpan / 4]) {
  if constexpr (kQSpan % 16 == 0) {
#pragma unroll
    for (int c = 0; c < kQSpan / 16; ++c) {
      const Chunk x = *reinterpret_cast<const Chunk*>(tile + qring_at(j, at + 16 * c));
#pragma unroll
      for (int i = 0; i < 4; ++i) w[4 * c + i] = x.w[i];
    }
  } else if constexpr (kQSpan % 8 == 0) {
#pragma unroll
    for (int c = 0; c < kQSpan / 8; ++c) {
      const Word2 x = *reinterpret_cast<const Word2*>(tile + qring_at(j, at + 8 * c));
      w[2 * c] = x.w[0], w[2 * c + 1] = x.w[1];
    }
  } else {
#pragma unroll
    for (int c = 0; c < kQSpan / 4; ++c) {
      w[c] = *reinterpret_cast<const unsigned*>(tile + qring_at(j, at + 4 * c));
    }
  }
}

// Walks the block's keys of a quantized cache on tensor cores (see the top
// of the file); leaves the same as the 16-bit walk.
__device__ __forceinline__ void walk_keys(const FaDecodeParams& p, const DecodeBlock& d,
                                          float (*s_o)[kRows][kH], float (*s_m)[kRows],
                                          float (*s_l)[kRows], Chunk* smem) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = warp / kRowGroups, rg = warp % kRowGroups;
  // C fragment: row g of the block; the lane's B-fragment column gl.
  const int gl = lane / 4, g = 16 * rg + gl, t4 = lane % 4;

  // Q in float16 as the A operand, its columns in the order the key rows are
  // read: step kk's a[2 c + half] holds h = 8 (t4 + 4 (kk / 2)) + 4 (kk % 2)
  // + 2 c + {0, 1} of row g + 8 half.
  float qf[kH / 16][4][2];
  float big = 0.f;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = g + 8 * half;
    const auto* q_row = static_cast<const unsigned short*>(p.q) + d.q_at(p, r);
#pragma unroll
    for (int kk = 0; kk < kH / 16; ++kk) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int h = 8 * (t4 + 4 * (kk / 2)) + 4 * (kk % 2) + 2 * c;
        const unsigned two = half < kHalves && r < d.rows && h < p.H
                                 ? *reinterpret_cast<const unsigned*>(q_row + h)
                                 : 0u;
#if FA_DTYPE == FA_BF16
        qf[kk][2 * c + half][0] = __uint_as_float(two << 16);
        qf[kk][2 * c + half][1] = __uint_as_float(two & 0xffff0000u);
#else
        qf[kk][2 * c + half][0] = fa_f16_to_f32(two & 0xffffu);
        qf[kk][2 * c + half][1] = fa_f16_to_f32(two >> 16);
#endif
        big = fmaxf(big, fmaxf(fabsf(qf[kk][2 * c + half][0]), fabsf(qf[kk][2 * c + half][1])));
      }
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) big = fmaxf(big, __shfl_xor_sync(0xffffffffu, big, off));
  // sigma = 2^(13 - floor(log2 big)): the largest |q| in [2^13, 2^14).
  const int e = big > 0.f ? ((__float_as_int(big) >> 23) & 0xff) - 127 : 0;
  const int se = min(max(13 - e, -126), 126);
  const float sigma = __int_as_float((se + 127) << 23);
  const float k_unit = kUnit * __int_as_float((127 - se) << 23);
  unsigned qa[kH / 16][4];
#pragma unroll
  for (int kk = 0; kk < kH / 16; ++kk) {
#pragma unroll
    for (int i = 0; i < 4; ++i) qa[kk][i] = fa_pack_f16(qf[kk][i][0] * sigma, qf[kk][i][1] * sigma);
  }

  const int tiles = d.k1 > d.k0 ? (d.k1 - d.k0 + kTileKeys - 1) / kTileKeys : 0;
  const int my_tiles = tiles > group ? (tiles - group + kKeyGroups - 1) / kKeyGroups : 0;
  unsigned char* ring_p = reinterpret_cast<unsigned char*>(smem) + group * kStages * kQStageBytes;
  const unsigned ring = fa_smem_u32(ring_p);
  auto tile_key = [&](int n) { return d.k0 + (n * kKeyGroups + group) * kTileKeys; };
  // Copies this warp's part of tile n (and, warp rg 0, its scales) into ring
  // stage n % kStages, one commit group per call, empty past the last tile.
  auto issue = [&](int n) {
    if (n < my_tiles) {
      const int key0 = tile_key(n);
      const unsigned stage = ring + (n % kStages) * kQStageBytes;
      const int turn = kPaged ? ((key0 >> d.page_shift) + 1) << d.page_shift : d.k1;
      const long long first = kPaged ? d.key_at(key0) : 0;
      const long long second = kPaged && turn < d.k1 ? d.key_at(turn) : 0;
#pragma unroll
      for (int i = 0; i < kQCopies; ++i) {
        const int at = 32 * (rg + kRowGroups * i) + lane, key = at / kQRowChunks,
                  c = at % kQRowChunks;
        if (kQCopies * 32 * kRowGroups > kTileKeys * kQRowChunks && key >= kTileKeys) break;
        const bool valid = key0 + key < d.k1 && 16 * c < p.H;
        const long long row = !kPaged         ? (key0 + key) * d.key_stride
                              : key0 + key < turn ? first + key * d.key_stride
                                                  : second + (key0 + key - turn) * d.key_stride;
        const long long src = valid ? row + 16 * c : 0;
        const unsigned dst = stage + qring_at(key, 16 * c);
        fa_cp_async16(dst, d.k_head + src, valid);
        fa_cp_async16(dst + kQTileBytes, d.v_head + src, valid);
      }
      if (rg == 0) {  // lanes 0..15: the keys' K scales; 16..31: their V scales
        const int key = lane % 16;
        const bool valid = key0 + key < d.k1;
        const float* src =
            lane < 16 ? d.k_scale + (valid ? d.scale_at(key0 + key, p.scales.k_stride) : 0)
                      : d.v_scale + (valid ? d.scale_at(key0 + key, p.scales.v_stride) : 0);
        cp_async4(stage + 2 * kQTileBytes + 4 * lane, src, valid);
      }
    }
    fa_cp_async_commit();
  };
#pragma unroll
  for (int n = 0; n < kStages - 1; ++n) issue(n);

  // The lane's keys in Q K^T's B fragments (column gl of key blocks 0, 1),
  // so that its P fragment holds rows 4 t4 .. 4 t4 + 3 of the tile.
  const int k_row = 4 * (gl >> 1) + (gl & 1);
  // o holds O / 2^v_exp (a power of two at least every value scale seen):
  // the probabilities times their values' scales over it lie in [0, 1],
  // float16's range, whatever the scales.
  float o[kH / 8][4] = {};
  float m[kHalves], l[kHalves];
  int v_exp = 1;  // biased exponent of the power of two
#pragma unroll
  for (int half = 0; half < kHalves; ++half) m[half] = FA_NEG_INF, l[half] = 0.f;
  // Q K^T of the tile in ring stage `kt` into s (raw products; two
  // accumulators per key block, even and odd k16 steps: half the dependent
  // chain of mma).
  auto qk = [&](const unsigned char* kt, float (&s)[2][4]) {
    float s_odd[2][4] = {};
#pragma unroll
    for (int kb = 0; kb < 2; ++kb) {
#pragma unroll
      for (int i = 0; i < 4; ++i) s[kb][i] = 0.f;
#pragma unroll
      for (int u = 0; u < kH / 32; ++u) {
        const Word2 w = *reinterpret_cast<const Word2*>(kt + qring_at(k_row + 2 * kb,
                                                                      8 * (t4 + 4 * u)));
        unsigned b0, b1;
        key_pairs(w.w[0], b0, b1);
        mma_f16(s[kb], qa[2 * u], b0, b1);
        key_pairs(w.w[1], b0, b1);
        mma_f16(s_odd[kb], qa[2 * u + 1], b0, b1);
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) s[kb][i] += s_odd[kb][i];
    }
  };
  // Software-pipelined: iteration n takes tile n's softmax and P V beside
  // tile n + 1's Q K^T (one block of independent work for the scheduler;
  // past the last tile it reads a stage no copy writes, and drops it).
  float s[2][4];
  fa_cp_async_wait<kStages - 2>();
  group_sync(group);
  qk(ring_p, s);
  for (int n = 0; n < my_tiles; ++n) {
    issue(n + kStages - 1);
    fa_cp_async_wait<kStages - 2>();  // tile n + 1
    group_sync(group);
    const unsigned char* kt = ring_p + (n % kStages) * kQStageBytes;
    const unsigned char* vt = kt + kQTileBytes;
    const float* scales = reinterpret_cast<const float*>(kt + 2 * kQTileBytes);
    const Chunk ks = *reinterpret_cast<const Chunk*>(scales + 4 * t4);
    const Chunk vs = *reinterpret_cast<const Chunk*>(scales + kTileKeys + 4 * t4);
    // The tile's largest value scale, rounded up to a power of two; v_exp
    // rises to it (o and the weights below follow).
    float vs_max = fmaxf(fmaxf(__uint_as_float(vs.w[0]), __uint_as_float(vs.w[1])),
                         fmaxf(__uint_as_float(vs.w[2]), __uint_as_float(vs.w[3])));
    vs_max = fmaxf(vs_max, __shfl_xor_sync(0xffffffffu, vs_max, 1));
    vs_max = fmaxf(vs_max, __shfl_xor_sync(0xffffffffu, vs_max, 2));
    const int tile_exp = min((__float_as_int(vs_max) >> 23) + 1, 253);
    // 2^(v_exp - tile_exp); 0 below float32's normals (o is then at most
    // 2^-126 of what follows).
    const float v_shift =
        tile_exp > v_exp ? __int_as_float(max(127 + v_exp - tile_exp, 0) << 23) : 1.f;
    v_exp = max(v_exp, tile_exp);
    const float v_unit = __int_as_float((254 - v_exp) << 23);  // 2^-v_exp, unbiased
    float k_mult[4], v_mult[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      k_mult[i] = __uint_as_float(ks.w[i]) * k_unit;
      v_mult[i] = __uint_as_float(vs.w[i]) * v_unit;
    }
    const int key0 = tile_key(n);
    const bool edge = key0 < d.whole_lo || key0 + kTileKeys > d.whole_hi;
    // x[half][i]: row g + 8 half, key key0 + 4 t4 + i.
    float x[kHalves][4];
    unsigned pa[4] = {0u, 0u, 0u, 0u};  // P times v_mult as the A operand of P V
#pragma unroll
    for (int half = 0; half < kHalves; ++half) {
      float mx = m[half];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        x[half][i] = d.logit(p, s[i / 2][2 * half + i % 2] * k_mult[i], g + 8 * half,
                             key0 + 4 * t4 + i, edge);
        mx = fmaxf(mx, x[half][i]);
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float mu = mx == FA_NEG_INF ? 0.f : mx;
      const float alpha = fa_weight(m[half], mu, d.units.to_log2);
      m[half] = mx;
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        x[half][i] = fa_weight(x[half][i], mu, d.units.to_log2);
        sum += x[half][i];
      }
      l[half] = l[half] * alpha + sum;
      const float o_alpha = alpha * v_shift;
#pragma unroll
      for (int nt = 0; nt < kH / 8; ++nt) {
        o[nt][2 * half] *= o_alpha;
        o[nt][2 * half + 1] *= o_alpha;
      }
      pa[half] = fa_pack_f16(x[half][0] * v_mult[0], x[half][1] * v_mult[1]);
      pa[2 + half] = fa_pack_f16(x[half][2] * v_mult[2], x[half][3] * v_mult[3]);
    }
    float s_next[2][4];
    qk(ring_p + ((n + 1) % kStages) * kQStageBytes, s_next);
    unsigned vw[4][kQSpan / 4];
#pragma unroll
    for (int i = 0; i < 4; ++i) load_span(vt, 4 * t4 + i, gl * kQSpan, vw[i]);
#pragma unroll
    for (int w = 0; w < kQSpan / 4; ++w) {
#if FA_KV_QUANT == FA_I8
#pragma unroll
      for (int i = 0; i < 4; ++i) vw[i][w] ^= 0x80808080u;
#endif
      unsigned b[4][2];
      value_pairs<0>(vw[0][w], vw[1][w], b[0][0], b[1][0]);
      value_pairs<0>(vw[2][w], vw[3][w], b[0][1], b[1][1]);
      value_pairs<2>(vw[0][w], vw[1][w], b[2][0], b[3][0]);
      value_pairs<2>(vw[2][w], vw[3][w], b[2][1], b[3][1]);
#pragma unroll
      for (int e = 0; e < 4; ++e) mma_f16(o[4 * w + e], pa, b[e][0], b[e][1]);
    }
#pragma unroll
    for (int kb = 0; kb < 2; ++kb) {
#pragma unroll
      for (int i = 0; i < 4; ++i) s[kb][i] = s_next[kb][i];
    }
    group_sync(group);  // every lane's reads of this stage before it is refilled
  }
  fa_cp_async_wait<0>();

#pragma unroll
  for (int half = 0; half < kHalves; ++half) {
    l[half] += __shfl_xor_sync(0xffffffffu, l[half], 1);
    l[half] += __shfl_xor_sync(0xffffffffu, l[half], 2);
  }
  __syncthreads();  // s_o lies over the rings
  const float o_unit = kUnit * __int_as_float(v_exp << 23);  // kUnit 2^v_exp, unbiased
#pragma unroll
  for (int half = 0; half < kHalves; ++half) {
    const int r = g + 8 * half;
    if (r < kRows) {
      // Column 2 t4 (+ 1) of column block nt is h = (2 t4) kQSpan + nt.
#pragma unroll
      for (int nt = 0; nt < kH / 8; ++nt) {
        s_o[group][r][2 * t4 * kQSpan + nt] = o[nt][2 * half] * o_unit;
        s_o[group][r][(2 * t4 + 1) * kQSpan + nt] = o[nt][2 * half + 1] * o_unit;
      }
      if (t4 == 0) s_m[group][r] = m[half], s_l[group][r] = l[half];
    }
  }
}
#else
// Walks the block's keys on tensor cores (see the top of the file) and leaves
// each key group's unnormalized O rows in s_o[group], its row maxima (kept
// units, FaUnits) and sums in s_m[group] and s_l[group].
__device__ __forceinline__ void walk_keys(const FaDecodeParams& p, const DecodeBlock& d,
                                          float (*s_o)[kRows][kH], float (*s_m)[kRows],
                                          float (*s_l)[kRows], Chunk* smem) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = warp / kRowGroups, rg = warp % kRowGroups;
  // C fragment: row g of the block, keys / columns 2 t4 + {0, 1}.
  const int g = 16 * rg + lane / 4, t4 = lane % 4;

  // Q as the A operand: row g (if < rows) in A rows 0..7, row g + 8 in rows
  // 8..15 where the block holds 16 rows (else zeros); qa[kk] = {a0, a1, a2,
  // a3} of k16 step kk.
  unsigned qa[kH / 16][4];
#pragma unroll
  for (int half = 0; half < kHalves; ++half) {
    const int r = g + 8 * half;
    const unsigned short* q_row = static_cast<const unsigned short*>(p.q) + d.q_at(p, r);
#pragma unroll
    for (int kk = 0; kk < kH / 16; ++kk) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int h = 16 * kk + 8 * c + 2 * t4;
        qa[kk][2 * c + half] =
            r < d.rows && h < p.H ? *reinterpret_cast<const unsigned*>(q_row + h) : 0u;
      }
    }
  }
  if (kHalves == 1) {
#pragma unroll
    for (int kk = 0; kk < kH / 16; ++kk) qa[kk][1] = qa[kk][3] = 0u;
  }

  // The key group's tiles: n = 0, 1, ... are the block's tiles n *
  // kKeyGroups + group.
  const int tiles = d.k1 > d.k0 ? (d.k1 - d.k0 + kTileKeys - 1) / kTileKeys : 0;
  const int my_tiles = tiles > group ? (tiles - group + kKeyGroups - 1) / kKeyGroups : 0;
  const int h_chunks = p.H / 8;
  const unsigned ring = fa_smem_u32(smem) + group * kStages * 2 * kTileBytes;
  auto tile_key = [&](int n) { return d.k0 + (n * kKeyGroups + group) * kTileKeys; };
  // Copies this warp's part of tile n into ring stage n % kStages (zeros
  // past the keys and past H), one commit group per call, empty past the
  // last tile.
  auto issue = [&](int n) {
    if (n < my_tiles) {
      const int key0 = tile_key(n);
      const unsigned stage = ring + (n % kStages) * 2 * kTileBytes;
      // Paged, the tile's keys lie in at most two pages (a page holds at
      // least kTileKeys): those before `turn` in key0's, the rest in the next.
      const int turn = kPaged ? ((key0 >> d.page_shift) + 1) << d.page_shift : d.k1;
      const long long first = kPaged ? d.key_at(key0) : 0;
      const long long second = kPaged && turn < d.k1 ? d.key_at(turn) : 0;
#pragma unroll
      for (int i = 0; i < kCopies; ++i) {
        const int at = 32 * (rg + kRowGroups * i) + lane, key = at / kChunks, c = at % kChunks;
        if (kCopies * 32 * kRowGroups > kTileKeys * kChunks && key >= kTileKeys) break;
        const bool valid = key0 + key < d.k1 && c < h_chunks;
        const long long row = !kPaged         ? (key0 + key) * d.key_stride
                              : key0 + key < turn ? first + key * d.key_stride
                                                  : second + (key0 + key - turn) * d.key_stride;
        const long long src = valid ? row + c * 8 : 0;
        const unsigned dst = stage + ring_at(key, c);
        fa_cp_async16(dst, d.k_head + src, valid);
        fa_cp_async16(dst + kTileBytes, d.v_head + src, valid);
      }
    }
    fa_cp_async_commit();
  };
#pragma unroll
  for (int n = 0; n < kStages - 1; ++n) issue(n);

  // Per-lane ldmatrix rows. K (B of Q K^T, 16 keys x 16 h per x4): matrices
  // (keys 0-7 | 8-15) x (chunk 2 kk | 2 kk + 1), giving b0, b1 of key block 0
  // then of block 1: this lane's key k_key, chunk 2 kk + k_half. V (B of P V,
  // transposed, 16 keys x 16 columns per x4): matrices (chunk 2 j | 2 j + 1)
  // x (keys 0-7 | 8-15), giving b0, b1 of column block 2 j then 2 j + 1.
  const int k_key = (lane / 16) * 8 + lane % 8, k_half = (lane / 8) % 2;
  const int v_key = ((lane / 8) % 2) * 8 + lane % 8, v_half = lane / 16;

  // C fragments: row g in [0..1], row g + 8 in [2..3] (zero rows unless the
  // block holds 16). Half `half` of the rows: m[half], l[half] (l: this
  // lane's share of the row sum).
  float o[kH / 8][4] = {};
  float m[kHalves], l[kHalves];
#pragma unroll
  for (int half = 0; half < kHalves; ++half) m[half] = FA_NEG_INF, l[half] = 0.f;
  for (int n = 0; n < my_tiles; ++n) {
    issue(n + kStages - 1);
    fa_cp_async_wait<kStages - 1>();
    group_sync(group);
    const unsigned kt = ring + (n % kStages) * 2 * kTileBytes, vt = kt + kTileBytes;
    float s[2][4] = {};
#pragma unroll
    for (int kk = 0; kk < kH / 16; ++kk) {
      unsigned b[4];
      fa_ldsm_x4(kt + ring_at(k_key, 2 * kk + k_half), b);
      fa_mma16(s[0], qa[kk], b[0], b[1]);
      fa_mma16(s[1], qa[kk], b[2], b[3]);
    }
    const int key0 = tile_key(n);
    const bool edge = key0 < d.whole_lo || key0 + kTileKeys > d.whole_hi;
    // x[half][i]: row g + 8 half, key key0 + 8 (i / 2) + 2 t4 + i % 2.
    float x[kHalves][4];
    unsigned pa[4] = {0u, 0u, 0u, 0u};  // P as the A operand of P V
#pragma unroll
    for (int half = 0; half < kHalves; ++half) {
      float mx = m[half];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        x[half][i] = d.logit(p, s[i / 2][2 * half + i % 2], g + 8 * half,
                             key0 + 8 * (i / 2) + 2 * t4 + i % 2, edge);
        mx = fmaxf(mx, x[half][i]);
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float mu = mx == FA_NEG_INF ? 0.f : mx;
      const float alpha = fa_weight(m[half], mu, d.units.to_log2);
      m[half] = mx;
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        x[half][i] = fa_weight(x[half][i], mu, d.units.to_log2);
        sum += x[half][i];
      }
      l[half] = l[half] * alpha + sum;
#pragma unroll
      for (int nt = 0; nt < kH / 8; ++nt) {
        o[nt][2 * half] *= alpha;
        o[nt][2 * half + 1] *= alpha;
      }
      pa[half] = fa_pack_in(x[half][0], x[half][1]);
      pa[2 + half] = fa_pack_in(x[half][2], x[half][3]);
    }
#pragma unroll
    for (int j = 0; j < kH / 16; ++j) {
      unsigned b[4];
      fa_ldsm_x4_t(vt + ring_at(v_key, 2 * j + v_half), b);
      fa_mma16(o[2 * j], pa, b[0], b[1]);
      fa_mma16(o[2 * j + 1], pa, b[2], b[3]);
    }
    group_sync(group);  // every lane's reads of this stage before it is refilled
  }
  fa_cp_async_wait<0>();

#pragma unroll
  for (int half = 0; half < kHalves; ++half) {
    l[half] += __shfl_xor_sync(0xffffffffu, l[half], 1);
    l[half] += __shfl_xor_sync(0xffffffffu, l[half], 2);
  }
  __syncthreads();  // s_o lies over the rings
#pragma unroll
  for (int half = 0; half < kHalves; ++half) {
    const int r = g + 8 * half;
    if (r < kRows) {
#pragma unroll
      for (int nt = 0; nt < kH / 8; ++nt) {
        s_o[group][r][8 * nt + 2 * t4] = o[nt][2 * half];
        s_o[group][r][8 * nt + 2 * t4 + 1] = o[nt][2 * half + 1];
      }
      if (t4 == 0) s_m[group][r] = m[half], s_l[group][r] = l[half];
    }
  }
}
#endif  // FA_KV_QUANT
#else
// Eight FA_DTYPE elements to float.
__device__ __forceinline__ void unpack(const Chunk& c, float (&f)[8]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#if FA_DTYPE == FA_BF16
    f[2 * i] = __uint_as_float(c.w[i] << 16);
    f[2 * i + 1] = __uint_as_float(c.w[i] & 0xffff0000u);
#else
    f[2 * i] = fa_f16_to_f32(c.w[i] & 0xffffu);
    f[2 * i + 1] = fa_f16_to_f32(c.w[i] >> 16);
#endif
  }
}

// Walks the block's keys on CUDA cores (see the top of the file); leaves the
// same as build 80's walk.
__device__ __forceinline__ void walk_keys(const FaDecodeParams& p, const DecodeBlock& d,
                                          float (*s_o)[kRows][kH], float (*s_m)[kRows],
                                          float (*s_l)[kRows], Chunk*) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int slot = lane / kLanesPerKey, chunk = lane % kLanesPerKey;
  const bool active = chunk < kChunks && chunk * 8 < p.H;

  float q[kRows][8];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    Chunk c{};
    if (r < d.rows && active) {
      const long long at = d.q_at(p, r) + chunk * 8;
      c = *reinterpret_cast<const Chunk*>(static_cast<const unsigned short*>(p.q) + at);
    }
    unpack(c, q[r]);
    // Logits in log2 units straight from the dot product.
#pragma unroll
    for (int e = 0; e < 8; ++e) q[r][e] *= p.rules.scale * kFaLog2e;
  }

  float m[kRows], l[kRows], o[kRows][8];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    m[r] = FA_NEG_INF;
    l[r] = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) o[r][e] = 0.f;
  }

  const unsigned short* k_lane = d.k_head + chunk * 8;
  const unsigned short* v_lane = d.v_head + chunk * 8;
  const int iters = d.k1 > d.k0 ? (d.k1 - d.k0 + kBc - 1) / kBc : 0;
  for (int n = 0; n < iters; ++n) {
    const int it = d.k0 + n * kBc;
    int j[kSteps];
    Chunk kc[kSteps], vc[kSteps];
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      j[u] = it + (u * kWarps + warp) * kKeysPerWarp + slot;
      kc[u] = Chunk{};
      vc[u] = Chunk{};
      if (active && j[u] < d.k1) {
        const long long row = d.key_at(j[u]);
        kc[u] = *reinterpret_cast<const Chunk*>(k_lane + row);
        vc[u] = *reinterpret_cast<const Chunk*>(v_lane + row);
      }
    }
    float x[kSteps][kRows];
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      float kf[8];
      unpack(kc[u], kf);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        float dot = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) dot = fmaf(q[r][e], kf[e], dot);
        x[u][r] = dot;
      }
    }
#pragma unroll
    for (int off = 1; off < kLanesPerKey; off *= 2) {
#pragma unroll
      for (int u = 0; u < kSteps; ++u) {
#pragma unroll
        for (int r = 0; r < kRows; ++r) x[u][r] += __shfl_xor_sync(0xffffffffu, x[u][r], off);
      }
    }
    const bool edge = it < d.whole_lo || it + kBc > d.whole_hi;
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) x[u][r] = d.logit(p, x[u][r], r, j[u], edge);
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float mx = m[r];
#pragma unroll
      for (int u = 0; u < kSteps; ++u) mx = fmaxf(mx, x[u][r]);
      const float mu = mx == FA_NEG_INF ? 0.f : mx;
      const float alpha = fa_ex2(m[r] - mu);  // log2 units
      m[r] = mx;
      l[r] *= alpha;
#pragma unroll
      for (int e = 0; e < 8; ++e) o[r][e] *= alpha;
#pragma unroll
      for (int u = 0; u < kSteps; ++u) x[u][r] = fa_ex2(x[u][r] - mu);
    }
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      float vf[8];
      unpack(vc[u], vf);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        l[r] += x[u][r];
#pragma unroll
        for (int e = 0; e < 8; ++e) o[r][e] = fmaf(x[u][r], vf[e], o[r][e]);
      }
    }
  }

  // Merge the key slots of the warp.
#pragma unroll
  for (int off = kLanesPerKey; off < 32; off *= 2) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float a, c;
      merge_stats(m[r], l[r], __shfl_xor_sync(0xffffffffu, m[r], off),
                  __shfl_xor_sync(0xffffffffu, l[r], off), a, c, d.units.to_log2);
#pragma unroll
      for (int e = 0; e < 8; ++e) o[r][e] = o[r][e] * a + __shfl_xor_sync(0xffffffffu, o[r][e], off) * c;
    }
  }
  if (slot == 0 && chunk < kChunks) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int e = 0; e < 8; ++e) s_o[warp][r][chunk * 8 + e] = o[r][e];
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) s_m[warp][r] = m[r], s_l[warp][r] = l[r];
  }
}
#endif

}  // namespace

extern "C" __constant__ int fa_params_bytes = sizeof(FaDecodeParams);

#if FA_KERNEL_SM >= 80
// One block per multiprocessor is the design point (kWarps fills shared
// memory); without the 1, ptxas capped H = 96 at 128 registers and spilled.
#define FA_DECODE_BOUNDS __launch_bounds__(kThreads, 1)
#else
#define FA_DECODE_BOUNDS __launch_bounds__(kThreads)
#endif

extern "C" __global__ void FA_DECODE_BOUNDS fa_forward(const FaDecodeParams p) {
  // The rings start on a 128-byte line of shared memory (the static arrays
  // come first and would shift them), as ring_at's layout assumes.
  extern __shared__ __align__(128) Chunk smem[];
  float(*s_o)[kRows][kH] = reinterpret_cast<float(*)[kRows][kH]>(smem);
  // After s_o, on rank 0 of a cluster: its segments' rows, then their LSE.
  float* after = reinterpret_cast<float*>(smem) + kKeyGroups * kRows * kH;
  float(*slot_o)[kRows][kH] = reinterpret_cast<float(*)[kRows][kH]>(after);
  float(*slot_lse)[kRows] = reinterpret_cast<float(*)[kRows]>(
      after + fa_decode_cluster_slots(FA_KERNEL_SM, kRows, kFaCc) * kRows * kH);
  __shared__ float s_m[kKeyGroups][kRows], s_l[kKeyGroups][kRows];

  DecodeBlock d;
  d.G = p.N / p.K;
  d.rows = p.T * d.G;
  d.per_row = (p.rules.causal && p.T > 1) || p.rules.window_left >= 0 ||
              p.rules.window_right >= 0;
#if FA_KERNEL_SM >= 80
  d.units = fa_units(p.rules.softcap > 0.f ? 1.f : p.rules.scale);
#else
  d.units = FaUnits{kFaLn2, 1.f};
#endif
  d.key_stride = p.kv_stride[1];
  d.page_shift = p.paged.page_shift;
  d.page_count = p.paged.pages;
  d.page_stride = p.kv_stride[0];

  // The block's walk through the lean partition: the steps (kBc
  // keys each) of all B * K units, a unit of batch b taking those of the keys
  // [lo, hi) its T rows see, at least one (an empty unit still writes its
  // rows: zeros and -inf). Kept in shared memory, not in registers across the
  // walks.
  struct Lean {
    long long steps;       // W, of all units
    long long start, end;  // the unit's first step; the block's share ends at `end`
    int blocks;            // of the partition
    int b, kvh, lo, hi, unit_steps, s0;  // the unit; s0: the block's first step in it
    // > 1: each cluster of this many blocks is one unit's segments, merged by
    // its rank 0 in shared memory (attention_split.cuh); the launch's
    // clusters when every unit has the same steps, at least one per block.
    int cluster;
    // The units whose segments this block merges once its walks are done: at
    // most the two at the ends of its share (those between are whole).
    int merges;
    struct {
      int b, kvh, segments;
      long long first;  // slot
    } merge[2];
  };
  __shared__ Lean s_lean;
  auto batch_steps = [&](int b, int* lo, int* hi) {
    fa_rows_keys(p.rules, p.T, fa_kv_len(p, b), 0, p.T, lo, hi);
    return max(1, (*hi - *lo + kBc - 1) / kBc);
  };
  if (threadIdx.x == 0) {
    Lean l;
    l.steps = 0;
    const int steps0 = batch_steps(0, &l.lo, &l.hi);
    bool even = true;
    for (int b = 0; b < p.B; ++b) {
      const int c = batch_steps(b, &l.lo, &l.hi);
      even = even && c == steps0;
      l.steps += (long long)p.K * c;
    }
    // The grid was sized for S keys per sequence; shorter ones leave fewer
    // steps, and blocks past them idle (every block of the partition then
    // has at least one step, so a unit's segments are those of consecutive
    // blocks).
    l.blocks = static_cast<int>(min((long long)p.split.parts, l.steps));
    // With even units and c blocks each, block i's share starts at step
    // i * steps0 / c: cluster u (blocks u c ...) holds unit u's segments.
    const int c = static_cast<int>(fa_cluster_size());
    l.cluster = kClusterMax > 1 && c > 1 && even && l.blocks == p.B * p.K * c ? c : 0;
    const long long w0 = fa_lean_start(blockIdx.x, l.steps, l.blocks);
    l.end = fa_lean_start(blockIdx.x + 1, l.steps, l.blocks);
    l.b = 0;
    l.unit_steps = batch_steps(0, &l.lo, &l.hi);
    l.start = 0;
    while (l.start + (long long)p.K * l.unit_steps <= w0 && l.b + 1 < p.B) {
      l.start += (long long)p.K * l.unit_steps;
      l.unit_steps = batch_steps(++l.b, &l.lo, &l.hi);
    }
    l.kvh = static_cast<int>((w0 - l.start) / l.unit_steps);
    l.start += (long long)l.kvh * l.unit_steps;
    l.s0 = static_cast<int>(w0 - l.start);
    l.merges = 0;
    s_lean = l;
  }
  __syncthreads();
  if (static_cast<int>(blockIdx.x) >= s_lean.blocks) return;
  auto clustered = [&] { return kClusterMax > 1 && s_lean.cluster > 0; };

  const int quads = p.H / 4;
  for (;;) {
    // This block's segment of unit (b, kvh): its steps [s0, s1).
    const int s0 = s_lean.s0;
    const int s1 = static_cast<int>(min(s_lean.end - s_lean.start, (long long)s_lean.unit_steps));
    d.b = s_lean.b;
    d.kvh = s_lean.kvh;
    d.kv_len = fa_kv_len(p, d.b);
    d.k0 = min(s_lean.hi, s_lean.lo + s0 * kBc);
    d.k1 = min(s_lean.hi, s_lean.lo + s1 * kBc);
    fa_common_keys(p.rules, p.T, d.kv_len, 0, p.T, &d.whole_lo, &d.whole_hi);
    d.whole_hi = min(d.whole_hi, d.k1);
    d.pages = kPaged ? p.paged.block_table + (long long)d.b * p.paged.max_pages : nullptr;
    const long long kv_at = fa_at(p.kv_stride, kPaged ? 0 : d.b, 0, d.kvh);
    d.k_head = static_cast<const KvElem*>(p.k) + kv_at;
    d.v_head = static_cast<const KvElem*>(p.v) + kv_at;
    if (kQuant) {
      const int sb = kPaged ? 0 : d.b;
      d.k_scale = p.scales.k + sb * p.scales.k_stride[0] + d.kvh * p.scales.k_stride[2];
      d.v_scale = p.scales.v + sb * p.scales.v_stride[0] + d.kvh * p.scales.v_stride[2];
    }

    walk_keys(p, d, s_o, s_m, s_l, smem);
    __syncthreads();

    // The segment's rows, four columns per thread: normalized O and the
    // LSE, final when the segment is the unit's whole walk.
    const bool whole = s_lean.s0 == 0 && s_lean.end - s_lean.start >= s_lean.unit_steps;
    const int unit = d.b * p.K + d.kvh;
    const long long slot = (long long)blockIdx.x + unit;
    // Rank 0's rings lie under its slots: every walk of the cluster is done.
    if (clustered() && !kSpreadMerge) fa_cluster_sync();
    for (int i = threadIdx.x; i < d.rows * quads; i += kThreads) {
      const int r = i / quads, e = 4 * (i % quads);
      float mx = s_m[0][r], sum = s_l[0][r], a, c, x[4];
#pragma unroll
      for (int f = 0; f < 4; ++f) x[f] = s_o[0][r][e + f];
#pragma unroll
      for (int w = 1; w < kKeyGroups; ++w) {
        merge_stats(mx, sum, s_m[w][r], s_l[w][r], a, c, d.units.to_log2);
#pragma unroll
        for (int f = 0; f < 4; ++f) x[f] = x[f] * a + s_o[w][r][e + f] * c;
      }
      const float inv = sum == 0.f ? 0.f : 1.f / sum;
      const float lse = fa_lse(mx, sum, d.units.to_nat);
#pragma unroll
      for (int f = 0; f < 4; ++f) x[f] *= inv;
      if (whole) {
        fa_store_quad(p.out, d.out_at(p, r) + e, x);
        if (e == 0) p.lse[d.lse_at(p, r)] = lse;
      } else if (clustered() && kSpreadMerge) {
#pragma unroll
        for (int f = 0; f < 4; ++f) slot_o[0][r][e + f] = x[f];
        if (e == 0) slot_lse[0][r] = lse;
      } else if (clustered()) {
        const int rank = blockIdx.x % s_lean.cluster;
        fa_store_rank0(fa_rank_address(&slot_o[rank][r][e], 0), x);
        if (e == 0) fa_store_rank0(fa_rank_address(&slot_lse[rank][r], 0), lse);
      } else {
        fa_store_partial(p.split, p.H, slot, kRows, r, e, x, lse);
      }
    }
    if (!whole && !clustered()) {
      // The unit's segments are those of blocks [first, last], in slots
      // first + unit on. Merged after the walks: in the loop, the merge's
      // registers added to the walk's made ptxas spill from H = 192.
      const int first = fa_lean_block(s_lean.start, s_lean.steps, s_lean.blocks);
      const int last =
          fa_lean_block(s_lean.start + s_lean.unit_steps - 1, s_lean.steps, s_lean.blocks);
      if (fa_last_segment(p.split.counters + unit, last - first + 1, [] { __syncthreads(); }) &&
          threadIdx.x == 0) {
        s_lean.merge[s_lean.merges++] = {d.b, d.kvh, last - first + 1, (long long)first + unit};
      }
    }
    // The next unit, if the share goes on; the next walk's rings lie over s_o.
    __syncthreads();
    if (threadIdx.x == 0) {
      Lean& l = s_lean;
      l.start += l.unit_steps;
      l.s0 = 0;
      if (++l.kvh == p.K) {
        l.kvh = 0;
        if (l.start < l.end) l.unit_steps = batch_steps(++l.b, &l.lo, &l.hi);
      }
    }
    __syncthreads();
    if (s_lean.start >= s_lean.end) break;
  }
  if (clustered() && kSpreadMerge) {
    // The block's one segment (of unit d.b, d.kvh) is in its slot 0, as is
    // every rank's: rank k merges the k-th of the cluster's shares of the
    // rows' quads, reading each rank's slot.
    fa_cluster_sync();
    const int cluster = s_lean.cluster, rank = blockIdx.x % cluster;
    auto load = [&](int k, int r, int e, float& lse, float(&x)[4]) {
      lse = fa_load_rank(fa_rank_address(&slot_lse[0][r], k));
      fa_load_rank(fa_rank_address(&slot_o[0][r][e], k), x);
    };
    fa_merge_segments<kClusterMax>(
        p, load, cluster, d.rows, rank * kThreads + threadIdx.x, cluster * kThreads,
        [&](int r) { return d.out_at(p, r); }, [&](int r) { return d.lse_at(p, r); });
    fa_cluster_sync();  // every rank's reads of this block's slot are done
    return;
  }
  if (clustered()) {
    // The block's one segment (of unit d.b, d.kvh) is in rank 0's slots.
    fa_cluster_sync();
    if (blockIdx.x % s_lean.cluster == 0) {
      auto load = [&](int k, int r, int e, float& lse, float(&x)[4]) {
        lse = slot_lse[k][r];
#pragma unroll
        for (int f = 0; f < 4; ++f) x[f] = slot_o[k][r][e + f];
      };
      fa_merge_segments<kClusterMax>(
          p, load, s_lean.cluster, d.rows, threadIdx.x, kThreads,
          [&](int r) { return d.out_at(p, r); }, [&](int r) { return d.lse_at(p, r); });
    }
    return;
  }
  for (int m = 0; m < s_lean.merges; ++m) {
    d.b = s_lean.merge[m].b;
    d.kvh = s_lean.merge[m].kvh;
    fa_merge_segments<kMergeLoads>(
        p, fa_workspace_slots(p.split, s_lean.merge[m].first, kRows, p.H),
        s_lean.merge[m].segments, d.rows, threadIdx.x, kThreads,
        [&](int r) { return d.out_at(p, r); }, [&](int r) { return d.lse_at(p, r); });
  }
}
