// What the Volta kernels (attention_volta.cu, the forward; attention_backward_volta.cu)
// share: mma.m8n8k4 wrappers, the exchange that turns an 8x8 block of f32
// accumulators into A operands, and the shared-memory layout of padded rows
// with its bank-conflict-free tile copies. attention_volta.cu's header
// comment derives the fragment layouts, the exchange and the layout.
#pragma once

#include "attention_split.cuh"

namespace {

constexpr int kH = FA_HEAD_DIM;
constexpr int kS = kH / 4 + 1;  // row stride in 8-byte chunks (odd)

// Index (in 8-byte chunks) of chunk c of row r.
__device__ __forceinline__ int chunk_at(int r, int c) { return r * kS + c; }

// 16-byte chunk j of row r (row-major source) to shared memory, as two 8-byte
// halves (rows start at odd chunks).
__device__ __forceinline__ void put16(uint2* dst, int r, int j, const uint4& v) {
  const int c = chunk_at(r, 2 * j);
  dst[c] = make_uint2(v.x, v.y);
  dst[c + 1] = make_uint2(v.z, v.w);
}

// Item idx of a (kRows, H) tile copy -> (row r, 16-byte chunk j). A half-warp
// of items covers 8 chunks of rows r, r + 1 (each row fills 16 consecutive
// bank pairs, kS odd puts the two rows on opposite parities), or, for the
// last 4 chunks when H / 8 = 4 mod 8, rows r, r + 1, r + 8, r + 9 (kS = 9 mod
// 16 there, so rows 8 apart fill complementary halves of the 16 bank pairs).
template <int kRows>
__device__ __forceinline__ void item_rc(int idx, int& r, int& j) {
  constexpr int kG = kH / 64;  // groups of 8 chunks per row
  constexpr int kMain = kRows * 8 * kG;
  if constexpr (kG > 0) {
    if (idx < kMain) {
      r = 2 * (idx / (16 * kG)) + ((idx >> 3) & 1);
      j = 8 * ((idx >> 4) % kG) + (idx & 7);
      return;
    }
  }
  const int t = idx - kMain, hw = t >> 4;
  r = ((t >> 2) & 1) + 8 * ((t >> 3) & 1) + 2 * (hw & 3) + 16 * (hw >> 2);
  j = 8 * kG + (t & 3);
}

__device__ __forceinline__ void mma_rc(float* d, const uint2& a, const uint2& b) {
  asm volatile(
      "mma.sync.aligned.m8n8k4.row.col.f32.f16.f16.f32 {%0,%1,%2,%3,%4,%5,%6,%7},"
      " {%8,%9}, {%10,%11}, {%0,%1,%2,%3,%4,%5,%6,%7};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
        "+f"(d[6]), "+f"(d[7])
      : "r"(a.x), "r"(a.y), "r"(b.x), "r"(b.y));
}

__device__ __forceinline__ void mma_rr(float* d, const uint2& a, const uint2& b) {
  asm volatile(
      "mma.sync.aligned.m8n8k4.row.row.f32.f16.f16.f32 {%0,%1,%2,%3,%4,%5,%6,%7},"
      " {%8,%9}, {%10,%11}, {%0,%1,%2,%3,%4,%5,%6,%7};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
        "+f"(d[6]), "+f"(d[7])
      : "r"(a.x), "r"(a.y), "r"(b.x), "r"(b.y));
}

__device__ __forceinline__ unsigned shfl_xor2(unsigned x) {
  unsigned y;
  asm volatile("shfl.sync.bfly.b32 %0, %1, 2, 0x1f, 0xffffffff;" : "=r"(y) : "r"(x));
  return y;
}

__device__ __forceinline__ float shfl_xor2f(float x) {
  return __uint_as_float(shfl_xor2(__float_as_uint(x)));
}

// The n-tile (8 columns of H) of a lane's j-th accumulator of kTiles, in
// column part `part` of kParts (1 or 2). Two parts read B columns 2 kTiles
// chunks apart, which with kS odd hits 8 distinct bank pairs unless the gap
// is 0 mod 16; then the parts take alternate blocks of four n-tiles (gap 8).
template <int kParts, int kTiles>
__device__ __forceinline__ int volta_col_tile(int j, int part) {
  constexpr bool kInterleave = kParts == 2 && (2 * kTiles) % 16 == 0;
  if (kParts == 1) return j;
  return kInterleave ? (j & 3) + 4 * part + 8 * (j >> 2) : part * kTiles + j;
}

// An 8 x 8 block of f32 accumulators (C layout: element e at row (e & 2) +
// t0, column (e & 4) + (e & 1) + 2 t1) as the A operands of its two k4
// steps (lane's A row t0 + 2 t1, k = columns 0..3, then 4..7), rounded to
// f16 pairs: half the elements cross to the bit-1 partner, one shuffle per
// f16x2 register.
__device__ __forceinline__ void volta_pack_a(const float (&e)[8], int t1, unsigned (&lo)[2],
                                             unsigned (&hi)[2]) {
  const unsigned p01 = fa_pack_f16(e[0], e[1]), p23 = fa_pack_f16(e[2], e[3]);
  const unsigned p45 = fa_pack_f16(e[4], e[5]), p67 = fa_pack_f16(e[6], e[7]);
  const unsigned x0 = shfl_xor2(t1 ? p01 : p23);
  const unsigned x1 = shfl_xor2(t1 ? p45 : p67);
  lo[0] = t1 ? x0 : p01;
  lo[1] = t1 ? p23 : x0;
  hi[0] = t1 ? x1 : p45;
  hi[1] = t1 ? p67 : x1;
}

// Item i of the (kRows, kH) block whose row r starts at src + r * stride
// (elements), to shared memory; rows at or past `valid` are zero-filled, never
// read.
template <int kRows>
__device__ __forceinline__ void load_rows(uint2* dst, const unsigned short* src,
                                          long long stride, int valid, int cols, int i) {
  int r, j;
  item_rc<kRows>(i, r, j);
  uint4 v = make_uint4(0, 0, 0, 0);
  if (r < valid && j * 8 < cols) v = *reinterpret_cast<const uint4*>(src + r * stride + j * 8);
  put16(dst, r, j, v);
}

}  // namespace
