// How the Ascend kernel serves one call: the tile (fa_ascend_tile), its
// buffers against the 910B capacities, the padded shapes, the split-KV count
// and the workspace. One function, asked by the FFI handlers
// (csrc/ffi/attention_ascend_ffi.cc) and by Python (fastattn_jax.ascend.plan,
// through the extension). Host code only.
#pragma once

#include <cstdint>
#include <string>

#include "kernels/ascend/attention_ascend.h"
#include "kernels/split_policy.h"

namespace fastattn::ascend {

struct AscendPlan {
  FaAscendTile tile{};
  FaAscendBuffers buffers{};
  int64_t Tp = 0, Sp = 0;      // T and S padded to whole Br and Bc tiles
  int64_t splits = 1;          // split-KV ways per (b, n, row tile)
  int64_t cores = kFaAscendCores;
  int64_t workspace_floats = 0;
};

// Split-KV only where each split keeps at least this many key tiles, and
// never more than this many ways.
constexpr int64_t kMinTilesPerSplit = 2;
constexpr int64_t kMostSplits = 16;

// Plans a call of q (B, T, N, H) against k, v (B, S, K, H) in `dtype`
// (kFaF16 or kFaBF16). `tile`: the tile to use, or null for fa_ascend_tile's.
// Returns "" or why the call cannot run (head dim, heads, a tile past a
// buffer's capacity).
inline std::string PlanAscend(int64_t B, int64_t T, int64_t S, int64_t N, int64_t K, int64_t H,
                              int64_t dtype, const FaAscendTile* tile, AscendPlan* plan) {
  if (H < 1 || H > kFaAscendMaxHeadDim) {
    return "the Ascend kernel takes head dims 1 to " + std::to_string(kFaAscendMaxHeadDim) +
           ", got H=" + std::to_string(H);
  }
  if (K < 1 || N % K != 0) {
    return "N=" + std::to_string(N) + " query heads do not group over K=" + std::to_string(K) +
           " key/value heads";
  }
  if (dtype != kFaF16 && dtype != kFaBF16) return "dtype must be float16 or bfloat16";
  plan->tile = tile ? *tile : fa_ascend_tile(T, H, dtype);
  const FaAscendTile& t = plan->tile;
  auto fractal = [](int64_t x) { return x > 0 && x % kFaAscendFractal == 0; };
  if (!fractal(t.Br) || !fractal(t.Bc) || !fractal(t.Hp) || t.Hp < H || t.Bb < 1 ||
      t.Br % t.Bb != 0 || t.dtype != dtype) {
    return "tile Br=" + std::to_string(t.Br) + " Bc=" + std::to_string(t.Bc) + " Bb=" +
           std::to_string(t.Bb) + " Hp=" + std::to_string(t.Hp) +
           " is not a 910B Cube tile for H=" + std::to_string(H) +
           " (Br, Bc, Hp multiples of 16, Hp >= H, Bb dividing Br)";
  }
  int64_t used = 0, capacity = 0;
  if (const char* buffer = fa_ascend_overflow(t, &used, &capacity)) {
    return "tile Br=" + std::to_string(t.Br) + " Bc=" + std::to_string(t.Bc) + " Bb=" +
           std::to_string(t.Bb) + " Hp=" + std::to_string(t.Hp) + " needs " +
           std::to_string(used) + " bytes of the 910B's " + buffer + ", which holds " +
           std::to_string(capacity);
  }
  plan->buffers = fa_ascend_buffers(t);
  plan->Tp = fa_ascend_round_up(T < 1 ? 1 : T, t.Br);
  plan->Sp = fa_ascend_round_up(S < 1 ? 1 : S, t.Bc);
  const int64_t units = fa_ascend_units(t, B, plan->Tp, N, 1);
  plan->splits = SplitCount(units, plan->Sp / t.Bc, plan->cores, kMinTilesPerSplit, kMostSplits);
  plan->workspace_floats =
      fa_ascend_workspace_floats(t, B, plan->Tp, N, plan->splits, plan->cores);
  return "";
}

}  // namespace fastattn::ascend
