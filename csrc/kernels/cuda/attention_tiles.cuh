// The one home of the CUDA kernels' shape facts: which head dims each kernel
// is built for, which decode build and row count serves a call, and each
// kernel's tile (Br, Bc, threads, shared memory) per GPU. The kernels take
// their constants from here (compiled by NVRTC); the host
// (csrc/cuda/variants.cc) asks the same functions to size grids, workspaces
// and split counts before anything is compiled.
//
// A GPU generation is its compute capability `cc`, 10 * major + minor (70,
// 75, 80, 86, 90, ...), on the host and in the kernels alike (these take
// attention_common.cuh's kFaCc, __CUDA_ARCH__ / 10). Kernels are named by the
// cc they were written for (kernel_sm): 70 (mma.m8n8k4, attention_volta.cu),
// 75 (mma.m16n8k8) and 80 (mma.m16n8k16 + cp.async, both attention_mma16.cu),
// 90 (wgmma, attention_wgmma.cu); the decode kernel (attention_decode.cu) has
// three builds, 75 (CUDA cores), 80 (mma.sync + cp.async) and 90 (wgmma +
// cp.async, above 16 rows on the sm90 path).
//
// No includes: compiled by the host compiler and by NVRTC.
#pragma once

#if defined(__CUDACC_RTC__)
#define FA_TILE_FN __host__ __device__ constexpr
#else
#define FA_TILE_FN constexpr
#endif

// Head dims every kernel takes: 1 .. kFaMaxHeadDim, each row 16-byte aligned
// (H a multiple of kFaRowAlign elements) for the vector loads, cp.async and
// TMA that read it in place.
constexpr int kFaMaxHeadDim = 256;
constexpr int kFaRowAlign = 8;

// The head dim a kernel is specialized for, H rounded up: to a multiple of
// 64 for kernel 90 (its shared-memory rows are 64-element panels), of 32 for
// the others. Columns in [H, that) are read as zeros and never written.
FA_TILE_FN int fa_kernel_head_dim(int kernel_sm, int head_dim) {
  return kernel_sm == 90 ? (head_dim + 63) / 64 * 64 : (head_dim + 31) / 32 * 32;
}

// Whether a GPU of compute capability `cc` (10 * major + minor) runs kernel
// `kernel_sm`: newer GPUs run older kernels' instructions, but wgmma exists
// only in the arch-specific sm_90a target, which runs on 9.0 alone.
FA_TILE_FN bool fa_runs_on(int kernel_sm, int cc) {
  return kernel_sm == 90 ? cc == 90 : cc >= kernel_sm;
}

// The most query rows per key/value head the decode kernel holds on the path
// of kernel `kernel_sm` (or in decode build `kernel_sm`): 64 on the sm80 and
// sm90 paths (builds 80 and 90: 16 rows, an m16 tile, per warp of a key
// group), 8 on sm70 and sm75 (build 75: each row's q and O take 8 registers
// a lane).
FA_TILE_FN int fa_decode_max_rows(int kernel_sm) { return kernel_sm >= 80 ? 64 : 8; }

// The decode kernel's rows per block for `rows` = T * N / K query rows per
// key/value head on the path (or build) `kernel_sm`: the smallest power of
// two that holds them, 0 past the most (such calls take the forward
// kernels).
FA_TILE_FN int fa_decode_rows(int kernel_sm, long long rows) {
  int r = 1;
  while (r < rows && r < fa_decode_max_rows(kernel_sm)) r *= 2;
  return r >= rows ? r : 0;
}

// The decode build serving `rows` rows per block (fa_decode_rows) on the path
// of kernel `kernel_sm`, for a 16-bit or a quantized (`quant`) cache: 75
// (CUDA cores, float32) on sm70 and sm75; 80 (mma.sync, cp.async) on sm80,
// and on sm90 up to 16 rows and for quantized caches; 90 (wgmma) on sm90
// above 16 rows, where build 80's warps of one key group each repeat the
// tile's softmax bookkeeping for their 16 rows and issue, not memory, set
// its pace (attention_decode.cu).
FA_TILE_FN int fa_decode_build(int kernel_sm, int rows, int quant) {
  return kernel_sm == 90 && rows > 16 && !quant ? 90 : kernel_sm >= 80 ? 80 : 75;
}

struct FaTile {
  int Br;          // query rows per block (decode: rows per block)
  int Bc;          // keys per tile (decode: keys per iteration of a block)
  int threads;
  int smem_bytes;  // dynamic shared memory per block
};

// --- attention_mma16.cu (kernels 75 and 80) ------------------------------------

// m16 tiles per warp: two up to H = 128 halve the shared-memory reads of K
// and V per flop (each B fragment feeds both).
FA_TILE_FN int fa_mma16_m_tiles(int h) { return h <= 128 ? 2 : 1; }
// cp.async stages of K and V (kernel 80); kernel 75 stages through registers.
FA_TILE_FN int fa_mma16_stages(int kernel_sm) { return kernel_sm == 80 ? 2 : 1; }
FA_TILE_FN int fa_mma16_smem_budget(int kernel_sm, int cc) {
  return kernel_sm == 75 ? 64 * 1024                              // T4
       : cc == 80 || cc == 87 ? 163 * 1024
       : cc >= 90 ? 227 * 1024
                  : 99 * 1024;                                    // sm_86, sm_89
}
// Shared-memory rows are padded by 16 bytes (see attention_mma16.cu).
FA_TILE_FN int fa_mma16_smem(int kernel_sm, int h, int Bc) {
  return (4 * 16 * fa_mma16_m_tiles(h) + fa_mma16_stages(kernel_sm) * 2 * Bc) * (2 * h + 16);
}
// Bc: as wide as registers allow (S and, on kernel 75, the prefetched tile
// grow with it), then as shared memory allows.
FA_TILE_FN int fa_mma16_Bc(int kernel_sm, int h, int cc) {
  const int most = kernel_sm == 75 ? (h <= 64 ? 64 : h <= 160 ? 32 : 16) : (h <= 64 ? 64 : 32);
  const int budget = fa_mma16_smem_budget(kernel_sm, cc);
  return most >= 64 && fa_mma16_smem(kernel_sm, h, 64) <= budget   ? 64
       : most >= 32 && fa_mma16_smem(kernel_sm, h, 32) <= budget ? 32
                                                                  : 16;
}

// --- attention_volta.cu (kernel 70) ----------------------------------------------

// Row groups of 8 rows per warp (kRG there): 2 above H = 128 keep O at 128
// registers.
FA_TILE_FN int fa_volta_row_groups(int h) { return h > 128 ? 2 : 4; }
// Bc: S takes Bc registers per lane and the K/V prefetch Bc * H / 256.
FA_TILE_FN int fa_volta_Bc(int h) { return h <= 64 ? 64 : h < 224 ? 32 : 16; }
// Bytes of a tile of `rows` rows: H / 4 chunks of 8 bytes plus one of padding.
FA_TILE_FN int fa_volta_tile_bytes(int rows, int h) { return rows * (h / 4 + 1) * 8; }
// V100 gives 96 KB of shared memory to an SM: where Q, K and V would keep a
// second block out, V reuses K's buffer.
FA_TILE_FN bool fa_volta_one_kv(int h) {
  return fa_volta_tile_bytes(4 * 8 * fa_volta_row_groups(h), h) +
             2 * fa_volta_tile_bytes(fa_volta_Bc(h), h) > 48 * 1024;
}

// --- attention_wgmma.cu (kernel 90) ---------------------------------------------

// Bc: a consumer thread holds S (Bc / 2 registers), the previous tile's P
// (Bc / 4) and O (H / 2) at once; these are the widest that do not spill
// (at H = 256 with the extras, 64 would).
FA_TILE_FN int fa_wgmma_Bc(int h, bool extras) {
  return h <= 128 ? (extras ? 64 : 128) : h <= 192 || !extras ? 64 : 32;
}
// Shared memory: Q (128 rows), `stages` stages of K and V, then alignment
// slack and the mbarriers.
FA_TILE_FN int fa_wgmma_smem(int h, int Bc, int stages) {
  return 128 * h * 2 + stages * 2 * Bc * h * 2 + 1024 + 128;
}
// K/V stages: 3 where they fit an H100's 227 KB, else 2 (H = 256, Bc = 64).
FA_TILE_FN int fa_wgmma_stages(int h, bool extras) {
  return fa_wgmma_smem(h, fa_wgmma_Bc(h, extras), 3) <= 227 * 1024 ? 3 : 2;
}

// --- attention_decode.cu ------------------------------------------------------------

// Build 80: each warp streams tiles of 16 keys through its own ring of
// kFaDecodeStages stages, as many warps (up to 8) as shared memory allows
// (fa_decode_warps). Above 16 rows the rows split into row groups of one m16
// tile each, a warp per row group, and the warps of one key group (one per
// row group) share a ring: each copies its part of every tile, and all read
// it whole. The rings then keep the bytes in flight of the one-warp rings
// they replace, in more stages each (fa_decode_stages).
constexpr int kFaDecodeTileKeys = 16;
constexpr int kFaDecodeStages = 2;
// A key's row in a ring stage, in 16-byte chunks: the h / 8 of its values
// where they fill whole 128-byte lines (h = 64, 128, 192, 256; the chunks
// XOR-swizzled by the key, attention_decode.cu), else one chunk of padding.
FA_TILE_FN int fa_decode_row_chunks(int h) { return h / 8 % 8 == 0 ? h / 8 : h / 8 + 1; }
FA_TILE_FN int fa_decode_tile_bytes(int h) {
  return kFaDecodeTileKeys * fa_decode_row_chunks(h) * 16;
}
// A quantized cache (int8 or float8 values, float32 scales): a stage holds
// the tile's K and V rows of h bytes (unpadded: the swizzle differs,
// attention_decode.cu) and its 16 K then 16 V scales; twice the stages of a
// 16-bit ring, so the bytes in flight of K and V stay the same (a warp's
// walk at B = 1 is latency-bound: half the bytes in flight would be half
// the bandwidth).
FA_TILE_FN int fa_decode_stage_bytes(int h, int quant) {
  return quant ? 2 * kFaDecodeTileKeys * (h + 4) : 2 * fa_decode_tile_bytes(h);
}
FA_TILE_FN int fa_decode_warp_stages(int quant) { return quant ? 2 * kFaDecodeStages : kFaDecodeStages; }
FA_TILE_FN int fa_decode_ring_bytes(int warps, int h, int quant) {
  return warps * fa_decode_warp_stages(quant) * fa_decode_stage_bytes(h, quant);
}
// Shared memory a decode block may take, less its static arrays (8 KB).
FA_TILE_FN int fa_decode_smem_budget(int cc) {
  return (cc == 80 || cc == 87 ? 163 : cc >= 90 ? 227 : 99) * 1024 - 8 * 1024;
}
FA_TILE_FN int fa_decode_warps(int build, int h, int cc, int quant) {
  const int budget = fa_decode_smem_budget(cc);
  return build == 75                                         ? 4
       : build == 90                                         ? 8
       : fa_decode_ring_bytes(8, h, quant) <= budget ? 8
       : fa_decode_ring_bytes(4, h, quant) <= budget ? 4
                                                     : 2;
}
// Build 90's key groups are its two warpgroups: four warps of 16 rows each,
// one wgmma m64 tile (rows past the block's are zeros).
FA_TILE_FN int fa_decode_row_groups(int build, int rows) {
  return build == 90 ? 4 : build == 80 && rows > 16 ? rows / 16 : 1;
}
FA_TILE_FN int fa_decode_key_groups(int build, int rows, int h, int cc, int quant) {
  const int warps = fa_decode_warps(build, h, cc, quant) / fa_decode_row_groups(build, rows);
  return warps > 1 ? warps : 1;
}
FA_TILE_FN int fa_decode_stages(int build, int rows, int h, int cc, int quant) {
  return fa_decode_warp_stages(quant) * fa_decode_warps(build, h, cc, quant) /
         fa_decode_key_groups(build, rows, h, cc, quant);
}
// Build 75: lanes sharing one key (each holds a 16-byte chunk of its rows),
// and the load steps issued ahead into registers, by rows per block (more
// rows: more registers for q and O, more math to hide the latency behind).
FA_TILE_FN int fa_decode_lanes_per_key(int h) {
  return h / 8 <= 4 ? 4 : h / 8 <= 8 ? 8 : h / 8 <= 16 ? 16 : 32;
}
FA_TILE_FN int fa_decode_steps(int rows) { return rows == 2 ? 8 : rows == 8 ? 2 : 4; }
// Build 90: each warpgroup walks tiles of fa_decode_wg_keys(h) keys (the N of
// its S = Q K^T wgmma; a thread holds S in wg_keys / 2 registers, P in wg_keys
// / 4 and O in h / 2), copied by its own threads with cp.async into its ring
// of fa_decode_wg_stages(h) stages, in the 128-byte-swizzled panels wgmma
// reads (attention_wgmma.cuh); Q's 64 rows sit in front of the rings, after
// up to kFaDecodeWgAlign bytes that align them to a swizzle atom.
constexpr int kFaDecodeWgAlign = 1024;
FA_TILE_FN int fa_decode_wg_keys(int h) { return h <= 192 ? 64 : 32; }
FA_TILE_FN int fa_decode_wg_q_bytes(int h) { return 64 * h * 2; }
FA_TILE_FN int fa_decode_wg_tile_bytes(int h) { return fa_decode_wg_keys(h) * h * 2; }  // K or V
FA_TILE_FN int fa_decode_wg_stages(int h, int cc) {
  const int fit = (fa_decode_smem_budget(cc) - kFaDecodeWgAlign - fa_decode_wg_q_bytes(h)) /
                  (2 * 2 * fa_decode_wg_tile_bytes(h));
  return fit < 4 ? fit : 4;
}
// The most segments of one unit that run as a thread block cluster and merge
// in shared memory (attention_decode.cu), on sm_90 and newer: up to the
// portable cluster size, 8 (16, non-portable, was slower on the H100: B = 1,
// S = 4K, 20 against 12.5 us), with build 80 up to 16 rows and with build
// 90; 1 elsewhere: no clusters.
FA_TILE_FN int fa_decode_cluster_max(int build, int rows, int cc) {
  return cc >= 90 && ((build == 80 && rows <= 16) || build == 90) ? 8 : 1;
}
// The slots a block keeps for its cluster's segments (each a segment's rows,
// O and LSE): build 80's rank 0 one per segment, which it merges; build 90's
// 64 rows by 8 segments would not fit one block, so each block keeps its own
// segment's, and each rank merges a share of the rows from every rank's slot
// (fa_merge_segments over distributed shared memory).
FA_TILE_FN int fa_decode_cluster_slots(int build, int rows, int cc) {
  const int most = fa_decode_cluster_max(build, rows, cc);
  return most > 1 && build == 90 ? 1 : most > 1 ? most : 0;
}
FA_TILE_FN int fa_decode_cluster_bytes(int build, int rows, int h, int cc) {
  return fa_decode_cluster_slots(build, rows, cc) * rows * (h + 1) * 4;
}

// The forward kernels' split-KV merge (attention_merge.cuh: fa_merge): threads
// per block, one block per unit.
constexpr int kFaMergeThreads = 128;

// --- attention_backward.cu (kernels 75, 80), attention_backward_volta.cu (70) ---------

// The largest kernel head dim of backward kernel `kernel_sm`: a
// fa_backward_dkdv lane holds dK and dV, H / 2 registers each, or H / 4 each
// where fa_backward_parts splits their columns: kernel 80 does above 128 and
// so takes up to 256, the others up to 128.
FA_TILE_FN int fa_backward_max_head_dim(int kernel_sm) { return kernel_sm == 80 ? 256 : 128; }
// Column parts of dK and dV per key block: above H = 128 kernel 80 gives each
// half of the columns a block of its own, which computes S^T and dP^T over all
// of H as the other does (6 products per pair in place of 4; dQ's kernel
// keeps all its columns).
FA_TILE_FN int fa_backward_parts(int kernel_sm, int h) { return kernel_sm == 80 && h > 128 ? 2 : 1; }
// fa_backward_dkdv's query rows per step: 64 up to H = 64, 32 above (S^T and
// dP^T take rows / 4 registers each per lane, on top of dK and dV), 16 on
// kernel 75 above H = 96 (at 32 its loads through registers spilled 20 bytes).
FA_TILE_FN int fa_backward_query_rows(int kernel_sm, int h) {
  return h <= 64 ? 64 : kernel_sm == 75 && h > 96 ? 16 : 32;
}
// Steps whose tiles are in shared memory at once, in both backward kernels:
// two on kernel 80 up to H = 64 (cp.async fills the next while the current
// computes), one above it and on kernel 75 (its loads go through registers).
// Measured on the H100 (bf16, B·S = 16384, N·H = 2048, forward+backward): two
// stages took 0.96-0.99x the time of one at H = 64 and 1.02-1.07x at H = 128,
// where one block's 32-row steps leave the loads little to hide behind.
FA_TILE_FN int fa_backward_stages(int kernel_sm, int h) {
  return kernel_sm == 80 && h <= 64 ? 2 : 1;
}
// fa_backward_dq's shared memory with `keys` keys per step: Br = 64 rows of Q
// and dO, the stages' K and V tiles. Rows padded by 16 bytes
// (attention_mma16.cu).
FA_TILE_FN int fa_backward_dq_smem(int kernel_sm, int h, int keys) {
  return (2 * 64 + 2 * fa_backward_stages(kernel_sm, h) * keys) * (2 * h + 16);
}
// fa_backward_dq's keys per step: 64, or 32 where kernel 75's 64 KB would not
// hold 64 (H = 128: 256 rows of 272 bytes, 68 KB); above H = 128, where dQ
// takes H / 2 registers a lane beside S's and dP's keys / 4 each, 32, and 16
// above H = 192 (at 32 the H = 256 build spilled 48 bytes).
FA_TILE_FN int fa_backward_dq_keys(int kernel_sm, int h) {
  if (h > 128) return h > 192 ? 16 : 32;
  return kernel_sm == 75 && fa_backward_dq_smem(75, h, 64) > fa_mma16_smem_budget(75, 75) ? 32
                                                                                           : 64;
}
// Kernel 70's (attention_backward_volta.cu): fa_backward_dkdv's row groups
// of 8 keys per warp, 4 up to H = 64, 2 above (quad pairs then split the
// columns of dK and dV, as the forward's O does above H = 128, keeping the
// two at 128 registers); its query rows per step; fa_backward_dq's keys per
// step, 32 up to H = 64, 16 above (S and dP take a register per key each
// beside dQ's H).
FA_TILE_FN int fa_volta_backward_key_groups(int h) { return h <= 64 ? 4 : 2; }
constexpr int kFaVoltaBackwardQueryRows = 16;
FA_TILE_FN int fa_volta_backward_dq_keys(int h) { return h <= 64 ? 32 : 16; }

// Kernel 90's (attention_backward_wgmma.cu): both kernels run a producer
// warpgroup and two consumer warpgroups of 64 rows each, and step over
// fa_wgmma_backward_step(h) rows (fa_backward_dkdv: query rows of Q and dO
// with their LSE and D; fa_backward_dq: keys of K and V) in
// kFaWgmmaBackwardStages stages: 128 up to H = 64, where a step's products
// are short (K = H) and twice the rows halve the steps' fixed costs, else 64
// (the step's S^T and dP^T take 2 * step / 4 registers a thread).
FA_TILE_FN int fa_wgmma_backward_step(int h) { return h <= 64 ? 128 : 64; }
constexpr int kFaWgmmaBackwardStages = 2;
// With atomic dQ, fa_backward_dkdv's buffers of one step's dS^T (steps
// alternate): step u's dQ is taken at the start of step u + 1.
constexpr int kFaWgmmaBackwardDsBuffers = 2;
// With atomic dQ, the dQ columns of a consumer warpgroup per step: with
// 128-row steps all H for its 64 rows, else half of H for all 64; and the
// pitch (floats) of the rows its warps stage in shared memory for the bulk
// reduction, 8 floats past them, and the staging's bytes (128 rows).
FA_TILE_FN int fa_wgmma_backward_dq_cols(int h) {
  return fa_wgmma_backward_step(h) == 128 ? h : h / 2;
}
FA_TILE_FN int fa_wgmma_backward_dq_pitch(int h) { return fa_wgmma_backward_dq_cols(h) + 8; }
FA_TILE_FN int fa_wgmma_backward_dq_stage_bytes(int h) {
  return 128 * fa_wgmma_backward_dq_pitch(h) * 4;
}
// The float32 dQ that atomic dQ adds into: (B, N, panels, rows, pitch), the
// columns in panels of fa_wgmma_backward_dq_cols (64 at both head dims), each
// panel's query rows rounded up to 128 (a step's rows are there even past T)
// at the staging's pitch, so that a warp's 16 staged rows are one contiguous
// bulk reduction; the caller takes dQ out of it (columns below the pitch's 64,
// rows below T).
FA_TILE_FN int fa_wgmma_backward_dq_panels(int h) { return h / fa_wgmma_backward_dq_cols(h); }
FA_TILE_FN long long fa_wgmma_backward_dq_rows(long long t) { return (t + 127) / 128 * 128; }

// The backward kernels' tile: Br query rows per fa_backward_dq block, Bc
// keys per fa_backward_dkdv block, 4 warps, shared memory for the
// larger of the two. Kernels 75 and 80: fa_backward_dq on Br = 64 query rows
// (16 per warp) holding Q, dO and the stages' K and V tiles of
// fa_backward_dq_keys; fa_backward_dkdv on Bc = 64 keys holding K, V, and
// the stages' Q and dO rows and their LSE and D. Kernel 70: the same in the
// forward's padded rows (fa_volta_tile_bytes), one stage. Kernel 90: Br = Bc
// = 128 (two consumer warpgroups of 64), 384 threads; fa_backward_dkdv holds K
// and V and the stages' Q, dO, LSE, D and rowsum(|dO o O|), and with atomic_dq (dQ added into
// float32 by bulk reductions; no fa_backward_dq) kFaWgmmaBackwardDsBuffers
// buffers of one step's dS (the step's rows by the block's 128 keys) and the
// dQ staging; fa_backward_dq holds Q, dO, LSE, D and rowsum(|dO o O|)
// and the stages' K and V; then alignment slack and the mbarriers.
FA_TILE_FN FaTile fa_backward_tile(int kernel_sm, int h, bool atomic_dq) {
  if (kernel_sm == 90) {
    const int step = fa_wgmma_backward_step(h), stages = kFaWgmmaBackwardStages;
    const int dkdv = 2 * 128 * h * 2 + stages * (2 * step * h * 2 + 3 * step * 4) +
                     (atomic_dq ? kFaWgmmaBackwardDsBuffers * step * 128 * 2 + fa_wgmma_backward_dq_stage_bytes(h) : 0);
    const int dq = 2 * 128 * h * 2 + 3 * 128 * 4 + stages * 2 * step * h * 2;
    return FaTile{128, 128, 3 * 128, (dq > dkdv ? dq : dkdv) + 1024 + 128};
  }
  if (kernel_sm == 70) {
    const int Br = 4 * 8 * fa_volta_row_groups(h), Bc = 4 * 8 * fa_volta_backward_key_groups(h);
    const int rows = kFaVoltaBackwardQueryRows;
    const int dkdv =
        2 * fa_volta_tile_bytes(Bc, h) + 2 * fa_volta_tile_bytes(rows, h) + 2 * rows * 4;
    const int dq =
        2 * fa_volta_tile_bytes(Br, h) + 2 * fa_volta_tile_bytes(fa_volta_backward_dq_keys(h), h);
    return FaTile{Br, Bc, 128, dq > dkdv ? dq : dkdv};
  }
  const int rows = fa_backward_query_rows(kernel_sm, h), stages = fa_backward_stages(kernel_sm, h);
  const int dq = fa_backward_dq_smem(kernel_sm, h, fa_backward_dq_keys(kernel_sm, h));
  const int dkdv = (2 * 64 + 2 * stages * rows) * (2 * h + 16) + 2 * stages * rows * 4;
  return FaTile{64, 64, 128, dq > dkdv ? dq : dkdv};
}

// --- tiles ----------------------------------------------------------------------------

// The tile of forward kernel `kernel_sm` at kernel head dim h (a multiple of
// 32; of 64 for kernel 90) on `cc`; `extras`: bias, mask and soft cap
// compiled in.
FA_TILE_FN FaTile fa_forward_tile(int kernel_sm, int h, bool extras, int cc) {
  if (kernel_sm == 90) {
    const int Bc = fa_wgmma_Bc(h, extras);
    return FaTile{128, Bc, 3 * 128, fa_wgmma_smem(h, Bc, fa_wgmma_stages(h, extras))};
  }
  if (kernel_sm == 70) {
    const int Br = 4 * 8 * fa_volta_row_groups(h), Bc = fa_volta_Bc(h);
    return FaTile{Br, Bc, 128,
                  fa_volta_tile_bytes(Br, h) +
                      (fa_volta_one_kv(h) ? 1 : 2) * fa_volta_tile_bytes(Bc, h)};
  }
  const int Bc = fa_mma16_Bc(kernel_sm, h, cc);
  return FaTile{4 * 16 * fa_mma16_m_tiles(h), Bc, 128, fa_mma16_smem(kernel_sm, h, Bc)};
}

// The tile of the decode kernel, build 75, 80 or 90, at `rows` rows per block
// (fa_decode_rows) and kernel head dim h (a multiple of 32; of 64 for build
// 90), on `cc`; `quant` (build 80): the cache is quantized. Its dynamic
// shared memory holds the K/V rings (build 90: and Q) and, once the walk is
// done, the key groups' O rows and the cluster's slots.
FA_TILE_FN FaTile fa_decode_tile(int build, int rows, int h, int cc, int quant) {
  const int groups = fa_decode_key_groups(build, rows, h, cc, quant);
  const int keys = build == 90   ? groups * fa_decode_wg_keys(h)
                   : build == 80 ? groups * kFaDecodeTileKeys
                               : groups * (32 / fa_decode_lanes_per_key(h)) * fa_decode_steps(rows);
  const int ring = build == 90 ? kFaDecodeWgAlign + fa_decode_wg_q_bytes(h) +
                                     groups * fa_decode_wg_stages(h, cc) * 2 *
                                         fa_decode_wg_tile_bytes(h)
                   : build == 80 ? groups * fa_decode_stages(build, rows, h, cc, quant) *
                                     fa_decode_stage_bytes(h, quant)
                               : 0;
  const int after = groups * rows * h * 4 + fa_decode_cluster_bytes(build, rows, h, cc);
  return FaTile{rows, keys, 32 * groups * fa_decode_row_groups(build, rows),
                ring > after ? ring : after};
}
