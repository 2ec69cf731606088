// Fused attention forward on the CPU: the FastAttention tiling (two-level
// Br x Bc / Bb tiling, online softmax, per-tile masks) in plain C++.
//
// Framework-free: no XLA, nanobind or Python headers. The FFI handler in
// csrc/ffi/ fills AttentionParams from XLA buffers and calls
// attention_forward_cpu().
#pragma once

#include <cstdint>

namespace fastattn {

enum class ElementType : int32_t { kF32 = 0, kF16 = 1, kBF16 = 2 };

// One attention call. Shapes use the letters of jax.nn.dot_product_attention:
// B batch, T query length, S key length, N query heads, K key/value heads
// (N % K == 0, query head n reads key/value head n / (N / K)), H head dim.
struct AttentionParams {
  int64_t B = 0, T = 0, S = 0, N = 0, K = 0, H = 0;

  ElementType dtype = ElementType::kF32;  // of q, k, v and out
  const void* q = nullptr;                // (B, T, N, H), row-major
  const void* k = nullptr;                // (B, S, K, H), row-major
  const void* v = nullptr;                // (B, S, K, H), row-major
  void* out = nullptr;                    // (B, T, N, H), row-major
  float* lse = nullptr;                   // (B, T, N): natural-log LSE of the
                                          // scaled, soft-capped, biased logits

  // Optional additive bias, broadcast to (B, N, T, S) through element strides
  // (a stride of 0 repeats the value along that dimension). nullptr: none.
  const void* bias = nullptr;
  ElementType bias_dtype = ElementType::kF32;
  int64_t bias_strides[4] = {0, 0, 0, 0};  // b, n, t, s

  // Optional boolean mask (true = attend), broadcast like bias. nullptr: none.
  const bool* mask = nullptr;
  int64_t mask_strides[4] = {0, 0, 0, 0};  // b, n, t, s

  const int32_t* q_lens = nullptr;   // (B,) valid query rows, or nullptr
  const int32_t* kv_lens = nullptr;  // (B,) valid key rows, or nullptr

  float scale = 1.0f;     // multiplies q . k
  float softcap = 0.0f;   // > 0: logits = softcap * tanh(logits / softcap),
                          // applied to the scaled logits before the bias
  bool causal = false;    // key j visible to query i only if j <= i
  // Causal and window rules place query i at key position i + kv_len - q_len
  // (bottom-right alignment) instead of i.
  bool end_aligned = false;
  int64_t window_left = -1;   // >= 0: key j visible only if j >= i - left
  int64_t window_right = -1;  // >= 0: key j visible only if j <= i + right
};

// Computes out and lse. Query rows with no visible key (including rows at or
// beyond q_lens[b]) get out = 0 and lse = -inf. A NaN or Inf in q, k or v
// reaches only the rows that see it. Uses up to num_threads threads (0: all
// CPUs this process may run on). Memory beyond inputs and outputs is
// O((Br + Bc) * H) floats per thread (O(K * (T * N / K + 32) * H) on the
// decode path, T * N / K <= 8), plus split-KV partials of
// O(splits * T * N * H) floats when T is small and S long.
void attention_forward_cpu(const AttentionParams& params, int num_threads = 0);

}  // namespace fastattn
