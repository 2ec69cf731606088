// Decode attention: the few query rows of a decode step (T new tokens times
// the G = N / K query heads sharing one key/value head, T * G <= kRows) over
// a long KV cache, with split-KV and the split merge in one launch. Every
// CUDA path (sm_70 and newer) uses it for such steps.
//
// The work is memory-bound (about 2 * T * G flops per byte of K and V), so it
// runs on CUDA cores in float32 and reads float16 or bfloat16 alike; what
// matters is streaming K and V once, at full bandwidth, from enough blocks to
// fill the GPU. Block (b, kvh, split) holds all T * G rows of its key/value
// head and walks its share of the keys. In each warp, kLanesPerKey lanes
// share one key, each holding a 16-byte chunk of its K and V rows; a load
// step covers kKeysPerWarp keys per warp, and an iteration kSteps steps,
// fetched ahead of use (FA_PATH 80: cp.async into a shared-memory ring;
// FA_PATH 75: registers). Each key's q . k is summed over its lanes by
// butterfly shuffles, so every lane of the key holds the logit and updates its
// own O chunk; the online softmax (FlashAttention-2, log2 domain) rescales
// once per kSteps steps. Lane groups, then warps (through shared memory), are
// merged by their maxima at the end.
//
// Split-KV (Flash-Decoding): with p.kv_splits > 1 each block writes its
// normalized rows and their LSE to p.partial_out / p.partial_lse, counts
// itself in p.counters[b * K + kvh] (zeroed by the host before the launch),
// and the last block of each (b, kvh) merges the splits by LSE and writes
// out and lse. The index rules (end-aligned causal among the T rows, window,
// key lengths) are those of attention_common.cuh.
//
// Compile-time options beyond attention_common.cuh's: FA_DECODE_ROWS (1, 2,
// 4 or 8), the rows a block holds; FA_PATH is 75 (no cp.async: the sm_70
// and sm_75 paths) or 80 (the sm_80 and sm_90 paths). FA_GENERAL does not
// apply: any scale and the soft cap are handled at run time; bias and mask
// are not supported (the host never sends them here). H need only be a
// multiple of 8 up to FA_HEAD_DIM.
#include "attention_common.cuh"

namespace {

constexpr int kRows = FA_DECODE_ROWS;
constexpr int kH = FA_HEAD_DIM;
static_assert(kRows == 1 || kRows == 2 || kRows == 4 || kRows == 8, "rows");
static_assert(kH % 32 == 0 && kH >= 32 && kH <= 256, "head dim");
constexpr int kChunks = kH / 8;  // 16-byte chunks of a row
constexpr int kLanesPerKey = kChunks <= 4 ? 4 : kChunks <= 8 ? 8 : kChunks <= 16 ? 16 : 32;
constexpr int kKeysPerWarp = 32 / kLanesPerKey;
constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
#if FA_PATH >= 80
// FA_PATH 80 (sm_80 and newer): cp.async copies each lane's K and V chunks into its own
// slots of a shared-memory ring of kStages iterations, kStages - 1 of them in
// flight while one is computed. Each lane reads back only what it copied, so
// no barrier is needed.
constexpr int kStages = 4;
constexpr int kSteps = kRows <= 4 ? 4 : 2;
#else
// FA_PATH 75 (sm_70, sm_75): plain loads of kSteps steps into registers,
// all issued before any is used; more rows mean more registers for q and O,
// and more math per byte to hide the latency behind. (One row with 8 steps
// made ptxas cap sm_75 at 96 registers and spill.)
constexpr int kStages = 0;
constexpr int kSteps = kRows == 2 ? 8 : kRows == 8 ? 2 : 4;
#endif
constexpr int kKeysPerIter = kWarps * kKeysPerWarp * kSteps;
constexpr int kRingBytes = kStages * kSteps * 2 * kThreads * 16;
// Largest p.kv_splits (the host's limit; sizes the merge weights).
constexpr int kMaxSplits = 128;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

struct alignas(16) Chunk {
  unsigned w[4];
};

// Eight FA_DTYPE elements to float.
__device__ __forceinline__ void unpack(const Chunk& c, float (&f)[8]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#if FA_DTYPE == 1
    f[2 * i] = __uint_as_float(c.w[i] << 16);
    f[2 * i + 1] = __uint_as_float(c.w[i] & 0xffff0000u);
#else
    f[2 * i] = fa_f16_to_f32(c.w[i] & 0xffffu);
    f[2 * i + 1] = fa_f16_to_f32(c.w[i] >> 16);
#endif
  }
}

// Floats written by another block of this launch: read from L2, not L1.
__device__ __forceinline__ float load_l2(const float* ptr) {
  float x;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(x) : "l"(ptr));
  return x;
}

__device__ __forceinline__ void load_l2(const float* ptr, float (&x)[4]) {
  asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(x[0]), "=f"(x[1]), "=f"(x[2]), "=f"(x[3]) : "l"(ptr));
}

// out[at .. at + 3] in FA_OUT_DTYPE.
__device__ __forceinline__ void store_quad(void* out, long long at, const float (&x)[4]) {
#pragma unroll
  for (int f = 0; f < 4; f += 2) {
#if FA_OUT_DTYPE == 2
    static_cast<float*>(out)[at + f] = x[f];
    static_cast<float*>(out)[at + f + 1] = x[f + 1];
#elif FA_OUT_DTYPE == 1
    *reinterpret_cast<unsigned*>(static_cast<unsigned short*>(out) + at + f) =
        fa_pack_bf16(x[f], x[f + 1]);
#else
    *reinterpret_cast<unsigned*>(static_cast<unsigned short*>(out) + at + f) =
        fa_pack_f16(x[f], x[f + 1]);
#endif
  }
}

// (m, l) of two online softmaxes over disjoint keys -> the merged one; the
// weights a and c to apply to their O.
__device__ __forceinline__ void merge_stats(float& m, float& l, float m_o, float l_o, float& a,
                                            float& c) {
  const float mx = fmaxf(m, m_o);
  const float mu = mx == FA_NEG_INF ? 0.f : mx;  // both empty: weights 0, not NaN
  a = fa_ex2(m - mu);
  c = fa_ex2(m_o - mu);
  l = l * a + l_o * c;
  m = mx;
}

}  // namespace

extern "C" __constant__ int fa_launch[4] = {kRows, kThreads, kRingBytes, kKeysPerIter};

extern "C" __global__ void __launch_bounds__(kThreads) fa_forward(const FaParams p) {
  __shared__ float s_o[kWarps][kRows][kH];
  __shared__ float s_m[kWarps][kRows], s_l[kWarps][kRows];
  __shared__ float s_w[kMaxSplits][kRows];
  __shared__ int s_last;

  const int G = p.N / p.K, rows = p.T * G;
  const int split = blockIdx.x % p.kv_splits, bk = blockIdx.x / p.kv_splits;
  const int kvh = bk % p.K, b = bk / p.K;
  const int kv_len = fa_kv_len(p, b);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int slot = lane / kLanesPerKey, chunk = lane % kLanesPerKey;
  const bool active = chunk < kChunks && chunk * 8 < p.H;

  // This split's keys: a contiguous share, in whole iterations' worth.
  int lo, hi;
  fa_key_range(p, b, 0, p.T, &lo, &hi);
  const int all_iters = hi > lo ? (hi - lo + kKeysPerIter - 1) / kKeysPerIter : 0;
  const int per = (all_iters + p.kv_splits - 1) / p.kv_splits * kKeysPerIter;
  const int k0 = min(hi, lo + split * per), k1 = min(hi, k0 + per);

  // Row r is query (t, g) = (r / G, r % G), head kvh * G + g: row `row_of(r)`
  // of the (B * T * N, H) query, out and (B * T * N) lse.
  auto row_of = [&](int r) -> long long {
    return (long long)(b * p.T + r / G) * p.N + kvh * G + r % G;
  };
  float q[kRows][8];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    Chunk c{};
    if (r < rows && active) {
      const long long at = row_of(r) * p.H + chunk * 8;
      c = *reinterpret_cast<const Chunk*>(static_cast<const unsigned short*>(p.q) + at);
    }
    unpack(c, q[r]);
    // Logits in the log2 domain straight from the dot product.
#pragma unroll
    for (int e = 0; e < 8; ++e) q[r][e] *= p.scale * kLog2e;
  }

  float m[kRows], l[kRows], o[kRows][8];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    m[r] = FA_NEG_INF;
    l[r] = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) o[r][e] = 0.f;
  }

  const long long key_stride = (long long)p.K * p.H;
  const long long head_at = ((long long)b * p.S * p.K + kvh) * p.H + chunk * 8;
  const unsigned short* k_head = static_cast<const unsigned short*>(p.k) + head_at;
  const unsigned short* v_head = static_cast<const unsigned short*>(p.v) + head_at;
  // Rules beyond the block's key range: causal among several rows, windows.
  const bool per_row = (p.causal && p.T > 1) || p.window_left >= 0 || p.window_right >= 0;
  // Soft cap c on logits x: c tanh(x / c), in the log2 domain with c log2(e).
  const float softcap2 = p.softcap * kLog2e;

  const int iters = k1 > k0 ? (k1 - k0 + kKeysPerIter - 1) / kKeysPerIter : 0;
#if FA_PATH >= 80
  // Ring slot (stage, step u, K or V) of this lane.
  extern __shared__ Chunk ring[];
  auto slot_of = [&](int stage, int u, int kv) {
    return ring + ((stage * kSteps + u) * 2 + kv) * kThreads + threadIdx.x;
  };
  // Copies iteration n's chunks (zeros past the keys, or past the last iteration).
  auto issue = [&](int n) {
    const int stage = n % kStages;
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      const int jn = k0 + n * kKeysPerIter + (u * kWarps + warp) * kKeysPerWarp + slot;
      const bool valid = active && n < iters && jn < k1;
      const long long at = valid ? jn * key_stride : 0;
      fa_cp_async16(fa_smem_u32(slot_of(stage, u, 0)), k_head + at, valid);
      fa_cp_async16(fa_smem_u32(slot_of(stage, u, 1)), v_head + at, valid);
    }
    fa_cp_async_commit();
  };
#pragma unroll
  for (int n = 0; n < kStages - 1; ++n) issue(n);
#endif

  for (int n = 0; n < iters; ++n) {
    const int it = k0 + n * kKeysPerIter;
    int j[kSteps];
    Chunk kc[kSteps], vc[kSteps];
#if FA_PATH >= 80
    issue(n + kStages - 1);
    fa_cp_async_wait<kStages - 1>();
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      j[u] = it + (u * kWarps + warp) * kKeysPerWarp + slot;
      kc[u] = *slot_of(n % kStages, u, 0);
      vc[u] = *slot_of(n % kStages, u, 1);
    }
#else
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      j[u] = it + (u * kWarps + warp) * kKeysPerWarp + slot;
      kc[u] = Chunk{};
      vc[u] = Chunk{};
      if (active && j[u] < k1) {
        kc[u] = *reinterpret_cast<const Chunk*>(k_head + j[u] * key_stride);
        vc[u] = *reinterpret_cast<const Chunk*>(v_head + j[u] * key_stride);
      }
    }
#endif
    float x[kSteps][kRows];
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      float kf[8];
      unpack(kc[u], kf);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        float d = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) d = fmaf(q[r][e], kf[e], d);
        x[u][r] = d;
      }
    }
#pragma unroll
    for (int off = 1; off < kLanesPerKey; off *= 2) {
#pragma unroll
      for (int u = 0; u < kSteps; ++u) {
#pragma unroll
        for (int r = 0; r < kRows; ++r) x[u][r] += __shfl_xor_sync(0xffffffffu, x[u][r], off);
      }
    }
    // Only the last iteration, or per-row rules, need the elementwise mask.
    const bool edge = per_row || it + kKeysPerIter > k1;
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        if (softcap2 > 0.f) x[u][r] = softcap2 * fa_tanh(x[u][r] / softcap2);
        if (edge) {
          const bool visible =
              j[u] < k1 && (!per_row || fa_visible(p, p.T, kv_len, r / G, j[u]));
          x[u][r] = visible ? x[u][r] : FA_NEG_INF;
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float mx = m[r];
#pragma unroll
      for (int u = 0; u < kSteps; ++u) mx = fmaxf(mx, x[u][r]);
      const float mu = mx == FA_NEG_INF ? 0.f : mx;
      const float alpha = fa_ex2(m[r] - mu);
      m[r] = mx;
      l[r] *= alpha;
#pragma unroll
      for (int e = 0; e < 8; ++e) o[r][e] *= alpha;
#pragma unroll
      for (int u = 0; u < kSteps; ++u) x[u][r] = fa_ex2(x[u][r] - mu);
    }
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      float vf[8];
      unpack(vc[u], vf);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        l[r] += x[u][r];
#pragma unroll
        for (int e = 0; e < 8; ++e) o[r][e] = fmaf(x[u][r], vf[e], o[r][e]);
      }
    }
  }

#if FA_PATH >= 80
  fa_cp_async_wait<0>();  // the zero-filling copies past the last iteration
#endif

  // Merge the key slots of the warp, then the warps.
#pragma unroll
  for (int off = kLanesPerKey; off < 32; off *= 2) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float a, c;
      merge_stats(m[r], l[r], __shfl_xor_sync(0xffffffffu, m[r], off),
                  __shfl_xor_sync(0xffffffffu, l[r], off), a, c);
#pragma unroll
      for (int e = 0; e < 8; ++e) o[r][e] = o[r][e] * a + __shfl_xor_sync(0xffffffffu, o[r][e], off) * c;
    }
  }
  if (slot == 0 && chunk < kChunks) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int e = 0; e < 8; ++e) s_o[warp][r][chunk * 8 + e] = o[r][e];
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) s_m[warp][r] = m[r], s_l[warp][r] = l[r];
  }
  __syncthreads();

  // The block's rows, four columns per thread: normalized O and the
  // log2-domain LSE.
  const int quads = p.H / 4;
  const bool split_kv = p.kv_splits > 1;
  const long long part = (long long)bk * p.kv_splits + split;
  for (int i = threadIdx.x; i < rows * quads; i += kThreads) {
    const int r = i / quads, e = 4 * (i % quads);
    float mx = s_m[0][r], sum = s_l[0][r], a, c, x[4];
#pragma unroll
    for (int f = 0; f < 4; ++f) x[f] = s_o[0][r][e + f];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) {
      merge_stats(mx, sum, s_m[w][r], s_l[w][r], a, c);
#pragma unroll
      for (int f = 0; f < 4; ++f) x[f] = x[f] * a + s_o[w][r][e + f] * c;
    }
    const float inv = sum == 0.f ? 0.f : 1.f / sum;
    const float lse2 = sum == 0.f ? FA_NEG_INF : mx + fa_lg2(sum);
    if (split_kv) {
      float* dst = p.partial_out + (part * kRows + r) * p.H + e;
#pragma unroll
      for (int f = 0; f < 4; ++f) dst[f] = x[f] * inv;
      if (e == 0) p.partial_lse[part * kRows + r] = lse2;
    } else {
#pragma unroll
      for (int f = 0; f < 4; ++f) x[f] *= inv;
      store_quad(p.out, row_of(r) * p.H + e, x);
      if (e == 0) p.lse[row_of(r)] = lse2 * kLn2;
    }
  }
  if (!split_kv) return;

  // The last split of (b, kvh) to finish merges them all.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) s_last = atomicAdd(p.counters + bk, 1u) == unsigned(p.kv_splits - 1);
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  const float* lse_parts = p.partial_lse + (long long)bk * p.kv_splits * kRows;
  for (int i = threadIdx.x; i < p.kv_splits * kRows; i += kThreads) {
    s_w[i / kRows][i % kRows] = load_l2(lse_parts + i);
  }
  __syncthreads();
  if (threadIdx.x < rows) {
    const int r = threadIdx.x;
    float mx = FA_NEG_INF;
    for (int s = 0; s < p.kv_splits; ++s) mx = fmaxf(mx, s_w[s][r]);
    const float mu = mx == FA_NEG_INF ? 0.f : mx;
    float sum = 0.f;
    for (int s = 0; s < p.kv_splits; ++s) {
      s_w[s][r] = fa_ex2(s_w[s][r] - mu);
      sum += s_w[s][r];
    }
    const float inv = sum == 0.f ? 0.f : 1.f / sum;
    for (int s = 0; s < p.kv_splits; ++s) s_w[s][r] *= inv;
    p.lse[row_of(r)] = sum == 0.f ? FA_NEG_INF : (mu + fa_lg2(sum)) * kLn2;
  }
  __syncthreads();
  const float* o_parts = p.partial_out + (long long)bk * p.kv_splits * kRows * p.H;
  for (int i = threadIdx.x; i < rows * quads; i += kThreads) {
    const int r = i / quads, e = 4 * (i % quads);
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    // Eight splits' loads in flight before any is used.
    for (int s0 = 0; s0 < p.kv_splits; s0 += 8) {
      float x[8][4];
#pragma unroll
      for (int s = 0; s < 8; ++s) {
        if (s0 + s < p.kv_splits) load_l2(o_parts + ((long long)(s0 + s) * kRows + r) * p.H + e, x[s]);
      }
#pragma unroll
      for (int s = 0; s < 8; ++s) {
#pragma unroll
        for (int f = 0; f < 4; ++f) {
          if (s0 + s < p.kv_splits) acc[f] = fmaf(s_w[s0 + s][r], x[s][f], acc[f]);
        }
      }
    }
    store_quad(p.out, row_of(r) * p.H + e, acc);
  }
}
