#include "cuda/variants.h"

#include <algorithm>

#include "kernels/cuda/attention_common.cuh"
#include "kernels/split_policy.h"

namespace fastattn::cuda {

namespace {

const char* DtypeName(int dtype) {
  static const char* names[] = {"f16", "bf16", "f32", "int8", "fp8"};
  return dtype >= 0 && dtype <= kFaF8E4M3 ? names[dtype] : "?";
}

// Forward split-KV: each split covers at least this many keys, and a unit
// takes at most this many.
constexpr int64_t kMinSplitKeys = 256;
constexpr int64_t kMaxSplits = 64;
// The decode kernel: a block's fixed cost in keys' worth (PlanLaunch; with
// 128, B = 1, S = 128K: 16 splits in one wave 196 us, 33 in two 200 us; B =
// 8, S = 128K: 2 splits in one wave 1441 us, 33 in sixteen 1458 us), and the
// most blocks per head.
constexpr int64_t kDecodeSplitCostKeys = 512;
constexpr int64_t kMaxDecodeSplits = 128;
// Build 90's most keys per block in a cluster of fewer blocks than its plan's
// (PlanLaunch).
constexpr int64_t kDecodeWgClusterKeys = 8192;

int64_t CeilDiv(int64_t x, int64_t y) { return (x + y - 1) / y; }

}  // namespace

std::string KernelVariant::Describe() const {
  const std::string types = std::string(DtypeName(dtype)) + "->" + DtypeName(out_dtype);
  if (backward) {
    return "backward sm" + std::to_string(kernel_sm) + " H=" + std::to_string(head_dim) + " " +
           types + (extras ? " extras" : "") + (backward == 2 ? " atomic-dQ" : "");
  }
  if (decode_rows) {
    return "decode sm" + std::to_string(kernel_sm) + " rows=" + std::to_string(decode_rows) +
           " H=" + std::to_string(head_dim) + " " + types + (paged ? " paged" : "") +
           (kv_quant ? std::string(" ") + DtypeName(kv_quant) + " cache" : "");
  }
  return "sm" + std::to_string(kernel_sm) + " H=" + std::to_string(head_dim) + " " + types +
         (extras ? " extras" : "") + (features ? " features" : "");
}

std::string KernelVariant::Check() const {
  if (head_dim < 32 || head_dim > kFaMaxHeadDim ||
      head_dim != fa_kernel_head_dim(kernel_sm, head_dim)) {
    return "head_dim must be a multiple of " + std::to_string(kernel_sm == 90 ? 64 : 32) +
           " in [32, " +
           std::to_string(kFaMaxHeadDim) + "]";
  }
  if (dtype != kFaF16 && dtype != kFaBF16) return "dtype must be f16 or bf16";
  if (out_dtype < kFaF16 || out_dtype > kFaF32) return "out_dtype must be f16, bf16 or f32";
  if (extras != 0 && extras != 1) return "extras must be 0 or 1";
  if (features != 0 && (features != 1 || extras || backward || decode_rows || kernel_sm != 90)) {
    return "features: the forward kernel 90 without extras only, 0 or 1";
  }
  if (paged != 0 && (paged != 1 || !decode_rows)) return "paged: the decode kernel only, 0 or 1";
  if (kv_quant != 0 && ((kv_quant != kFaI8 && kv_quant != kFaF8E4M3) || !decode_rows ||
                        kernel_sm != 80)) {
    return "kv_quant: the decode kernel's build 80 only, int8 or float8_e4m3fn";
  }
  if (backward) {
    if (backward < 1 || backward > BackwardBuilds(kernel_sm) ||
        (kernel_sm != 70 && kernel_sm != 75 && kernel_sm != 80 && kernel_sm != 90) ||
        decode_rows || head_dim > fa_backward_max_head_dim(kernel_sm)) {
      return "the backward kernels are built for sm 70, 75, 80 and 90 (atomic dQ: 90), up to "
             "H=" + std::to_string(fa_backward_max_head_dim(70)) + " (kernel 80: " +
             std::to_string(fa_backward_max_head_dim(80)) + ")";
    }
    if (dtype == kFaBF16 && kernel_sm < 80) return "bfloat16 operands need kernel 80";
    return "";
  }
  if (decode_rows) {
    if ((kernel_sm != 75 && kernel_sm != 80 && kernel_sm != 90) || extras) {
      return "the decode kernel is built for sm 75, 80 or 90, without extras";
    }
    if (decode_rows != fa_decode_rows(kernel_sm, decode_rows)) {
      return "decode_rows must be a power of two up to " +
             std::to_string(fa_decode_max_rows(kernel_sm)) + " on decode build " +
             std::to_string(kernel_sm);
    }
    if (kernel_sm != fa_decode_build(kernel_sm, decode_rows, kv_quant)) {
      return "decode build 90 serves more than 16 rows of a 16-bit cache only";
    }
    return "";
  }
  if (kernel_sm != 70 && kernel_sm != 75 && kernel_sm != 80 && kernel_sm != 90) {
    return "kernel_sm must be 70, 75, 80 or 90";
  }
  if (dtype == kFaBF16 && kernel_sm < 80) return "bfloat16 operands need kernel 80 or 90";
  return "";
}

std::string KernelVariant::SourceFile() const {
  return backward ? (kernel_sm == 70   ? "attention_backward_volta.cu"
                     : kernel_sm == 90 ? "attention_backward_wgmma.cu"
                                       : "attention_backward.cu")
       : decode_rows ? "attention_decode.cu"
       : kernel_sm == 70 ? "attention_volta.cu"
       : kernel_sm == 90 ? "attention_wgmma.cu"
                         : "attention_mma16.cu";
}

std::vector<std::string> KernelVariant::Defines() const {
  std::vector<std::string> d = {"-DFA_KERNEL_SM=" + std::to_string(kernel_sm),
                                "-DFA_HEAD_DIM=" + std::to_string(head_dim),
                                "-DFA_DTYPE=" + std::to_string(dtype),
                                "-DFA_OUT_DTYPE=" + std::to_string(out_dtype)};
  d.push_back(decode_rows ? "-DFA_DECODE_ROWS=" + std::to_string(decode_rows)
                          : "-DFA_EXTRAS=" + std::to_string(extras));
  if (decode_rows) {
    d.push_back("-DFA_DECODE_PAGED=" + std::to_string(paged));
    d.push_back("-DFA_KV_QUANT=" + std::to_string(kv_quant));
  }
  if (!decode_rows && !backward) d.push_back("-DFA_FEATURES=" + std::to_string(features));
  if (backward) d.push_back("-DFA_ATOMIC_DQ=" + std::to_string(backward == 2));
  return d;
}

FaTile KernelVariant::Tile(int cc) const {
  return backward      ? fa_backward_tile(kernel_sm, head_dim, backward == 2)
       : decode_rows ? fa_decode_tile(kernel_sm, decode_rows, head_dim, cc, kv_quant != 0)
                     : fa_forward_tile(kernel_sm, head_dim, extras != 0, cc);
}

// The bits of Key() above every other field's: paged decode variants, then
// the quantized cache's element code (3 bits).
constexpr int kPagedBit = 40;
constexpr int kKvQuantBit = 41;
constexpr int kFeaturesBit = 44;

int64_t KernelVariant::Key() const {
  // backward, paged and kv_quant above the other fields: the other variants keep their keys.
  return (int64_t{features} << kFeaturesBit) + (int64_t{kv_quant} << kKvQuantBit) +
         (int64_t{paged} << kPagedBit) +
         ((((((int64_t{backward} * 128 + kernel_sm) * 1024 + head_dim) * 4 + dtype) * 4 +
            out_dtype) * 2 + extras) * 128 + decode_rows);
}

KernelVariant KernelVariant::FromKey(int64_t key) {
  KernelVariant v;
  v.features = static_cast<int>(key >> kFeaturesBit);
  v.kv_quant = static_cast<int>((key >> kKvQuantBit) & 7);
  v.paged = static_cast<int>((key >> kPagedBit) & 1);
  key &= (int64_t{1} << kPagedBit) - 1;
  v.decode_rows = static_cast<int>(key % 128);
  key /= 128;
  v.extras = static_cast<int>(key % 2);
  key /= 2;
  v.out_dtype = static_cast<int>(key % 4);
  key /= 4;
  v.dtype = static_cast<int>(key % 4);
  key /= 4;
  v.head_dim = static_cast<int>(key % 1024);
  key /= 1024;
  v.kernel_sm = static_cast<int>(key % 128);
  v.backward = static_cast<int>(key / 128);
  return v;
}

std::vector<int64_t> DqAccumulatorDims(const KernelVariant& v, int64_t B, int64_t T, int64_t N) {
  if (v.backward != 2) return {};
  return {B, N, fa_wgmma_backward_dq_panels(v.head_dim), fa_wgmma_backward_dq_rows(T),
          fa_wgmma_backward_dq_pitch(v.head_dim)};
}

std::string PlanCall(int kernel_sm, const CallShape& c, CallPlan* plan) {
  if (kernel_sm != 70 && kernel_sm != 75 && kernel_sm != 80 && kernel_sm != 90) {
    return "no CUDA kernel sm" + std::to_string(kernel_sm);
  }
  if (c.H < 1 || c.H > kFaMaxHeadDim) {
    return "the CUDA kernels take head dims 1 to " + std::to_string(kFaMaxHeadDim) + ", got H=" +
           std::to_string(c.H);
  }
  if (c.K < 1 || c.N % c.K != 0) return "N must be a multiple of K";
  *plan = CallPlan{};
  const int64_t G = c.N / c.K;
  const FaRules& r = c.rules;
  plan->row_elements = CeilDiv(c.H, kFaRowAlign) * kFaRowAlign;
  if (c.out_dtype != -1 && (c.out_dtype < kFaF16 || c.out_dtype > kFaF32)) {
    return "out_dtype must be float16, bfloat16 or float32, got code " +
           std::to_string(c.out_dtype);
  }
  KernelVariant& v = plan->variant;
  v.out_dtype = c.backward || c.out_dtype < 0 ? c.dtype : c.out_dtype;
  // Kernel `kernel` (forward or backward), on the operand dtype it multiplies in.
  auto on_kernel = [&](int kernel) {
    v.kernel_sm = kernel;
    v.head_dim = fa_kernel_head_dim(kernel, plan->row_elements);
    v.dtype = plan->operand_dtype = OperandDtype(kernel, c.dtype);
  };
  // Plain kernels take row maxima of the unscaled logits, valid for scale > 0.
  const bool extras = c.bias || c.mask || r.softcap > 0 || !(r.scale > 0);
  if (c.backward) {
    const int kernel = BackwardKernel(kernel_sm, plan->row_elements);
    v.backward = c.deterministic ? 1 : BackwardBuilds(kernel);
    on_kernel(kernel);
    if (v.head_dim > fa_backward_max_head_dim(v.kernel_sm)) {
      return "the backward kernels take head dims up to " +
             std::to_string(fa_backward_max_head_dim(v.kernel_sm)) + " on this path, got H=" +
             std::to_string(c.H);
    }
    v.extras = extras || c.features;
    return "";
  }
  const bool operands = c.bias || c.mask || c.row_operands || c.features;
  const int rows = fa_decode_rows(kernel_sm, c.T * G);
  // Build 80 reads a quantized cache in place at H a multiple of 16.
  const int quant = kernel_sm >= 80 && c.H % 16 == 0 ? c.kv_quant : 0;
  const int build = fa_decode_build(kernel_sm, rows, quant);
  if (!operands && c.S > 0 && rows > 0 && !(c.for_backward && build == 75)) {
    // The decode kernel reads bfloat16 on every GPU (its sm75 build on CUDA cores).
    v.kernel_sm = build;
    v.decode_rows = rows;
    v.paged = c.paged;
    v.kv_quant = quant;
    v.dtype = plan->operand_dtype = c.dtype == kFaBF16 ? kFaBF16 : kFaF16;
    v.head_dim = fa_kernel_head_dim(v.kernel_sm, plan->row_elements);
    return "";
  }
  plan->fold_heads = c.T == 1 && G > 1 && !operands && r.window_left < 0 &&
                     r.window_right < 0 && (r.end_aligned || !r.causal);
  on_kernel(kernel_sm);
  // Segment ids and ALiBi: kernel 90's features build, or the extras (which
  // have them) where the call needs those anyway, on the other kernels
  // (their plain builds hold every register already: the features spill
  // them), and for the VJP's forward, whose logits the backward's extras
  // build recomputes bit for bit.
  v.extras = extras || (c.features && (kernel_sm != 90 || c.for_backward));
  v.features = c.features && !v.extras;
  return "";
}

std::vector<std::pair<std::string, int64_t>> LaunchPlan::Facts() const {
  return {{"Br", tile.Br},               {"Bc", tile.Bc},
          {"threads", tile.threads},     {"smem_bytes", tile.smem_bytes},
          {"units", units},              {"blocks", blocks},
          {"parts", parts},              {"slots", slots},
          {"workspace_floats", workspace_floats}, {"counters", counters},
          {"cluster", cluster}};
}

int MaxBlocksPerSm(const FaTile& tile, int cc) {
  // Threads, shared memory (bytes) and blocks a multiprocessor holds.
  const int threads = cc == 75 ? 1024 : cc == 86 || cc == 87 || cc == 89 ? 1536 : 2048;
  const int smem = cc == 70 ? 96 * 1024
                 : cc == 75 ? 64 * 1024
                 : cc == 80 || cc == 87 ? 164 * 1024
                 : cc == 86 || cc == 89 ? 100 * 1024
                                        : 228 * 1024;
  const int most = cc == 75 || cc == 86 || cc == 87 ? 16 : cc == 89 ? 24 : 32;
  int blocks = std::min(most, threads / std::max(tile.threads, 1));
  if (tile.smem_bytes > 0) blocks = std::min(blocks, smem / tile.smem_bytes);
  return std::max(blocks, 1);
}

LaunchPlan PlanLaunch(const KernelVariant& v, int64_t B, int64_t T, int64_t S, int64_t N,
                      int64_t K, int64_t H, int cc, int multiprocessors, int blocks_per_sm) {
  LaunchPlan l;
  l.tile = v.Tile(cc);
  const int64_t wave = int64_t{multiprocessors} * blocks_per_sm;
  const int64_t rows = l.tile.Br;
  if (v.backward) {
    FaOperands dims{};
    dims.B = static_cast<int>(B), dims.T = static_cast<int>(T), dims.N = static_cast<int>(N);
    l.units = v.backward == 2 ? 0 : fa_forward_units(dims, l.tile.Br);
    l.blocks = CeilDiv(S, l.tile.Bc) * K * B * fa_backward_parts(v.kernel_sm, v.head_dim);
  } else if (v.decode_rows) {
    // The lean partition of the B * K heads' key steps (at most ceil(S /
    // Bc) each, at least one), over `blocks` blocks: the count with the
    // shortest modeled time, blocks running in ceil(blocks / wave) waves of
    // a share's keys plus a fixed cost (launch, first loads, the merge: about
    // kDecodeSplitCostKeys keys' worth, fitted on the H100). A whole number of
    // blocks per head wins: a block whose share straddles two heads walks two
    // segments, each paying its first loads' round trip and its own merge,
    // and the multiprocessors' speeds differ by up to 7% (ncu), so a full
    // wave of equal shares does not finish sooner. Measured on one H100,
    // 132-block waves against 128 blocks of whole-head shares: B = 8, S = 64K
    // 753 / 749 us against 740 / 733; B = 1, S = 256K 391 / 386 against
    // 383 / 381. A dynamic tail was slower still (on an H200, against these
    // static shares): 132 blocks each walking its own chunk of 16 quanta,
    // then claiming one-quantum chunks from a counter, two per block: B = 8,
    // S = 256K 2049 against 2040 us, B = 1, S = 64K 119 against 85 us (tail
    // chunks of a few steps, each paying a pipeline fill and a merge). Nor
    // did more waves of straddling shares, the hardware handing each later
    // block to a multiprocessor that finished: 1, 2, 4, 8 waves of 132 on
    // one H100, B = 8, S = 64K 752 / 754 / 762 / 759 us against 746; B = 1,
    // S = 64K 114 / 118 / 125 / 141 against 110. With ragged lengths the
    // shares stay equal in keys, so long sequences get more blocks than
    // short ones.
    l.units = B * K;
    const int64_t unit_steps = std::max<int64_t>(1, CeilDiv(S, l.tile.Bc));
    const int64_t steps = l.units * unit_steps;
    int64_t best = 1, best_cost = INT64_MAX;
    for (int64_t s = 1; s <= std::min(unit_steps, kMaxDecodeSplits); ++s) {
      const int64_t cost = CeilDiv(l.units * s, wave) *
                           (CeilDiv(unit_steps, s) * l.tile.Bc + kDecodeSplitCostKeys);
      if (cost < best_cost) best = s, best_cost = cost;
    }
    // Where a unit's segments can run as one cluster and merge in its shared
    // memory (fa_decode_cluster_max), a plan of up to twice that many per
    // unit takes that many: the merge then skips the workspace's round trip
    // through L2 (fence, counter, loads), and half as many blocks stream K
    // and V as fast. Measured on one H100, B = 1, 8 heads, in jitted loops of
    // 500 calls, means of four (us at S = 4K / 16K / 64K / 256K): 16 blocks
    // per head 14.2 / 31.7 / 101.2 / 359.6, 8 per head 14.1 / 31.4 / 100.4 /
    // 358.4, 8 per head in clusters 12.7 / 29.3 / 97.2 / 348.8; B = 8, 2 per
    // head, S = 4K / 64K: 54.8 / 703.2, in clusters 52.8 / 698.4. (With
    // ragged lengths the kernel finds the shares off the clusters' bounds
    // and merges through the workspace.) Not so a quantized cache's walk:
    // its blocks run at their issue rate, not at the memory's, so half as
    // many take twice as long (B = 1, S = 32K on the H200: 64 blocks in
    // clusters of 8 ran at 23 GB/s each, as 128 did at B = 8).
    const int64_t most = fa_decode_cluster_max(v.kernel_sm, v.decode_rows, cc);
    // Build 90 (wgmma, above 16 rows) merges its clusters' rows spread over
    // the ranks; where clusters would mean fewer blocks, it takes them only
    // at 64 rows and while a block's share stays within
    // kDecodeWgClusterKeys: its walk streams at most about 43 GB/s per block
    // (latency-bound, two tiles in flight per warpgroup), so half as many
    // blocks are slower unless the workspace merge they save is large.
    // Measured on one H200, B = 1, 16 blocks per head through the workspace
    // against 8 in clusters: T = 16 (64 rows), S = 32K 70.0 / 60.7 us, S =
    // 128K 165.0 / 193.6 us; T = 8 (32 rows), S = 32K 53.4 / 58.0 us.
    const bool cluster_fits =
        v.kernel_sm != 90 || best <= most ||
        (v.decode_rows == 64 && CeilDiv(unit_steps, most) * l.tile.Bc <= kDecodeWgClusterKeys);
    if (most > 1 && cluster_fits && best <= (v.kv_quant ? 1 : 2) * most) {
      best = std::min(best, most);
      l.cluster = static_cast<int>(best);
    }
    l.blocks = l.units * best;
    l.parts = static_cast<int>(l.blocks);
    // A unit whose walk fits in one block's share writes its output itself.
    const bool split = l.blocks > l.units || steps > l.blocks;
    if (split && l.units > 0) {
      // Block i's segment of unit u writes slot i + u: i + u grows by 1 or 2
      // from one segment to the next, so the slots are distinct.
      l.slots = l.blocks + l.units - 1;
      l.counters = l.units;
    }
  } else {
    FaOperands dims{};
    dims.B = static_cast<int>(B), dims.T = static_cast<int>(T), dims.N = static_cast<int>(N);
    l.units = fa_forward_units(dims, l.tile.Br);
    l.parts = static_cast<int>(SplitCount(l.units, S, wave, kMinSplitKeys, kMaxSplits));
    const int64_t work = l.units * l.parts;
    if (l.parts > 1) l.slots = work;
    // Kernel 90 is persistent: at most one wave of blocks walks the units'
    // splits (attention_wgmma.cu).
    l.blocks = v.kernel_sm == 90 ? std::min(work, wave) : work;
  }
  l.workspace_floats = l.slots * rows * (H + 1);
  return l;
}

int OperandDtype(int kernel_sm, int dtype) {
  return kernel_sm >= 80 && dtype == kFaBF16 ? kFaBF16 : kFaF16;
}

int BackwardBuilds(int kernel_sm) { return kernel_sm == 90 ? 2 : 1; }

int BackwardKernel(int kernel_sm, int64_t head_dim) {
  return kernel_sm == 90 && fa_kernel_head_dim(90, head_dim) > fa_backward_max_head_dim(90)
             ? 80
             : kernel_sm;
}

int DefaultKernel(int cc, int64_t head_dim) {
  if (fa_runs_on(90, cc) && fa_kernel_head_dim(90, head_dim) == fa_kernel_head_dim(80, head_dim)) {
    return 90;
  }
  return cc >= 80 ? 80 : cc >= 75 ? 75 : 70;
}

std::vector<KernelVariant> ShippedVariants(int cc, const std::vector<int>& head_dims,
                                           const std::vector<int>& dtypes) {
  std::vector<KernelVariant> out;
  auto add = [&](const KernelVariant& v) {
    for (const KernelVariant& w : out) {
      if (w.Key() == v.Key()) return;
    }
    out.push_back(v);
  };
  // Kernel `kernel` at head dim h for `dtype` inputs, with and without
  // extras, and its features build where it has one.
  auto add_kernel = [&](int kernel, int backward, int dtype, int h) {
    for (int build : {0, 1, 2}) {
      KernelVariant v;
      v.backward = backward;
      v.kernel_sm = kernel;
      v.head_dim = fa_kernel_head_dim(kernel, h);
      v.dtype = OperandDtype(kernel, dtype);
      v.out_dtype = dtype;
      v.extras = build == 1;
      v.features = build == 2;
      if (build < 2 || v.Check().empty()) add(v);
    }
  };
  for (int kernel_sm : {70, 75, 80, 90}) {
    if (!fa_runs_on(kernel_sm, cc)) continue;
    for (int dtype : dtypes) {
      for (int h : head_dims) {
        add_kernel(kernel_sm, 0, dtype, h);
        const int kernel = BackwardKernel(kernel_sm, h);
        if (fa_kernel_head_dim(kernel, h) <= fa_backward_max_head_dim(kernel)) {
          for (int backward = 1; backward <= BackwardBuilds(kernel); ++backward) {
            add_kernel(kernel, backward, dtype, h);
          }
        }
        for (int rows = 1; rows <= fa_decode_max_rows(kernel_sm); rows *= 2) {
          KernelVariant v;
          v.kernel_sm = fa_decode_build(kernel_sm, rows, 0);
          v.head_dim = fa_kernel_head_dim(v.kernel_sm, h);
          v.dtype = dtype == kFaBF16 ? kFaBF16 : kFaF16;
          v.out_dtype = dtype;
          v.decode_rows = rows;
          add(v);
        }
      }
    }
  }
  return out;
}

}  // namespace fastattn::cuda
