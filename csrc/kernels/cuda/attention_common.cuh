// What every CUDA attention kernel shares: the launch parameters, the
// tiling-mask (which keys a row block can see), the logit transform,
// float <-> 16-bit conversions, which rows a block owns, and the
// shared-memory and cp.async helpers.
//
// Compiled two ways: by NVRTC as part of a kernel (no CUDA headers: the
// conversions are inline PTX), and by the host compiler for the layout of
// FaParams, which the FFI handler fills and passes as the kernel's one
// argument. Keep this file free of includes.
//
// Compile-time options of a kernel (NVRTC -D flags, set by
// csrc/cuda/kernel_cache.cc):
//   FA_PATH       70 (mma.m8n8k4), 75 (mma.m16n8k8), 80 (mma.m16n8k16),
//                 90 (wgmma, sm_90a; FA_HEAD_DIM a multiple of 64)
//   FA_HEAD_DIM   32, 64, ..., 256: the head dim H (the caller pads H up to it)
//   FA_DTYPE      q, k, v element: 0 float16, 1 bfloat16 (FA_PATH 80, 90)
//   FA_OUT_DTYPE  out element: 0 float16, 1 bfloat16, 2 float32
//   FA_GENERAL    1: bias, mask and soft cap are compiled in (each still off
//                 when its FaParams field is null / 0), any scale; 0: none of
//                 them, and scale > 0
//
// Each kernel source defines
//   extern "C" __global__ void fa_forward(const FaParams p);
//     (FA_PATH 90: fa_forward(const FaParams p, const FaTmaMaps maps))
//   extern "C" __constant__ int fa_launch[4];
//     // {block_m (Br), threads, smem bytes, block_n (Bc)}
// and is launched with grid.x = ceil(T / block_m) * N * B * kv_splits, block.x = threads
// and fa_launch[2] bytes of dynamic shared memory. (attention_decode.cu, the
// decode kernel: grid.x = B * K * kv_splits, block_m = its rows per block.)
#pragma once

#ifndef __CUDACC_RTC__
#include <cstdint>
static_assert(sizeof(long long) == 8 && sizeof(void*) == 8, "64-bit only");
#endif

// All pointers are device pointers to contiguous row-major arrays.
struct FaParams {
  const void* q;       // (B, T, N, H)
  const void* k;       // (B, S, K, H)
  const void* v;       // (B, S, K, H)
  void* out;           // (B, T, N, H), written everywhere
  float* lse;          // (B, T, N): natural-log LSE of the final logits; -inf
                       // for a row that sees no key
  const float* bias;   // broadcast to (B, N, T, S) by bias_strides; or null
  const unsigned char* mask;  // bool, broadcast by mask_strides; or null
  const int* q_lens;   // (B,): rows >= q_lens[b] see no key; or null
  const int* kv_lens;  // (B,): keys >= kv_lens[b] are never read; or null
  long long bias_strides[4];  // element strides for b, n, t, s (0: broadcast)
  long long mask_strides[4];
  int B, T, S, N, K, H;       // query head n reads key/value head n / (N / K)
  float scale;                // multiplies q . k
  float softcap;              // > 0: logit = softcap * tanh(logit / softcap)
  int causal;                 // key j visible to row i only if j <= i
  int window_left;            // >= 0: key j visible only if j >= i - left
  int window_right;           // >= 0: key j visible only if j <= i + right
  int end_aligned;            // causal and window rules place row i at key
                              // position i + kv_len - q_len, not i
  int kv_splits;              // split-KV: >= 1 blocks per row block, each over
                              // a share of its key tiles; with more than one,
                              // split s writes its own softmax (out and lse,
                              // normalized over its keys) as batch s * B + b
                              // of (kv_splits * B, T, N, H) and (kv_splits * B,
                              // T, N) arrays, which the caller combines
                              // (attention_decode.cu merges them itself, below)
  // attention_decode.cu only: split-KV partials and per-(b, kvh) counters,
  // zero at every launch (see that file); null when kv_splits == 1.
  float* partial_out;         // (B * K * kv_splits, FA_DECODE_ROWS, H)
  float* partial_lse;         // (B * K * kv_splits, FA_DECODE_ROWS), log2 domain
  unsigned* counters;         // (B * K)
};

// A TMA descriptor (the driver's CUtensorMap, filled by
// cuTensorMapEncodeTiled on the host).
struct alignas(128) FaTensorMap {
  unsigned long long opaque[16];
};

// FA_PATH 90's TMA descriptors: q as (H, N, T, B) and k, v as (H, K, S, B),
// innermost first, 16-bit elements; boxes of {64, 1, rows, 1} (rows = Br for
// q, Bc for k and v) with the 128-byte swizzle; reads past T or S give zeros.
struct FaTmaMaps {
  FaTensorMap q, k, v;
};

#ifdef __CUDACC_RTC__

#define FA_NEG_INF __int_as_float(0xff800000)

// Row i of batch b sees key j iff i < q_len, j < kv_len (and j < S), the
// causal and window bounds hold for the row's position (i, or with
// end_aligned i + kv_len - q_len), and mask[b, n, i, j] is true. The final
// logit of a visible key is
//   x = scale * (q_i . k_j);  x = softcap * tanh(x / softcap) if softcap > 0;
//   x += bias[b, n, i, j]
// and the output row is softmax(x) . V over the visible keys; a row with no
// visible key gets 0 and LSE -inf.

__device__ __forceinline__ int fa_q_len(const FaParams& p, int b) {
  return p.q_lens ? min(max(p.q_lens[b], 0), p.T) : p.T;
}

__device__ __forceinline__ int fa_kv_len(const FaParams& p, int b) {
  return p.kv_lens ? min(max(p.kv_lens[b], 0), p.S) : p.S;
}

// Key position of row 0 for the causal and window rules.
__device__ __forceinline__ int fa_pos_shift(const FaParams& p, int q_len, int kv_len) {
  return p.end_aligned ? kv_len - q_len : 0;
}

// Keys [*lo, *hi) hold every key that any row of [m0, m1) can see (index
// rules only; the mask can hide more). Empty when *lo >= *hi.
__device__ __forceinline__ void fa_key_range(const FaParams& p, int b, int m0,
                                             int m1, int* lo, int* hi) {
  const int q_len = fa_q_len(p, b), kv_len = fa_kv_len(p, b);
  int l = 0, h = kv_len;
  m1 = min(m1, q_len);
  if (m1 <= m0) h = 0;
  const int shift = fa_pos_shift(p, q_len, kv_len);
  m0 += shift;
  m1 += shift;
  if (p.causal) h = min(h, m1);
  if (p.window_right >= 0) h = min((long long)h, (long long)m1 - 1 + p.window_right + 1);
  if (p.window_left >= 0) l = max((long long)l, (long long)m0 - p.window_left);
  *lo = l;
  *hi = h;
}

// The key tiles of Bc keys, [*t_begin, *t_end), that cover fa_key_range.
__device__ __forceinline__ void fa_key_tiles(int lo, int hi, int bc, int* t_begin, int* t_end) {
  *t_begin = lo / bc;
  *t_end = hi > lo ? (hi + bc - 1) / bc : *t_begin;
}

// Split-KV: the share [*t_begin, *t_end) of the key tiles that split `split`
// of p.kv_splits walks (contiguous, as even as whole tiles allow).
__device__ __forceinline__ void fa_split_tiles(const FaParams& p, int split, int* t_begin,
                                               int* t_end) {
  const int per = (*t_end - *t_begin + p.kv_splits - 1) / p.kv_splits;
  *t_begin = min(*t_end, *t_begin + split * per);
  *t_end = min(*t_end, *t_begin + per);
}

// True when every (row, key) of [m0, m1) x [n0, n1) passes the index rules,
// so the tile needs no elementwise masking (the mask, if any, still applies).
__device__ __forceinline__ bool fa_tile_all_visible(const FaParams& p, int b,
                                                    int m0, int m1, int n0,
                                                    int n1) {
  const int q_len = fa_q_len(p, b), kv_len = fa_kv_len(p, b);
  if (m1 > q_len || n1 > kv_len) return false;
  const int shift = fa_pos_shift(p, q_len, kv_len);
  m0 += shift;
  m1 += shift;
  if (p.causal && n1 - 1 > m0) return false;
  if (p.window_right >= 0 && (long long)n1 - 1 > (long long)m0 + p.window_right) return false;
  if (p.window_left >= 0 && (long long)n0 < (long long)m1 - 1 - p.window_left) return false;
  return true;
}

// The index rules for one (row, key) pair.
__device__ __forceinline__ bool fa_visible(const FaParams& p, int q_len,
                                           int kv_len, int i, int j) {
  if (i >= q_len || j >= kv_len) return false;
  i += fa_pos_shift(p, q_len, kv_len);
  if (p.causal && j > i) return false;
  if (p.window_right >= 0 && (long long)j > (long long)i + p.window_right) return false;
  if (p.window_left >= 0 && (long long)j < (long long)i - p.window_left) return false;
  return true;
}

// 2^x and log2(x), the fast hardware approximations the softmax runs on.
__device__ __forceinline__ float fa_ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float fa_lg2(float x) {
  float y;
  asm("lg2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The logit of a visible (row i, key j) from the raw q . k; -inf if masked.
// Only for FA_GENERAL kernels; the plain path is x * scale.
__device__ __forceinline__ float fa_tanh(float x) {
  float y;
#if __CUDA_ARCH__ >= 750
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
#else  // no tanh.approx on sm_70: (1 - e) / (1 + e) with e = 2^(-2 log2(e) |x|)
  const float e = fa_ex2(-2.8853900817779268f * fabsf(x));
  y = copysignf((1.f - e) / (1.f + e), x);
#endif
  return y;
}

__device__ __forceinline__ float fa_general_logit(const FaParams& p, float qk,
                                                  int b, int n, int i, int j) {
  float x = qk * p.scale;
  if (p.softcap > 0.f) x = p.softcap * fa_tanh(x / p.softcap);
  if (p.bias) {
    x += p.bias[b * p.bias_strides[0] + n * p.bias_strides[1] +
                i * p.bias_strides[2] + j * p.bias_strides[3]];
  }
  if (p.mask && !p.mask[b * p.mask_strides[0] + n * p.mask_strides[1] +
                        i * p.mask_strides[2] + j * p.mask_strides[3]]) {
    x = FA_NEG_INF;
  }
  return x;
}

// ---- conversions (inline PTX; NVRTC sees no cuda_fp16.h) ----

// Two floats to one 32-bit register of two float16 (lo in the low half).
__device__ __forceinline__ unsigned fa_pack_f16(float lo, float hi) {
  unsigned r;
#if __CUDA_ARCH__ >= 800
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
  asm("{\n .reg .f16 a, b;\n cvt.rn.f16.f32 a, %1;\n cvt.rn.f16.f32 b, %2;\n"
      " mov.b32 %0, {a, b};\n}" : "=r"(r) : "f"(lo), "f"(hi));
#endif
  return r;
}

// Two floats to one 32-bit register of two bfloat16, rounded to nearest
// even (before sm_80, which has no bf16 conversion, in integer arithmetic).
__device__ __forceinline__ unsigned fa_pack_bf16(float lo, float hi) {
#if __CUDA_ARCH__ >= 800
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#else
  auto one = [](float f) -> unsigned {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;  // NaN stays NaN
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  };
  return one(lo) | (one(hi) << 16);
#endif
}

__device__ __forceinline__ float fa_f16_to_f32(unsigned short h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

__device__ __forceinline__ float fa_bf16_to_f32(unsigned short h) {
  return __uint_as_float(((unsigned)h) << 16);
}

// q, k, v elements of the kernel's FA_DTYPE, two per register.
__device__ __forceinline__ unsigned fa_pack_in(float lo, float hi) {
#if FA_DTYPE == 1
  return fa_pack_bf16(lo, hi);
#else
  return fa_pack_f16(lo, hi);
#endif
}

// --- Blocks and tiles ---------------------------------------------------------

// What a block of fa_forward owns: query rows [m0, m0 + block_m) of batch b,
// head n (reading key/value head kvh), and split `split` of their key tiles.
// Consecutive blocks share (b, n), so the K/V they stream hit L2 together;
// the splits of one row block are grid-wide apart, and causal row blocks go
// heaviest first to shorten the tail.
struct FaBlock {
  int b, n, kvh, m0, q_len, kv_len, split;
};

__device__ __forceinline__ FaBlock fa_block(const FaParams& p, int block_m) {
  const int num_m = (p.T + block_m - 1) / block_m;
  const int per_split = num_m * p.N * p.B;
  const int split = blockIdx.x / per_split, x = blockIdx.x - split * per_split;
  int mb = x % num_m;
  const int bn = x / num_m;
  const int n = bn % p.N, b = bn / p.N;
  if (p.causal) mb = num_m - 1 - mb;
  return FaBlock{b, n, n / (p.N / p.K), mb * block_m, fa_q_len(p, b), fa_kv_len(p, b), split};
}

// The batch index block `blockIdx.x` writes its rows of batch b under: b, or
// split * B + b under split-KV. Recomputed at the end rather than kept live.
__device__ __forceinline__ int fa_out_batch(const FaParams& p, int block_m, int b) {
  return blockIdx.x / (((p.T + block_m - 1) / block_m) * p.N * p.B) * p.B + b;
}

// A tile of rows of a (B, L, heads, H) 16-bit array: row r at base + r * ld;
// rows >= rows_valid do not exist (loaded as zeros).
struct FaTileSrc {
  const unsigned short* base;
  int ld;
  int rows_valid;
};

// --- Shared memory --------------------------------------------------------------

__device__ __forceinline__ unsigned fa_smem_u32(const void* ptr) {
  unsigned r;
  asm("{\n .reg .u64 t;\n cvta.to.shared.u64 t, %1;\n cvt.u32.u64 %0, t;\n}"
      : "=r"(r) : "l"(ptr));
  return r;
}

#if __CUDA_ARCH__ >= 800
__device__ __forceinline__ void fa_cp_async16(unsigned dst, const void* src, bool valid) {
  // src-size 0 writes zeros without touching global memory: keys past the
  // length (possibly garbage) and rows past T are never read.
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void fa_cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void fa_cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N));
}
#endif

#endif  // __CUDACC_RTC__
