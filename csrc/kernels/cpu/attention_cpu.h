// Fused attention forward on the CPU: the FastAttention tiling (two-level
// Br x Bc / Bb tiling, online softmax, per-tile masks) in plain C++.
//
// Framework-free: no XLA, nanobind or Python headers. The FFI handler in
// csrc/ffi/ fills AttentionParams from XLA buffers and calls
// attention_forward_cpu().
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "attention_dtypes.h"
#include "attention_rules.h"

namespace fastattn {

// One attention call. Shapes use the letters of jax.nn.dot_product_attention:
// B batch, T query length, S key length, N query heads, K key/value heads
// (N % K == 0, query head n reads key/value head n / (N / K)), H head dim.
struct AttentionParams {
  int64_t B = 0, T = 0, S = 0, N = 0, K = 0, H = 0;

  FaDtype dtype = kFaF32;                 // of q, k, v and out (unless out_f32)
  bool out_f32 = false;                   // out is float32 whatever dtype is (the unrounded
                                          // output of 16-bit inputs)
  const void* q = nullptr;                // (B, T, N, H), row-major
  const void* k = nullptr;                // (B, S, K, H), row-major
  const void* v = nullptr;                // (B, S, K, H), row-major
  void* out = nullptr;                    // (B, T, N, H), row-major
  float* lse = nullptr;                   // (B, T, N): natural-log LSE of the
                                          // scaled, soft-capped, biased logits

  // Optional additive bias, broadcast to (B, N, T, S) through element strides
  // (a stride of 0 repeats the value along that dimension). nullptr: none.
  const void* bias = nullptr;
  FaDtype bias_dtype = kFaF32;
  int64_t bias_strides[4] = {0, 0, 0, 0};  // b, n, t, s

  // Optional boolean mask (true = attend), broadcast like bias. nullptr: none.
  const bool* mask = nullptr;
  int64_t mask_strides[4] = {0, 0, 0, 0};  // b, n, t, s

  const int32_t* q_lens = nullptr;   // (B,) valid query rows, or nullptr
  const int32_t* kv_lens = nullptr;  // (B,) valid key rows, or nullptr

  // A paged cache, read by the decode path only (cpu_reads_in_place): k and v are pools of pages
  // (pages, page_size, K, H), and key j of sequence b is row j % page_size of page
  // block_table[b * max_pages + j / page_size] (clamped to [0, pages)). nullptr: k and v are
  // (B, S, K, H), S = max_pages * page_size otherwise.
  const int32_t* block_table = nullptr;
  int64_t max_pages = 0, pages = 0, page_size = 0;

  // A quantized cache, read by the decode path only (cpu_reads_in_place): k and v hold kv_dtype
  // elements (kFaI8 or kFaF8E4M3), and the row (i0, i1, kh) of k's first three dims ((b, j, kh),
  // or paged (page, row, kh)) dequantizes to k's elements times k_scale[i0 * k_scale_strides[0]
  // + i1 * k_scale_strides[1] + kh * k_scale_strides[2]] (v likewise): float32 scales broadcast
  // over those dims by element strides (0 where broadcast). k_scale nullptr: k and v are dtype
  // (kv_dtype unused).
  FaDtype kv_dtype = kFaI8;
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  int64_t k_scale_strides[3] = {0, 0, 0};
  int64_t v_scale_strides[3] = {0, 0, 0};

  // The logit transform and index rules (attention_rules.h).
  FaRules rules = fa_make_rules(1.0f, 0.0f, 0, 0, -1, -1);
  // Segment ids, sinks and ALiBi (attention_rules.h); read by the tiled path only (PlanCpu
  // keeps such calls off the decode path).
  FaFeatures features = {};
};

// The workers a call may use: `count` of them, the calling thread included,
// and `run`, which hands a task to another one (a thread of the caller's pool,
// XLA's in the FFI handler) or, where none is free, runs it in place. A task
// may start late, even after the call returned: the kernel keeps what a late
// task reads alive, and such a task finds no work left.
struct CpuWorkers {
  int64_t count = 1;
  std::function<void(std::function<void()>)> run;
};

// How a call runs (FastAttention's two-level tiling of the rows; split-KV
// after Flash-Decoding when its work items leave workers idle).
struct CpuPlan {
  bool decode = false;   // T * N / K <= 64: items (b, split) span all heads
  bool row_lanes = false;  // decode with the query rows in the vector lanes (T * N / K > 6),
                           // else the head dimension
  int64_t Br = 0;        // packed query rows per item (0 on the decode path)
  int64_t Bc = 0;        // keys per tile
  int64_t Bb = 0;        // rows per level-2 slice (0 on the decode path with H in the lanes)
  int64_t splits = 1;    // split-KV factor
  int64_t items = 0;     // work items
  int64_t workers = 1;   // workers that take items (the calling thread included)
  int64_t scratch_floats = 0;  // working memory per worker
  int64_t lanes = 0;     // floats per vector: the instruction set chosen at run time (16:
                         // AVX-512, 8: AVX2 + FMA, 4: SSE2 or NEON)

  // Every field above by name, for logs and Python.
  std::vector<std::pair<std::string, int64_t>> Facts() const {
    return {{"decode", decode}, {"row_lanes", row_lanes}, {"Br", Br}, {"Bc", Bc}, {"Bb", Bb},
            {"splits", splits}, {"items", items}, {"workers", workers}, {"scratch_floats", scratch_floats},
            {"lanes", lanes}};
  }
};

CpuPlan PlanCpu(const AttentionParams& params, int64_t workers);

// Whether the forward of `params` reads a paged or quantized cache in place: its decode path does
// (up to 64 query rows per key/value head); the caller gathers the pages and dequantizes the cache
// for any other call.
bool cpu_reads_in_place(const AttentionParams& params);

// Computes out (dtype, or float32) and lse. Query rows with no visible key (including
// rows at or beyond q_lens[b]) get out = 0 and lse = -inf. A NaN or Inf in q, k
// or v reaches only the rows that see it. With H = 0 every logit is 0 (plus the
// bias): lse is the log-sum-exp of the visible keys' biases (the log of their
// count without one), out has no elements. Runs on `workers` as PlanCpu plans
// it and returns that plan. Memory beyond inputs and outputs is O((Br + Bc) * H)
// floats per worker (O(K * (T * N / K + 32) * H) on the decode path, T * N /
// K <= 64), plus split-KV partials of O(splits * T * N * H) floats when T is
// small and S long.
CpuPlan attention_forward_cpu(const AttentionParams& params, const CpuWorkers& workers);

// The gradients of one call (FlashAttention-2's backward, Dao 2023, Algorithm 2): `fwd` is the
// forward's call (its out unused), its lse the forward's residual (read, not written); d_out the
// cotangent of out and delta FlashAttention-2's D_i = rowsum(dO_i o O_i) - dLSE_i, reduced by
// the caller from the float32 O (a gradient through the LSE adds dLSE_i P_i to dS_i);
// dq, dk, dv (shapes of q, k, v, fwd.dtype) are written, every element. dBias is not computed.
//
// P is recomputed exactly as the forward computed it (same logits, bit for bit, and the same
// exponential): a row with a single visible key gets P = 1 exactly, and where P = 1 a dS within
// the rounding of dP - D is taken as 0 (so such rows get dQ = 0, as the exact gradient). A NaN or
// Inf in q, k, v or d_out reaches only the gradients of the rows and keys that see it.
struct AttentionGradParams {
  AttentionParams fwd;
  const void* d_out = nullptr;   // (B, T, N, H), fwd.dtype
  const float* delta = nullptr;  // (B, T, N)
  void* dq = nullptr;            // (B, T, N, H)
  void* dk = nullptr;            // (B, S, K, H)
  void* dv = nullptr;            // (B, S, K, H)
};

// How a backward call runs: Br query rows and Bc keys per tile (Bb = 0), the keys of each (b, kh)
// in `splits` ranges of whole tiles, one work item each (items = B * K * splits).
CpuPlan PlanCpuBackward(const AttentionParams& params, int64_t workers);

// Computes dQ, dK and dV in one pass: an item (b, kh, a range of key tiles) recomputes P and dS
// once for each (query block, key tile) that some row sees and accumulates dK and dV of the tile
// and the query block's dQ, into a float32 dQ partial of its range; dQ is the sum of the ranges'
// partials in range order. Each output element is written by one item in a fixed order:
// deterministic, no atomics. Rows that see no key get dQ = 0, keys no row sees dK = dV = 0.
// Memory beyond inputs and outputs: O((Br + Bc) * H) floats per worker, plus the partials,
// splits * B * N * T * round_up(H, 16) floats (splits <= 4).
CpuPlan attention_backward_cpu(const AttentionGradParams& params, const CpuWorkers& workers);

}  // namespace fastattn
