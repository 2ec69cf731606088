// What every CUDA attention kernel shares: the launch parameters, the
// tiling-mask on top of the index rules (attention_rules.h), the logit
// transform, float <-> 16-bit conversions, which rows a block owns, and the
// shared-memory and cp.async helpers.
//
// Compiled two ways: by NVRTC as part of a kernel (no CUDA headers: the
// conversions are inline PTX), and by the host compiler for the layout of
// the parameter structs, which the FFI handlers fill and pass as a kernel's
// first argument. Includes only the other include-free headers.
//
// Compile-time options of a kernel (NVRTC -D flags, from the variant:
// csrc/cuda/variants.cc):
//   FA_KERNEL_SM  70 (mma.m8n8k4), 75 (mma.m16n8k8), 80 (mma.m16n8k16),
//                 90 (wgmma, sm_90a); the decode kernel: 75 or 80, its build
//   FA_HEAD_DIM   the kernel head dim (attention_tiles.cuh); the call's H may
//                 be smaller: columns past it read as zeros, never written
//   FA_DTYPE      q, k, v element, a code of attention_dtypes.h: FA_F16, or
//                 FA_BF16 (FA_KERNEL_SM >= 80)
//   FA_OUT_DTYPE  out element: FA_F16, FA_BF16 or FA_F32
//   FA_EXTRAS     forward kernels: 1 compiles in bias, mask and soft cap
//                 (each still off when its field is null / 0) and any scale;
//                 0: none of them, and scale > 0
//   FA_FEATURES   forward kernel 90 without extras: 1 compiles in
//                 segment ids and ALiBi (fa_feature_terms); extras builds
//                 always have them
//   FA_DECODE_ROWS  the decode kernel's rows per block (a power of two, fa_decode_rows)
//   FA_DECODE_PAGED the decode kernel: 1 reads k and v through a block table (FaPages)
//   FA_KV_QUANT   the decode kernel (build 80): 0, or FA_I8 / FA_F8E4M3, k and v
//                 a quantized cache of that element, with scales (FaKvScales)
//
// Each kernel source defines
//   extern "C" __global__ void fa_forward(const FaParams p);
//     (FA_KERNEL_SM 90: fa_forward(const FaParams p, const FaTmaMaps maps);
//      the decode kernel: fa_forward(const FaDecodeParams p))
//   extern "C" __constant__ int fa_params_bytes;  // sizeof its parameters
// and is launched with fa_forward_tile / fa_decode_tile's threads and
// dynamic shared memory; grids: fa_forward_units below, each unit split in
// FaSplitKV::parts (kernel 90: at most one wave of persistent blocks walking
// them), and the decode kernel's lean partition (attention_decode.cu).
#pragma once

#include "attention_dtypes.h"
#include "attention_rules.h"
#include "attention_tiles.cuh"

#ifndef __CUDACC_RTC__
#include <cstdint>
static_assert(sizeof(long long) == 8 && sizeof(void*) == 8, "64-bit only");
#endif

// The operands of a call, all device pointers: q (B, T, N, H), k and v
// (B, S, K, H) 16-bit, out (B, T, N, H) of FA_OUT_DTYPE, lse (B, T, N)
// float32. Element (b, t, n, e) of q is q[b * q_stride[0] + t * q_stride[1] +
// n * q_stride[2] + e], and likewise k and v (one layout), out and lse (no e):
// no caller pads or copies an operand to fit a kernel.
struct FaOperands {
  const void* q;
  const void* k;
  const void* v;
  void* out;           // written everywhere
  float* lse;          // natural-log LSE of the final logits; -inf for a row
                       // that sees no key
  long long q_stride[3];
  long long kv_stride[3];
  long long out_stride[3];
  long long lse_stride[3];
  const int* kv_lens;  // (B,): keys >= kv_lens[b] are never read; or null
  int B, T, S, N, K;   // query head n reads key/value head n / (N / K)
  int H;               // the rows' length in memory, a multiple of
                       // kFaRowAlign, at most FA_HEAD_DIM
};

// Split-KV (Flash-Decoding, attention_split.cuh): a launch's units (a forward
// row block, a decode head) are cut into segments whose partial softmaxes the
// last one to finish merges. Null pointers when nothing is split.
struct FaSplitKV {
  float* partial_out;  // (slots, rows, H): each segment's normalized rows
  float* partial_lse;  // (slots, rows): their LSE (natural, as lse's)
  unsigned* counters;  // (units): segments finished, zero between launches
  int parts;           // forward: splits per unit (1: none); decode: blocks
                       // of the lean partition
};

struct FaParams : FaOperands {
  const float* bias;           // broadcast to (B, N, T, S) by bias_strides; or null
  const unsigned char* mask;   // bool, broadcast by mask_strides; or null
  long long bias_strides[4];   // element strides for b, n, t, s (0: broadcast)
  long long mask_strides[4];
  const int* q_lens;           // (B,): rows >= q_lens[b] see no key; or null
  FaRules rules;
  FaSplitKV split;
  FaFeatures features;         // sinks (forward kernels), segment ids and ALiBi
                               // (FA_EXTRAS and FA_FEATURES kernels)
};

// The backward kernels' (attention_backward.cu): the forward's operands and
// lse, the cotangent d_out (out's layout: out_stride), D = rowsum(dO o O) -
// dLSE and rowsum(|dO o O|) (lse's layout), and the gradients: dq in out's layout, dk and dv in
// dkv_stride's, all of FA_OUT_DTYPE. `out` itself is not read; split.parts
// is 1.
struct FaGradParams : FaParams {
  const void* d_out;
  const float* delta;
  const float* magnitude;  // lse's layout; read only where P = 1 (attention_grad.cuh)
  void* dq;
  void* dk;
  void* dv;
  long long dkv_stride[3];
};

// A paged KV cache (FaDecodeParams): k and v are pools of pages of
// 2^page_shift positions, (pages, page size, K, H) with kv_stride[0] the
// stride of a page; position j of sequence b lives at row j % page size of
// page block_table[b * max_pages + j / page size] (clamped to [0, pages)).
struct FaPages {
  const int* block_table;  // (B, max_pages); null: k and v are (B, S, K, H)
  int max_pages;
  int pages;
  int page_shift;
};

// A quantized KV cache's float32 scales (FaDecodeParams): the key at
// position j of head kvh of sequence b is k[...] * k[b * k_stride[0] + j *
// k_stride[1] + kvh * k_stride[2]] (a paged cache: page and row in place of b
// and j), and likewise v; a stride is 0 where the scale is broadcast.
struct FaKvScales {
  const float* k;
  const float* v;
  long long k_stride[3];
  long long v_stride[3];
};

// The decode kernel's: no bias, mask or query lengths (the host sends such
// calls to the forward kernels); the only kernel that reads a paged or a
// quantized cache.
struct FaDecodeParams : FaOperands {
  FaRules rules;
  FaSplitKV split;
  FaPages paged;
  FaKvScales scales;
};

// A TMA descriptor (the driver's CUtensorMap, filled by
// cuTensorMapEncodeTiled on the host).
struct alignas(128) FaTensorMap {
  unsigned long long opaque[16];
};

// FA_KERNEL_SM 90's TMA descriptors: q as (H, N, T, B) and k, v as (H, K, S,
// B), innermost first, 16-bit elements; boxes of {64, 1, rows, 1} (rows = Br
// for q, Bc for k and v) with the 128-byte swizzle; reads past H, T or S give
// zeros.
struct FaTmaMaps {
  FaTensorMap q, k, v;
};

// The forward kernels' grid: ceil(T / Br) * N * B units, each split in
// `parts` (FaSplitKV). Host and device compute it here.
FA_HOST_DEVICE long long fa_forward_units(const FaOperands& p, int Br) {
  return (long long)((p.T + Br - 1) / Br) * p.N * p.B;
}

// Persistent kernel 90's schedule: the work block (fa_block_at's index, in
// [0, work)) that block i of a grid of G takes at its step k; -1 for none at
// that step; `work` or more once it has no more. Block i of a call that is
// not causal takes i, i + G, i + 2G, ... Under causal masking (each head's
// num_m row blocks heaviest first, fa_block_at) it takes pairs i, i + G, ...:
// row blocks j and num_m - 1 - j of one head and split, the heavier first,
// together num_m + 1 row blocks' keys whatever j. (A plain stride gives a
// block the same row block of every head: on 16 heads of 128 row blocks
// the busiest would have 1.57x the mean's keys.)
FA_HOST_DEVICE int fa_persistent_index(bool causal, int num_m, int work, int G, int i, int k) {
  if (!causal) return i + k * G;
  const int half = (num_m + 1) / 2;
  const int pair = i + (k >> 1) * G;
  if (pair >= work / num_m * half) return work;
  const int h = pair / half, j = pair - h * half;
  if ((k & 1) == 0) return h * num_m + j;
  return num_m - 1 - j == j ? -1 : h * num_m + num_m - 1 - j;
}

#ifdef __CUDACC_RTC__

namespace {

// The compute capability being compiled for, as attention_tiles.cuh and the
// host encode a GPU (10 * major + minor; __CUDA_ARCH__ is 10 times that).
constexpr int kFaCc = __CUDA_ARCH__ / 10;

// The tile of the variant being compiled: what KernelVariant::Tile gives the
// host (csrc/cuda/variants.cc), from the same function for its kind, picked
// by the defines the variant sets. Its Br and Bc are the kernels' kBr and kBc.
constexpr FaTile kTile =
#if defined(FA_DECODE_ROWS)
    fa_decode_tile(FA_KERNEL_SM, FA_DECODE_ROWS, FA_HEAD_DIM, kFaCc, FA_KV_QUANT != 0);
#elif defined(FA_ATOMIC_DQ)
    fa_backward_tile(FA_KERNEL_SM, FA_HEAD_DIM, FA_ATOMIC_DQ);
#else
    fa_forward_tile(FA_KERNEL_SM, FA_HEAD_DIM, FA_EXTRAS, kFaCc);
#endif
constexpr int kBr = kTile.Br;
constexpr int kBc = kTile.Bc;

}  // namespace

#define FA_NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ int fa_q_len(const FaParams& p, int b) {
  return p.q_lens ? min(max(p.q_lens[b], 0), p.T) : p.T;
}

__device__ __forceinline__ int fa_kv_len(const FaOperands& p, int b) {
  return p.kv_lens ? min(max(p.kv_lens[b], 0), p.S) : p.S;
}

// The key tiles of Bc keys, [*t_begin, *t_end), that cover keys [lo, hi).
__device__ __forceinline__ void fa_key_tiles(int lo, int hi, int Bc, int* t_begin, int* t_end) {
  *t_begin = lo / Bc;
  *t_end = hi > lo ? (hi + Bc - 1) / Bc : *t_begin;
}

// Split-KV: the share [*t_begin, *t_end) of the key tiles that split `split`
// of `parts` walks (contiguous, as even as whole tiles allow).
__device__ __forceinline__ void fa_split_tiles(int split, int parts, int* t_begin, int* t_end) {
  const int per = (*t_end - *t_begin + parts - 1) / parts;
  *t_begin = min(*t_end, *t_begin + split * per);
  *t_end = min(*t_end, *t_begin + per);
}

// The index rules for one (row, key) pair.
__device__ __forceinline__ bool fa_visible(const FaRules& r, int q_len, int kv_len, int i, int j) {
  int lo, hi;
  fa_row_keys(r, q_len, kv_len, i, &lo, &hi);
  return j >= lo && j < hi;
}

// Offsets (elements) of row (b, t, n) in a tensor of the given strides.
__device__ __forceinline__ long long fa_at(const long long (&stride)[3], int b, int t, int n) {
  return b * stride[0] + t * stride[1] + n * stride[2];
}

// 2^x, the fast hardware approximation the softmax runs on.
__device__ __forceinline__ float fa_ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

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

// ALiBi for query row i of head n: its slope (0 without ALiBi) and key
// position, read once per row (and tile) rather than per logit.
struct FaAlibiRow {
  float slope;
  int pos;
};

__device__ __forceinline__ FaAlibiRow fa_alibi_row(const FaParams& p, int b, int n, int i) {
  const FaFeatures& f = p.features;
  if (!f.alibi) return {0.f, 0};
  return {fa_alibi_slope(f, b, n),
          p.rules.end_aligned ? fa_row_pos(p.rules, fa_q_len(p, b), fa_kv_len(p, b), i) : i};
}

// x with ALiBi's term of key j added (x itself where the slope is 0),
// forward and backward alike.
__device__ __forceinline__ float fa_add_alibi(float x, const FaAlibiRow& a, int j) {
  return a.slope != 0.f ? x + fa_alibi_term(a.slope, a.pos, j) : x;
}

// The logit of a visible (row i, key j) from the raw q . k; -inf if masked.
// Only for FA_EXTRAS kernels; the others take x * scale. `alibi`: row i's
// (fa_alibi_row).
__device__ __forceinline__ float fa_extras_logit(const FaParams& p, float qk, int b, int n,
                                                 int i, int j, const FaAlibiRow& alibi) {
  float x = __fmul_rn(qk, p.rules.scale);  // rounded on its own, as the backward's
  if (p.rules.softcap > 0.f) x = p.rules.softcap * fa_tanh(x / p.rules.softcap);
  if (p.bias) {
    x += p.bias[b * p.bias_strides[0] + n * p.bias_strides[1] +
                i * p.bias_strides[2] + j * p.bias_strides[3]];
  }
  x = fa_add_alibi(x, alibi, j);
  if (p.mask && !p.mask[b * p.mask_strides[0] + n * p.mask_strides[1] +
                        i * p.mask_strides[2] + j * p.mask_strides[3]]) {
    x = FA_NEG_INF;
  }
  if (!fa_same_segment(p.features, p.T, p.S, b, i, j)) x = FA_NEG_INF;
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
#if FA_DTYPE == FA_BF16
  return fa_pack_bf16(lo, hi);
#else
  return fa_pack_f16(lo, hi);
#endif
}


constexpr float kFaLog2e = 1.4426950408889634f;
constexpr float kFaLn2 = 0.6931471805599453f;

// The softmax's units, one convention for every kernel, forward and backward
// (the CPU kernel's too): a logit x = scale q.k (soft-capped, biased) is
// natural; a row's maximum m is subtracted in those units and only the
// difference goes to log2 units for ex2, p = 2^((x - m) log2 e); the LSE is
// m + ln(l), natural. So a row's largest logit gets p = 1 exactly, and the
// backward's P = 2^((x - LSE) log2 e) is exactly 1 where the forward's was
// (a row's only key) at any magnitude: subtracting in log2 units instead
// (2^(x log2 e - m2), one fma) leaves the rounding of x log2 e, which
// logits of 1e3 to 1e5 turn into errors of P of 1e-4 to 1e-2, and dQ
// multiplies them by the scale. Kernels without extras keep raw q.k and raw
// maxima (scale > 0 commutes with the maximum), x - m = (s - m_s) scale:
// their units are fa_units(scale); those with extras keep natural logits,
// fa_units(1).
struct FaUnits {
  float to_nat;   // kept logits and maxima, times this: natural logits
  float to_log2;  // to_nat * log2(e)
};

__device__ __forceinline__ FaUnits fa_units(float to_nat) { return {to_nat, to_nat * kFaLog2e}; }

// 2^((x - m) to_log2): the weight of a kept logit x against the kept
// maximum m (both finite, or x = -inf: 0).
__device__ __forceinline__ float fa_weight(float x, float m, float to_log2) {
  return fa_ex2((x - m) * to_log2);
}

// The natural LSE of a row of kept maximum m and sum l (-inf where l = 0:
// no visible key). Once per row, so logf, exact at l = 1 where lg2.approx
// is not (and a row's only key would get P = 1 - 2^-24).
__device__ __forceinline__ float fa_lse(float m, float l, float to_nat) {
  return l == 0.f ? FA_NEG_INF : __fmul_rn(m, to_nat) + logf(l);
}

// out[at .. at + 3] in FA_OUT_DTYPE.
__device__ __forceinline__ void fa_store_quad(void* out, long long at, const float (&x)[4]) {
#pragma unroll
  for (int f = 0; f < 4; f += 2) {
#if FA_OUT_DTYPE == FA_F32
    static_cast<float*>(out)[at + f] = x[f];
    static_cast<float*>(out)[at + f + 1] = x[f + 1];
#elif FA_OUT_DTYPE == FA_BF16
    *reinterpret_cast<unsigned*>(static_cast<unsigned short*>(out) + at + f) =
        fa_pack_bf16(x[f], x[f + 1]);
#else
    *reinterpret_cast<unsigned*>(static_cast<unsigned short*>(out) + at + f) =
        fa_pack_f16(x[f], x[f + 1]);
#endif
  }
}

// --- Blocks and tiles ---------------------------------------------------------

// What block `index` of fa_forward's work (fa_forward_units * parts blocks,
// split-major) owns: query rows [m0, m0 + Br) of batch b,
// head n (reading key/value head kvh), and split `split` of their key tiles:
// unit `unit` of fa_forward_units. [t_begin, t_end) are the tiles of Bc
// keys it walks: its split's share of those covering the keys [lo, hi) that
// some row of the block sees. Consecutive blocks share (b, n), so the K/V
// they stream hit L2 together; the splits of one unit are grid-wide apart,
// and causal row blocks go heaviest first to shorten the tail.
struct FaBlock {
  int b, n, kvh, m0, q_len, kv_len, split, unit, lo, hi, t_begin, t_end;
};

__device__ __forceinline__ FaBlock fa_block_at(const FaParams& p, int Br, int Bc, int index) {
  const int num_m = (p.T + Br - 1) / Br;
  const int units = num_m * p.N * p.B;
  FaBlock k;
  k.split = index / units;
  k.unit = index - k.split * units;
  int mb = k.unit % num_m;
  const int bn = k.unit / num_m;
  k.n = bn % p.N, k.b = bn / p.N;
  if (p.rules.causal) mb = num_m - 1 - mb;
  k.kvh = k.n / (p.N / p.K);
  k.m0 = mb * Br;
  k.q_len = fa_q_len(p, k.b), k.kv_len = fa_kv_len(p, k.b);
  fa_rows_keys(p.rules, k.q_len, k.kv_len, k.m0, k.m0 + Br, &k.lo, &k.hi);
  fa_segment_keys(p.features, p.T, k.b, k.m0, k.m0 + Br, &k.lo, &k.hi);
  fa_key_tiles(k.lo, k.hi, Bc, &k.t_begin, &k.t_end);
  fa_split_tiles(k.split, p.split.parts, &k.t_begin, &k.t_end);
  return k;
}

// The block this launch's block blockIdx.x owns, where the grid holds one
// block per unit and split.
__device__ __forceinline__ FaBlock fa_block(const FaParams& p, int Br, int Bc) {
  return fa_block_at(p, Br, Bc, blockIdx.x);
}

// A tile of rows of a (B, L, heads, H) 16-bit array: row r at base + r * ld;
// rows >= rows_valid do not exist and columns >= cols (the call's H) are
// not read: both load as zeros.
struct FaTileSrc {
  const unsigned short* base;
  long long ld;
  int rows_valid;
  int cols;
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
