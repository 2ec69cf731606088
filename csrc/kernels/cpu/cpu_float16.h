// IEEE binary16 and bfloat16 <-> binary32 conversions by bit manipulation (no library, no F16C
// requirement), and the widening of a quantized cache's float8_e4m3fn and int8 elements. Internal
// to the CPU attention kernel.
//
// Widening is branch-free so that tile-loading loops auto-vectorize under the wider targets, and it
// never forms a subnormal float: the results do not depend on the flush-to-zero /
// denormals-are-zero bits a host thread may have set. Narrowing rounds to nearest, ties to even,
// and keeps NaN a (quiet) NaN.
#pragma once

#include <cstdint>
#include <cstring>

namespace fastattn {
namespace cpu {

struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};
// float8_e4m3fn (Micikevicius et al., "FP8 Formats for Deep Learning", 2022): 1 sign, 4 exponent
// bits of bias 7, 3 mantissa bits; no infinities, S.1111.111 is NaN; subnormals m * 2^-9.
struct Float8E4M3 {
  uint8_t bits;
};

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float to_float(float x) { return x; }

inline float to_float(BFloat16 x) { return bits_float(uint32_t{x.bits} << 16); }

inline float to_float(Half x) {
  const uint32_t sign = uint32_t{x.bits & 0x8000u} << 16;
  const uint32_t em = x.bits & 0x7fffu;  // exponent and mantissa fields
  // Normal: rebias the exponent from 15 to 127. Inf/NaN: all-ones exponent, payload kept.
  // Subnormal or zero: the value is em * 2^-24, exact through an integer conversion.
  const uint32_t normal = (em << 13) + (112u << 23);
  const uint32_t inf_nan = (em << 13) | 0x7f800000u;
  const uint32_t subnormal = float_bits(static_cast<float>(static_cast<int32_t>(em)) * 0x1p-24f);
  const uint32_t magnitude = em >= 0x7c00u ? inf_nan : (em >= 0x0400u ? normal : subnormal);
  return bits_float(magnitude | sign);
}

inline float to_float(int8_t x) { return static_cast<float>(x); }

// With bitwise selects rather than conditionals: GCC vectorizes a loop of these only without
// control flow.
inline float to_float(Float8E4M3 x) {
  const uint32_t sign = uint32_t{x.bits & 0x80u} << 24;
  const uint32_t em = x.bits & 0x7fu;  // exponent and mantissa fields
  // Normal: rebias the exponent from 7 to 127. Subnormal or zero: em * 2^-9, exact through an
  // integer conversion. 0x7f: NaN.
  const uint32_t normal = (em << 20) + (120u << 23);
  const uint32_t subnormal = float_bits(static_cast<float>(static_cast<int32_t>(em)) * 0x1p-9f);
  const uint32_t is_normal = 0u - uint32_t{em >= 0x08u};
  const uint32_t is_nan = 0u - uint32_t{em == 0x7fu};
  const uint32_t magnitude = (normal & is_normal) | (subnormal & ~is_normal);
  return bits_float((0x7fc00000u & is_nan) | (magnitude & ~is_nan) | sign);
}

template <class T>
T from_float(float f);

template <>
inline float from_float<float>(float f) {
  return f;
}

template <>
inline BFloat16 from_float<BFloat16>(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return BFloat16{static_cast<uint16_t>((u >> 16) | 0x40u)};
  return BFloat16{static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}

template <>
inline Half from_float<Half>(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  uint32_t h;
  if (a > 0x7f800000u) {
    h = 0x7e00u | ((a >> 13) & 0x3ffu);  // NaN: quiet, top payload bits kept
  } else if (a >= 0x477ff000u) {
    h = 0x7c00u;  // >= 65520 rounds to infinity
  } else if (a >= 0x38800000u) {
    // Normal half (>= 2^-14): rebias, then round the 13 dropped bits to nearest even.
    h = (a - (112u << 23) + 0xfffu + ((a >> 13) & 1u)) >> 13;
  } else if (a >= 0x33000000u) {
    // Subnormal half: value / 2^-24 = significand >> (126 - exponent), shift in [14, 24].
    const uint32_t shift = 126u - (a >> 23);
    const uint32_t significand = (a & 0x7fffffu) | 0x800000u;
    h = (significand + (1u << (shift - 1)) - 1u + ((significand >> shift) & 1u)) >> shift;
  } else {
    h = 0;  // <= 2^-25 rounds to zero
  }
  return Half{static_cast<uint16_t>(sign | h)};
}

}  // namespace cpu
}  // namespace fastattn
