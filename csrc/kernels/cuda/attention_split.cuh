// Split-KV (Dao et al., "Flash-Decoding for long-context inference", 2023)
// for every CUDA kernel: when a launch has too few units of work to fill the
// GPU (a unit: a forward kernel's row block of one (b, n), or the decode
// kernel's rows of one (b, kvh)), each unit's key walk is cut into segments
// run by different blocks. A segment writes its rows, normalized over its own
// keys, and their LSE to a slot of the workspace and counts itself in its
// unit's counter; the last segment of a unit to finish merges the slots by
// their LSE and writes the output, in the same launch. The counters belong
// to the call site (csrc/ffi/attention_cuda_ffi.cc), are zeroed when it
// allocates them and wrap back to zero at each unit's last segment, so a
// launch needs no memset before it.
//
// Where the segments fall is the kernel's choice: the forward kernels cut
// each unit into FaSplitKV::parts even shares (slots unit * parts + split)
// and merge in a second launch (fa_merge, attention_merge.cuh); the decode
// kernel deals the flattened (unit, key step) range out evenly to a wave of
// blocks across unit boundaries (a lean, stream-K partition, below; slots
// block + unit) and merges in the same launch. Either way a unit's slots are consecutive and
// fa_merge_segments merges them. On sm_90 the decode kernel's segments of a
// unit can instead meet in a thread block cluster's shared memory (below),
// merged by the same fa_merge_segments.
#pragma once

#include "attention_common.cuh"

// Writes row r of a segment's partial state: the normalized O columns
// [e, e + 4) and, once per row (e == 0), the LSE (natural).
__device__ __forceinline__ void fa_store_partial(const FaSplitKV& s, int H, long long slot,
                                                 int rows, int r, int e, const float (&x)[4],
                                                 float lse) {
  float* dst = s.partial_out + (slot * rows + r) * H + e;
#pragma unroll
  for (int f = 0; f < 4; ++f) dst[f] = x[f];
  if (e == 0) s.partial_lse[slot * rows + r] = lse;
}

// Counts a finished segment of a unit of `segments` in *counter; true in the
// block that finished last, which then sees every other segment's partial
// state. Call from all `sync`ed threads after they stored their partials.
// One fence, by the counting thread after the barrier, publishes the whole
// block's stores (the barrier orders them before it and the fence is
// cumulative, as in cooperative groups' grid sync); a fence in every thread
// before the barrier made each call longer on the H100 (decode, B = 1, H =
// 128, bf16, in a jitted loop of 500 calls: S = 16K 31.97 -> 31.61 us, S =
// 4K 14.65 -> 14.33 us, means of four loops).
template <class Sync>
__device__ __forceinline__ bool fa_last_segment(unsigned* counter, int segments, Sync sync) {
  __shared__ int s_last;
  sync();
  // atomicInc wraps at segments - 1: the last count sets the counter back to
  // 0, ready for the next launch.
  if (threadIdx.x == 0) {
    __threadfence();
    s_last = atomicInc(counter, segments - 1) == static_cast<unsigned>(segments - 1);
  }
  sync();
  const bool last = s_last;
  if (last) __threadfence();
  return last;
}

// Floats written by another block of this launch: read from L2, not L1.
__device__ __forceinline__ float fa_load_l2(const float* ptr) {
  float x;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(x) : "l"(ptr));
  return x;
}

__device__ __forceinline__ void fa_load_l2(const float* ptr, float (&x)[4]) {
  asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(x[0]), "=f"(x[1]), "=f"(x[2]), "=f"(x[3]) : "l"(ptr));
}

// Segment k's row r in the workspace, slots first + k, of a unit of `rows`
// rows: load(k, r, e, lse, x) reads its LSE and O columns [e, e + 4).
__device__ __forceinline__ auto fa_workspace_slots(const FaSplitKV& s, long long first, int rows,
                                                   int H) {
  return [=](int k, int r, int e, float& lse, float(&x)[4]) {
    lse = fa_load_l2(s.partial_lse + (first + k) * rows + r);
    fa_load_l2(s.partial_out + ((first + k) * rows + r) * H + e, x);
  };
}

// Merges a unit's `segments` partial states, read by load (as
// fa_workspace_slots'), into its rows below `valid`: out and lse of row r go
// to out_at(r) and lse_at(r) (element offsets into p.out, p.lse). Thread
// `tid` of `threads` takes four columns of a row at a time and merges the
// segments as an online softmax over them, each segment's LSE loaded with its
// O quad: from the workspace, one round trip to L2 per kLoads segments.
// kLoads is the kernel's register budget for it. join(&lse) takes a merged
// row's LSE and returns the factor its output takes (the forward's sinks,
// fa_join_sink; FaNoJoin by default).
struct FaNoJoin {
  __device__ __forceinline__ float operator()(float*) const { return 1.f; }
};

template <int kLoads, class Load, class OutAt, class LseAt, class Join = FaNoJoin>
__device__ __forceinline__ void fa_merge_segments(const FaOperands& p, Load load, int segments,
                                                  int valid, int tid, int threads,
                                                  OutAt out_at, LseAt lse_at,
                                                  Join join = Join()) {
  const int quads = p.H / 4;
  for (int i = tid; i < valid * quads; i += threads) {
    const int r = i / quads, e = 4 * (i % quads);
    float mx = FA_NEG_INF, sum = 0.f, acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int s0 = 0; s0 < segments; s0 += kLoads) {
      float lse[kLoads], x[kLoads][4];
#pragma unroll
      for (int k = 0; k < kLoads; ++k) {
        lse[k] = FA_NEG_INF;
        if (s0 + k < segments) load(s0 + k, r, e, lse[k], x[k]);
      }
      float m_new = mx;
#pragma unroll
      for (int k = 0; k < kLoads; ++k) m_new = fmaxf(m_new, lse[k]);
      const float mu = m_new == FA_NEG_INF ? 0.f : m_new;  // all empty: weights 0
      const float alpha = fa_weight(mx, mu, kFaLog2e);
      sum *= alpha;
#pragma unroll
      for (int f = 0; f < 4; ++f) acc[f] *= alpha;
#pragma unroll
      for (int k = 0; k < kLoads; ++k) {
        if (s0 + k < segments) {
          const float w = fa_weight(lse[k], mu, kFaLog2e);
          sum += w;
#pragma unroll
          for (int f = 0; f < 4; ++f) acc[f] = fmaf(w, x[k][f], acc[f]);
        }
      }
      mx = m_new;
    }
    float inv = sum == 0.f ? 0.f : 1.f / sum;
    float lse = fa_lse(mx, sum, 1.f);
    inv *= join(&lse);
#pragma unroll
    for (int f = 0; f < 4; ++f) acc[f] *= inv;
    fa_store_quad(p.out, out_at(r) + e, acc);
    if (e == 0) p.lse[lse_at(r)] = lse;
  }
}

// --- The forward kernels -----------------------------------------------------------

// The workspace slot of a forward block's segment, or -1 when its unit is not
// split: the block writes out and lse itself.
__device__ __forceinline__ long long fa_forward_slot(const FaParams& p, const FaBlock& blk) {
  return p.split.parts > 1 ? (long long)blk.unit * p.split.parts + blk.split : -1;
}

// --- The lean partition (the decode kernel) ------------------------------------------

// `units` units of c[u] steps each, flattened in unit order, dealt out to
// `blocks` blocks: block i takes steps [i W / blocks, (i + 1) W / blocks) of
// the W in all. A block's share can end one unit and start the next, so every
// block has the same work and a wave of blocks keeps every multiprocessor
// busy to the end. Block of step x: the largest i whose share starts at or
// before x.
__device__ __forceinline__ int fa_lean_block(long long x, long long steps, int blocks) {
  return static_cast<int>(((x + 1) * blocks - 1) / steps);
}

__device__ __forceinline__ long long fa_lean_start(int block, long long steps, int blocks) {
  return block * steps / blocks;
}

// --- Thread block clusters (the decode kernel on sm_90) ------------------------------

// When each cluster of a launch holds one unit's segments, they write their
// partial states into the shared memory of the cluster's rank 0 (distributed
// shared memory), which merges them: no workspace round trip through L2, no
// fence, no counter. Clusters here are 1-D: a block's rank in its cluster is
// blockIdx.x % fa_cluster_size(). Before sm_90 there are no clusters:
// fa_cluster_size() is 1 and the other calls are never reached.

__device__ __forceinline__ unsigned fa_cluster_size() {
  unsigned n = 1;
#if __CUDA_ARCH__ >= 900
  asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
#endif
  return n;
}

// All threads of all the cluster's blocks: the shared-memory stores each
// made before (to its own block's or another's) are seen by all after.
__device__ __forceinline__ void fa_cluster_sync() {
#if __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release;\n\tbarrier.cluster.wait.acquire;" ::: "memory");
#endif
}

// The address in the shared memory of the cluster's block `rank` of the
// variable at `local` in this block's (the same offset), for fa_store_rank0
// and fa_load_rank.
__device__ __forceinline__ unsigned fa_rank_address(const void* local, unsigned rank) {
  unsigned remote = 0;
#if __CUDA_ARCH__ >= 900
  asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(fa_smem_u32(local)), "r"(rank));
#endif
  return remote;
}

__device__ __forceinline__ void fa_load_rank(unsigned remote, float (&x)[4]) {
#if __CUDA_ARCH__ >= 900
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(x[0]), "=f"(x[1]), "=f"(x[2]), "=f"(x[3]) : "r"(remote) : "memory");
#endif
}

__device__ __forceinline__ float fa_load_rank(unsigned remote) {
  float x = 0.f;
#if __CUDA_ARCH__ >= 900
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(x) : "r"(remote) : "memory");
#endif
  return x;
}

__device__ __forceinline__ void fa_store_rank0(unsigned remote, const float (&x)[4]) {
#if __CUDA_ARCH__ >= 900
  asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(remote), "f"(x[0]),
               "f"(x[1]), "f"(x[2]), "f"(x[3])
               : "memory");
#endif
}

__device__ __forceinline__ void fa_store_rank0(unsigned remote, float x) {
#if __CUDA_ARCH__ >= 900
  asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(remote), "f"(x) : "memory");
#endif
}
