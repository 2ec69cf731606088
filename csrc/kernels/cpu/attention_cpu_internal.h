// Shared by the CPU kernel's translation units: attention_cpu.cc, which plans and runs calls
// (its opening comment describes the kernel), and attention_cpu_avx512.cc, attention_cpu_avx2.cc
// and attention_cpu_baseline.cc, each of which compiles the kernel (attention_cpu_kernel.inc,
// attention_cpu_backward.inc) for one instruction set, so that the three compile in parallel.
// Here: the tiles, a call's Problem, a worker's Scratch and the table of each set's kernels.
#pragma once

#include "attention_cpu.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_float16.h"
#include "split_policy.h"

#if defined(__x86_64__) || defined(__i386__)
#define FASTATTN_X86 1
#include <cpuid.h>
#else
#define FASTATTN_X86 0
#endif

#define FASTATTN_INLINE inline __attribute__((always_inline))
// A tile's float32 work, compiled once and called per tile: it does not depend on the element type
// that templates the work item around it (process_decode_item<KV>, key_split_item<T>), into each of
// whose instantiations it would otherwise be inlined (the decode path's five copies were 60% of an
// instruction set's compile time).
#define FASTATTN_NOINLINE __attribute__((noinline))

namespace fastattn {

using cpu::BFloat16;
using cpu::Float8E4M3;
using cpu::Half;

// Tile sizes (measured on the 2-core AMD EPYC (Zen 4, AVX-512) development VM, f32, H = 64,
// B = 1, N = 8).
// Br, packed query rows per work item (level 1): every key/value tile streamed from memory is
// reused by all Br rows, so larger is better until Q^T and O^T (H x Br each) crowd the 1 MB L2:
// S = T = 8192, 2 threads: Br = 64 1000 ms, 128 954 ms, 256 803 ms (causal 484 / 440 / 407 ms);
// S = 4096: 223 / 214 / 204 ms. Chosen per call: kMaxBr, halved while Br * H exceeds
// kMaxQtFloats or while the call would have fewer than 4 work items per thread.
constexpr int64_t kMaxBr = 256;
constexpr int64_t kMaxQtFloats = 256 * 128;
// Bc, keys per tile (level 1): 64, 128 and 256 measured within the VM's run-to-run noise (~5%,
// S = 2048); 128 keeps a slice's scores (Bc x Bb floats, 32 KB) within L1 + L2 reach and the
// converted K and V tiles of 16-bit inputs small.
constexpr int64_t kBc = 128;
// Bb, query rows per level-2 slice, the unit of the score / softmax / P V pipeline: the AVX-512
// register blocks' row extent (4 vectors of 16 lanes); 32 measured the same. A multiple of every
// vector width.
constexpr int64_t kBb = 64;

// Decode: when every (batch, key/value head) has at most kDecodeRows packed query rows (T * G), a
// work item spans all heads and streams key tiles of all heads in address order
// (process_decode_item). Up to kFewRows rows per head the head dimension goes in the vector lanes,
// above them the query rows. S = 16384, N = K = 8, H = 128, B = 1, CPU ms per call with the head
// dimension / the rows in the lanes (AVX-512, bf16; f32 alike):
//   rows  4: 16.3 / 21.1   6: 21.0 / 21.2   7: 23.9 / 20.9   8: 26.0 / 21.1
// (earlier: S = 32768, bf16, H = 128, N = 64, K = 8, T = 1: 24 ms with the head dimension in the
// lanes, 31 ms with the rows).
constexpr int64_t kFewRows = 6;
// With the rows in the lanes, the tiled kernel's micro-kernels run on the all-heads tiles, one
// level-2 slice per head. N = 32, K = 8, H = 128, S = 16384, bf16, B = 1, CPU ms per call, decode
// path / tiled kernel: T = 2 (8 rows) 22.3 / 30.4, T = 4 (16) 21.9 / 31.1, T = 8 (32) 28.9 / 42.7,
// T = 16 (64) 50.6 / 63.6; 64 rows fill the slice.
constexpr int64_t kDecodeRows = kBb;
// Decode key tiles: K and V of one tile (all heads, as floats) take at most this many bytes, so
// that it and the next one, being prefetched, fit in half of the 1 MB L2 (128 KB to 1 MB
// measured the same).
constexpr int64_t kDecodeTileBytes = 256 * 1024;
// With the rows in the lanes, the scores read a converted tile's K as broadcast scalars from up to
// 2 * kKeys keys at once (kBlockKeys): its keys are laid out K * Hp + kTilePad floats apart, so
// that keys K * Hp = 1024 floats (4 KB) apart do not all fall into one set of the 8-way L1 (bf16,
// T = 4, 24 keys at once: 33 ms unpadded, 23 ms padded).
constexpr int64_t kTilePad = 16;
// Vectors of an O row accumulated at once on the decode path.
constexpr int kRowVecs = 8;

// How the forward runs a call: the tiled kernel, or the decode path with the head dimension or
// the query rows in the vector lanes.
enum class DecodeLayout { kNone, kHeadLanes, kRowLanes };

// The one rule of the forward's plan and of the backward's recomputation of the logits: the
// decode path with the head dimension in the lanes sums them in its own order
// (attention_cpu_kernel.inc: dot_keys); the other paths sum them as score_block does.
inline DecodeLayout decode_layout(const AttentionParams& p) {
  // The training features are terms of the tiled path's slices (softmax_slice's RowTerms).
  const FaFeatures& f = p.features;
  if (f.q_spans || f.sinks || f.alibi) return DecodeLayout::kNone;
  const int64_t rows = p.T * (p.N / p.K);
  if (rows <= kFewRows) return DecodeLayout::kHeadLanes;
  if (rows <= kDecodeRows) return DecodeLayout::kRowLanes;
  return DecodeLayout::kNone;
}

// The backward's tiles: kBwdBr query rows by kBwdBc keys, a multiple of every vector width (the
// keys are the lanes). Every (query block, key tile) reloads the block's Q and dO rows and adds to
// its dQ partial, which wider tiles do less often; the products stream their operands from L2
// either way. Backward alone, f32, T = S, N = K = 8, 2 threads, CPU ms per call with kBwdBc = 64 /
// 128 / 256 (interleaved on the shared development VM): H = 64, S = 1024 61.6 / 61.7 / 58.8,
// S = 2048 256 / 245 / 235, S = 4096 1123 / 999 / 936; S = 1024, H = 128 114 / 113 / 112,
// H = 256 253 / 237 / 226; causal, H = 64, S = 2048: 131 / - / 123 (a block computes only the
// vectors of keys it sees). The scratch is 0.55 MB per worker at H = 64 (1.6 MB at H = 256).
constexpr int64_t kBwdBr = 64;
constexpr int64_t kBwdBc = 256;

// Splits of each (b, kh)'s key tiles (dQ partials summed afterwards): enough for
// kBwdItemsPerWorker items per worker, at most kBwdMaxSplits, which bounds the partials' memory
// to kBwdMaxSplits float32 copies of dQ.
constexpr int64_t kBwdItemsPerWorker = 2;
constexpr int64_t kBwdMaxSplits = 4;

// Below this many floating-point operations per extra worker, a worker costs more than it saves:
// a second thread breaks even at T = S = 64, N = 4, H = 64 (4.2 MFLOP, 104 vs 96 us).
constexpr double kFlopsPerThread = 4e6;
// Split-KV: each split of a row's key range covers at least this many keys.
constexpr int64_t kMinSplitKeys = 1024;

constexpr float kInf = std::numeric_limits<float>::infinity();

constexpr int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
constexpr int64_t ceil_div(int64_t x, int64_t m) { return (x + m - 1) / m; }

// Read-only description of one call, shared by all workers.
struct Problem {
  const AttentionParams* p;
  int64_t G;             // query heads per key/value head
  int64_t packed_rows;   // T * G rows per (b, kh)
  bool decode;           // packed_rows <= kDecodeRows: work items (b, split), all heads
  bool row_lanes;        // decode with the rows in the lanes (packed_rows > kFewRows)
  int64_t decode_keys;   // keys per tile on the decode path
  int64_t ldq;           // decode: packed rows per head in the Q / O state and per-row state
  int64_t Br;            // packed rows per work item otherwise, a multiple of kBb
  int64_t tiles;         // ceil(packed_rows / Br)
  int64_t splits;        // split-KV factor, 1 when off
  int64_t items;         // B * K * tiles * splits, or B * splits for decode
  int64_t q_floats;      // Scratch sizes: Q^T / O^T (or Q / O rows) floats,
  int64_t kv_floats;     // converted K and V tiles,
  int64_t row_capacity;  // and rows of per-row state
  float* part_o;         // split-KV partials: (splits, B*T*N, H) unnormalized O
  float* part_m;         // (splits, B*T*N) running max
  float* part_l;         // (splits, B*T*N) running sum
};

// Per-thread working memory: O((Br + Bc) * H) floats; decode: O(K * (T * G + 32) * H), the
// Q and O rows (or Q^T and O^T) of every head plus K / V tiles of all heads (at least 16 keys).
struct Scratch {
  float* qt;          // H x Br     Q^T, converted (decode: a Q row per head and row, or Q^T per head)
  float* ot;          // H x Br     O^T accumulators (decode: O rows, or O^T per head)
  float* st;          // Bc x Bb    S^T, then P^T, of one slice (decode: one row's scores, or S^T)
  float* kv;          // converted K and V tiles (decode: all heads, padded to Hp)
  float* m;           // rows       running max
  float* l;           // rows       running sum
  float* alpha;       // Bb         rescale factors of the slice for this tile
  int32_t* lo_rel;    // Bb         visible key range of each slice row, relative to the tile
  int32_t* hi_rel;    // Bb
  int64_t* lo;        // rows       visible key range [lo, hi) of each row
  int64_t* hi;        // rows
  int64_t* bias_off;  // rows       offset of each row's (b, n, i, 0) bias / mask element
  int64_t* mask_off;  // rows
  int32_t* pos;       // rows       key position pos(i) of each row (ALiBi; < 2^30)
  float* slope;       // rows       ALiBi slope of each row
  int32_t* seg;       // rows       segment id of each row

  // Size in floats; every region is a multiple of 16 floats (64 bytes).
  static int64_t floats(const Problem& pb) {
    return 2 * round_up(pb.q_floats, 16) + kBc * kBb + round_up(pb.kv_floats, 16) +
           2 * pb.row_capacity + kBb + 2 * kBb + 11 * pb.row_capacity;
  }

  Scratch(float* base, const Problem& pb) {
    const int64_t rows = pb.row_capacity;
    qt = base;
    ot = qt + round_up(pb.q_floats, 16);
    st = ot + round_up(pb.q_floats, 16);
    kv = st + kBc * kBb;
    m = kv + round_up(pb.kv_floats, 16);
    l = m + rows;
    alpha = l + rows;
    lo_rel = reinterpret_cast<int32_t*>(alpha + kBb);
    hi_rel = lo_rel + kBb;
    lo = reinterpret_cast<int64_t*>(hi_rel + kBb);
    hi = lo + rows;
    bias_off = hi + rows;
    mask_off = bias_off + rows;
    pos = reinterpret_cast<int32_t*>(mask_off + rows);
    slope = reinterpret_cast<float*>(pos + rows);
    seg = reinterpret_cast<int32_t*>(slope + rows);
  }
};

// A backward call, shared by all workers: item (b, kh, split) takes a split of the key tiles of
// (b, kh) and adds the dQ it finds into its split's partial, which no other item writes.
struct BackwardProblem {
  const AttentionGradParams* g;
  int64_t splits;       // ranges of key tiles per (b, kh), each its own item and dQ partial
  int64_t split_tiles;  // key tiles per split (the last one may have fewer)
  int64_t ldp;          // floats per dQ partial row: H rounded up to 16
  float* dq_part;       // (splits, B, N, T, ldp) float32 dQ partials, unscaled
};

// Runs one work item on a worker's scratch.
using Worker = void (*)(const Problem&, float*, int64_t);
using BackwardWorker = void (*)(const BackwardProblem&, float*, int64_t);
using DqWorker = void (*)(const BackwardProblem&, int64_t);
using ScratchFloats = int64_t (*)(int64_t);

struct Kernels {
  Worker forward;
  BackwardWorker backward;
  DqWorker backward_dq;
  ScratchFloats backward_scratch;
  int64_t lanes;  // floats per vector register of the instruction set
};

// Each instruction set's kernels (attention_cpu_<set>.cc; AVX-512 and AVX2 on x86 only). The
// register blocks are kKeys keys (scores) or kDims head dimensions (P V) by kVecs vectors of
// query rows.
Kernels avx512_kernels();
Kernels avx2_kernels();
Kernels baseline_kernels();

}  // namespace fastattn
