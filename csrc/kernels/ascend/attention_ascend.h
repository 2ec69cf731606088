// The Ascend path's one home for its tiling: what the Ascend 910B (A2/A3) AI
// core holds, the tile sizes chosen from it, where each buffer sits, the
// workspace and the kernel's parameters. Included by the PTO-ISA kernel
// (attention_ascend.cpp, built by clang for PTO's CPU simulator or by CANN's
// bisheng for the NPU), by its FFI handler and by the extension's plan
// functions that Python asks (fastattn_jax.ascend.plan). No includes beyond
// the shared index rules and dtype codes: every compiler that builds the
// kernel builds this.
//
// The algorithm is FastAttention's NPU forward (Lin et al. 2024, section 4.1,
// appendix B): the Cube unit multiplies large Br x Bc tiles (S = Q K^T, then
// P V), the Vector unit runs FlashAttention-2's online softmax over Bb-row
// slices of each tile (the second tiling level: a slice's working set, not
// the tile's, has to fit the 192 KB Unified Buffer), and the masks are built
// per slice from indices (the tiling-mask: never a T x S mask).
#pragma once

#include <stdint.h>

#include "attention_dtypes.h"
#include "attention_rules.h"

// Buffer capacities of one 910B AI core, in bytes (PTO-ISA's memory model of
// A2/A3 enforces the same numbers in its simulator).
constexpr int64_t kFaAscendUbBytes = 192 * 1024;   // Vector: Unified Buffer
constexpr int64_t kFaAscendL1Bytes = 512 * 1024;   // Cube: L1
constexpr int64_t kFaAscendL0aBytes = 64 * 1024;   // Cube: left operand
constexpr int64_t kFaAscendL0bBytes = 64 * 1024;   // Cube: right operand
constexpr int64_t kFaAscendL0cBytes = 128 * 1024;  // Cube: fp32 accumulator
// AI cores of an Ascend 910B3 (one Cube and two Vector cores each): the
// workers the split-KV policy fills.
constexpr int64_t kFaAscendCores = 20;
// The Cube multiplies 16 x 16 fractals: Br, Bc and the padded head dim Hp are
// multiples of 16. A Vector row vector (one value per row) takes one 32-byte
// block per row.
constexpr int64_t kFaAscendFractal = 16;
constexpr int64_t kFaAscendRowBytes = 32;
// The largest head dim the Ascend path takes (CANN's FlashAttentionScore
// goes to 768; one Q tile of 256 columns already halves Br).
constexpr int64_t kFaAscendMaxHeadDim = 256;
// Masked logits are set to this (finite, so no inf - inf in the online
// softmax); a row whose running max stays at or below kFaAscendDeadMax saw
// no key and gets out 0 and LSE -inf.
constexpr float kFaAscendMasked = -1e30f;
constexpr float kFaAscendDeadMax = -1e29f;

// One compiled kernel: tile sizes and element type (compile-time in PTO).
struct FaAscendTile {
  int64_t Br;     // query rows per Cube tile
  int64_t Bc;     // keys per Cube tile
  int64_t Bb;     // rows per Vector slice
  int64_t Hp;     // head dim padded to the fractal
  int64_t dtype;  // FaDtype of q, k, v, out and P: kFaF16 or kFaBF16
};

constexpr int64_t fa_ascend_round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Bytes and offsets of every buffer of one AI core for `t`. The kernel places
// its tiles at these offsets (TASSIGN); the plan rejects a tile whose totals
// pass a capacity.
struct FaAscendBuffers {
  // Cube, L1: Q (Br x Hp), K^T (Hp x Bc), P (Br x Bc), V (Bc x Hp), 16-bit.
  int64_t l1_q, l1_k, l1_p, l1_v, l1;
  // L0A: Q and P; L0B: K^T and V; L0C: S (Br x Bc) and P V (Br x Hp), fp32.
  int64_t l0a_q, l0a_p, l0a;
  int64_t l0b_k, l0b_v, l0b;
  int64_t l0c_s, l0c_o, l0c;
  // Vector, UB: the Br x Hp fp32 accumulator and the running max, sum and
  // rescale factor of all Br rows; then one slice's working set: S, a
  // temporary and the mask (Bb x Bc fp32), the column index ramp (Bb x Bc
  // fp32), P (Bb x Bc 16-bit), P V (Bb x Hp fp32), the mask operand's bytes
  // (Bb x Bc; then the visibility bits), six Bb-row vectors and three
  // Bc-column rows (the index ramp as int32 and fp32, a broadcast bias or
  // mask row).
  int64_t ub_acc, ub_m, ub_l, ub_alpha, ub_s, ub_tmp, ub_mask, ub_ramp, ub_p, ub_pv, ub_bool,
      ub_rows, ub_index, ub;
};

constexpr FaAscendBuffers fa_ascend_buffers(const FaAscendTile& t) {
  FaAscendBuffers b{};  // NOLINT: filled below
  const int64_t e = 2;  // bytes of a 16-bit element
  b.l1_q = 0;
  b.l1_k = b.l1_q + t.Br * t.Hp * e;
  b.l1_p = b.l1_k + t.Hp * t.Bc * e;
  b.l1_v = b.l1_p + t.Br * t.Bc * e;
  b.l1 = b.l1_v + t.Bc * t.Hp * e;
  b.l0a_q = 0;
  b.l0a_p = t.Br * t.Hp * e;
  b.l0a = b.l0a_p + t.Br * t.Bc * e;
  b.l0b_k = 0;
  b.l0b_v = t.Hp * t.Bc * e;
  b.l0b = b.l0b_v + t.Bc * t.Hp * e;
  b.l0c_s = 0;
  b.l0c_o = t.Br * t.Bc * 4;
  b.l0c = b.l0c_o + t.Br * t.Hp * 4;
  const int64_t rows = t.Br * kFaAscendRowBytes, slice = t.Bb * t.Bc * 4;
  b.ub_acc = 0;
  b.ub_m = b.ub_acc + t.Br * t.Hp * 4;
  b.ub_l = b.ub_m + rows;
  b.ub_alpha = b.ub_l + rows;
  b.ub_s = b.ub_alpha + rows;
  b.ub_tmp = b.ub_s + slice;
  b.ub_mask = b.ub_tmp + slice;
  b.ub_ramp = b.ub_mask + slice;
  b.ub_p = b.ub_ramp + slice;
  b.ub_pv = b.ub_p + t.Bb * t.Bc * e;
  b.ub_bool = b.ub_pv + t.Bb * t.Hp * 4;
  b.ub_rows = b.ub_bool + t.Bb * t.Bc;
  b.ub_index = b.ub_rows + 6 * t.Bb * kFaAscendRowBytes;
  b.ub = b.ub_index + 3 * t.Bc * 4;
  return b;
}

// The first buffer of `t` past its capacity, as "UB: 200704 > 196608 bytes",
// or nullptr when all fit.
inline const char* fa_ascend_overflow(const FaAscendTile& t, int64_t* used, int64_t* capacity) {
  const FaAscendBuffers b = fa_ascend_buffers(t);
  const struct { const char* name; int64_t used, capacity; } all[] = {
      {"L1", b.l1, kFaAscendL1Bytes},    {"L0A", b.l0a, kFaAscendL0aBytes},
      {"L0B", b.l0b, kFaAscendL0bBytes}, {"L0C", b.l0c, kFaAscendL0cBytes},
      {"UB", b.ub, kFaAscendUbBytes}};
  for (const auto& x : all) {
    if (x.used > x.capacity) {
      *used = x.used;
      *capacity = x.capacity;
      return x.name;
    }
  }
  return nullptr;
}

// The tile for a call of T query rows and head dim H: Hp = H rounded up to
// 16; Bc = 128 keys (64 above Hp = 128, where K^T and V of 128 keys would
// fill L0B twice over); Br = 128 rows (64 above Hp = 128: the fp32
// accumulator alone would take 128 KB of UB), fewer for short queries
// (decode: T rounded up to 16); Bb = 32 rows per Vector slice (16 where Br
// is an odd multiple of 16). At H = 128:
// L1 128 KB of 512, L0A, L0B 64 KB and L0C 128 KB (all full), UB 175.5 KB of
// 192; at H = 256 (Br = Bc = 64): L1 104 KB, L0A 40 KB, L0B 64 KB, L0C
// 80 KB, UB 146.75 KB.
inline FaAscendTile fa_ascend_tile(int64_t T, int64_t H, int64_t dtype) {
  FaAscendTile t{};
  t.Hp = fa_ascend_round_up(H < 1 ? 1 : H, kFaAscendFractal);
  const bool wide = t.Hp > 128;
  t.Bc = wide ? 64 : 128;
  const int64_t most = wide ? 64 : 128;
  const int64_t rows = fa_ascend_round_up(T < 1 ? 1 : T, kFaAscendFractal);
  t.Br = rows < most ? rows : most;
  t.Bb = t.Br % 32 == 0 ? 32 : 16;
  t.dtype = dtype;
  return t;
}

// The kernel's parameters. q, k, v and out arrive padded to whole tiles:
// q, out (B, Tp, N, Hp), k, v (B, Sp, K, Hp) with Tp, Sp multiples of Br, Bc
// and the padding zero; both lengths are always given (the caller passes T
// and S when the user gave none), and keys at or past kv_lens[b] are masked,
// which covers the padding.
struct FaAscendParams {
  const void* q;
  const void* k;
  const void* v;
  const float* bias;     // (B|1, N|1, Tp|1, Sp|1) fp32, or null
  const uint8_t* mask;   // (B|1, N|1, Tp|1, Sp|1) bool, or null
  // Element strides along b, n, t and s; 0 along a broadcast dim (the last
  // two: only 0 or full, Sp and 1).
  int64_t bias_stride_b, bias_stride_n, bias_stride_t, bias_stride_s;
  int64_t mask_stride_b, mask_stride_n, mask_stride_t, mask_stride_s;
  const int32_t* q_lens;   // (B,)
  const int32_t* kv_lens;  // (B,)
  void* out;               // (B, Tp, N, Hp)
  float* lse;              // (B, Tp, N)
  float* workspace;        // fa_ascend_workspace_floats(...) floats
  int64_t B, Tp, Sp, N, K;
  int64_t splits;  // split-KV: ways each (b, n, row tile) splits its key tiles
  int64_t cores;   // AI cores the work is spread over
  FaRules rules;
  // Segment spans (B, Tp, kFaSpan) and (B, Sp, kFaSpan), from ids padded
  // with their last one, and sinks; no ALiBi (null).
  FaFeatures features;
};

// Work units: one per (b, n, Br-row tile, split), dealt round-robin to cores.
inline int64_t fa_ascend_units(const FaAscendTile& t, int64_t B, int64_t Tp, int64_t N,
                               int64_t splits) {
  return B * N * (Tp / t.Br) * splits;
}

// Workspace, in floats: per core, the Cube's S of two key tiles (Br x Bc
// fp32 each: tile j + 1's product overlaps tile j's softmax), P (Br x Bc
// 16-bit, counted in floats) and P V (Br x Hp, fp32) on their way
// to the Vector unit (the 910B's Cube and Vector cores share no buffer but
// GM); with split-KV, each unit's normalized partial output (Br x Hp) and
// LSE (Br), merged by fa_ascend_merge.
inline int64_t fa_ascend_core_floats(const FaAscendTile& t) {
  return 2 * t.Br * t.Bc + t.Br * t.Bc / 2 + t.Br * t.Hp;
}

inline int64_t fa_ascend_workspace_floats(const FaAscendTile& t, int64_t B, int64_t Tp, int64_t N,
                                          int64_t splits, int64_t cores) {
  const int64_t partials = splits > 1 ? fa_ascend_units(t, B, Tp, N, splits) * (t.Br * t.Hp + t.Br)
                                      : 0;
  return cores * fa_ascend_core_floats(t) + partials;
}
