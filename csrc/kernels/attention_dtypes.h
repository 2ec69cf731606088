// The element types' one numbering, for every layer: the CPU kernel, the
// CUDA kernels (built with -DFA_DTYPE= and -DFA_OUT_DTYPE=, and named by
// variant keys that hold the codes), the Ascend kernel (-DFA_DTYPE=), the FFI
// handlers and Python (fastattn_jax.shapes.DTYPE_CODES, from the extension's
// dtype_codes()). A code crosses each of those boundaries as a bare integer,
// so the numbers are written once, here.
//
// No includes: compiled by the host compiler, NVRTC, clang and bisheng.
#pragma once

// The codes as the preprocessor sees them, for the kernels' #if on FA_DTYPE
// and FA_OUT_DTYPE (an enumerator there would read as 0).
#define FA_F16 0
#define FA_BF16 1
#define FA_F32 2
// A quantized KV cache's elements (read with float32 scales beside them).
#define FA_I8 3
#define FA_F8E4M3 4

enum FaDtype : int {
  kFaF16 = FA_F16,
  kFaBF16 = FA_BF16,
  kFaF32 = FA_F32,
  kFaI8 = FA_I8,
  kFaF8E4M3 = FA_F8E4M3,
};
