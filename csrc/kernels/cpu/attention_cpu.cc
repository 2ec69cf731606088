// Fused attention forward on the CPU: the FastAttention two-level tiling.
//
// FastAttention (the paper's review thread, "two-level tiling") computes, for a block Q_i of Br
// query rows and key/value blocks K_j, V_j of Bc rows:
//   S_i^(j) = Q_i K_j^T                                           (level 1, Br x Bc)
//   for each Bb-row slice k of S_i^(j):                           (level 2)
//     m_ik^(j) = max(m_ik^(j-1), rowmax(S_ik^(j)))
//     P_ik^(j) = exp(S_ik^(j) - m_ik^(j))
//     l_ik^(j) = e^(m_ik^(j-1) - m_ik^(j)) l_ik^(j-1) + rowsum(P_ik^(j))
//   O_i^(j) = diag(e^(m_i^(j-1) - m_i^(j))) O_i^(j-1) + P_i^(j) V_j
//   O_i = diag(l_i)^-1 O_i,  LSE_i = m_i + log(l_i).
//
// CPU mapping. Query rows are the vector lanes everywhere: Q_i is transposed once per work item
// (H x Br), the score tile is kept transposed (S^T, Bc x Bb), and O is accumulated transposed
// (H x Br). Then
//  - both matrix products are register-blocked outer products whose other operand, a K or V row,
//    is read as broadcast scalars: K and V need no transposition or padding, and float32 inputs
//    are read in place;
//  - the softmax reductions (rowmax, rowsum) run down the columns of S^T, lane-parallel, with no
//    horizontal reductions, and m, l and the rescale factors are plain vectors;
//  - a level-2 slice is the unit of the whole update: its Bc x Bb scores are computed, turned
//    into probabilities and multiplied into O while they are in L1.
//
// A work item is (batch b, key/value head kh, one block of Br "packed" query rows): the G = N / K
// query heads that read head kh are interleaved as rows (row g is query position g / G, head
// kh * G + g % G), so grouped-query attention streams each K/V tile once for all of its heads.
//
// Visibility is never materialized as a matrix. Every row has a contiguous visible key range
// [lo, hi) (causal, window and lengths), monotone in the query position; key tiles outside the
// union of a block's ranges are never visited, slices skip tiles that none of their rows sees, and
// within a tile each slice only touches the key span its rows see. Invisible scores are replaced
// (selected) by -inf before the softmax, so a NaN or Inf in a score that is not visible never
// reaches a sum; a value tile that holds a NaN or Inf is multiplied in with a guard that keeps
// it out of the rows that do not see its key (pv_block); keys at or beyond kv_lens[b] are never
// read.
#include "attention_cpu_internal.h"

namespace fastattn {

bool cpu_reads_in_place(const AttentionParams& p) {
  return decode_layout(p) != DecodeLayout::kNone;
}

namespace {

#if FASTATTN_X86
// The instruction sets the CPU has and the OS saves the registers of, read
// with CPUID and XGETBV rather than __builtin_cpu_supports: that builtin reads
// a table the compiler's runtime fills, and zig's (the manylinux wheel's
// compiler) leaves it empty, which sent every call to the baseline kernel,
// 4-5x slower (measured on the Zen 4 development VM).
struct CpuFeatures {
  bool avx2_fma = false;
  bool avx512 = false;  // F, VL, BW and DQ
};

CpuFeatures cpu_features() {
  unsigned a, b, c, d;
  CpuFeatures f;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & bit_OSXSAVE)) return f;
  const bool fma = c & bit_FMA;
  unsigned xcr0_lo, xcr0_hi;
  __asm__("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  const bool ymm_saved = (xcr0_lo & 0x6) == 0x6;      // SSE and AVX state
  const bool zmm_saved = (xcr0_lo & 0xe6) == 0xe6;    // and opmask, ZMM0-15, ZMM16-31
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return f;
  f.avx2_fma = ymm_saved && fma && (b & bit_AVX2);
  f.avx512 = f.avx2_fma && zmm_saved && (b & bit_AVX512F) && (b & bit_AVX512VL) &&
             (b & bit_AVX512BW) && (b & bit_AVX512DQ);
  return f;
}
#endif

Kernels best_kernels() {
#if FASTATTN_X86
  const CpuFeatures cpu = cpu_features();
  if (cpu.avx512) {
    return avx512_kernels();
  }
  if (cpu.avx2_fma) {
    return avx2_kernels();
  }
#endif
  return baseline_kernels();
}

const Kernels& kernels() {
  static const Kernels k = best_kernels();
  return k;
}

// ---------------------------------------------------------------------------------------------
// Split-KV combine: O = sum_s e^(m_s - M) O_s / L, L = sum_s e^(m_s - M) l_s, LSE = M + log(L).

template <class T>
void combine_splits_to(const Problem& pb) {
  const AttentionParams& p = *pb.p;
  const int64_t H = p.H;
  const int64_t rows = p.B * p.T * p.N;
  std::vector<float> weight(pb.splits);
  std::vector<float> acc(H);
  for (int64_t row = 0; row < rows; ++row) {
    float M = -kInf;
    for (int64_t s = 0; s < pb.splits; ++s) M = std::max(M, pb.part_m[s * rows + row]);
    const float M_safe = M == -kInf ? 0.0f : M;
    float L = 0.0f;
    for (int64_t s = 0; s < pb.splits; ++s) {
      weight[s] = std::exp(pb.part_m[s * rows + row] - M_safe);
      L += weight[s] * pb.part_l[s * rows + row];
    }
    T* out = static_cast<T*>(p.out) + row * H;
    float lse = L == 0.0f ? -kInf : M_safe + std::log(L);
    const float sink = fa_join_sink(p.features, row / (p.T * p.N), row % p.N, &lse);
    if (p.lse != nullptr) p.lse[row] = lse;
    if (L == 0.0f) {
      std::fill(out, out + H, cpu::from_float<T>(0.0f));
      continue;
    }
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t s = 0; s < pb.splits; ++s) {
      const float* po = pb.part_o + (s * rows + row) * H;
      for (int64_t h = 0; h < H; ++h) acc[h] += weight[s] * po[h];
    }
    for (int64_t h = 0; h < H; ++h) out[h] = cpu::from_float<T>(acc[h] / L * sink);
  }
}

struct AlignedFree {
  void operator()(float* ptr) const { ::operator delete(ptr, std::align_val_t{64}); }
};

// Runs run_item(item, scratch) for every item of [0, items) on `count` workers (the calling thread
// one of them), each with its own 64-byte-aligned scratch of `scratch_floats` floats, and returns
// when all items are done. All memory is allocated before any worker starts, so a failed
// allocation throws here and nothing fails part-way. The state the workers share is kept alive by
// each task that holds it: a task that starts after the return finds no item left and touches
// nothing else (run_item, the caller's, is only called for an item taken before the return).
template <class RunItem>
void run_items(const CpuWorkers& workers, int64_t count, int64_t items, int64_t scratch_floats,
               const RunItem& run_item) {
  struct State {
    const RunItem* run_item;
    int64_t items, count, scratch_floats;
    std::unique_ptr<float, AlignedFree> scratch;
    std::atomic<int64_t> next{0};      // the next work item
    std::atomic<int64_t> slots{1};     // the next worker's scratch (0: the caller's)
    std::atomic<int64_t> finished{0};  // work items done
    std::mutex mu;
    std::condition_variable all_done;

    // Takes items until none is left; wakes the caller when the last one is done.
    void take(int64_t slot) {
      float* mine = scratch.get() + slot * scratch_floats;
      int64_t done = 0;
      for (int64_t item; (item = next.fetch_add(1, std::memory_order_relaxed)) < items; ++done) {
        (*run_item)(item, mine);
      }
      if (done > 0 && finished.fetch_add(done) + done == items) {
        std::lock_guard<std::mutex> lock(mu);
        all_done.notify_all();
      }
    }
  };
  if (items <= 0) return;
  auto st = std::make_shared<State>();
  st->run_item = &run_item;
  st->items = items;
  st->count = count;
  st->scratch_floats = scratch_floats;
  const size_t bytes = sizeof(float) * static_cast<size_t>(scratch_floats * count);
  st->scratch.reset(static_cast<float*>(::operator new(bytes, std::align_val_t{64})));
  for (int64_t t = 1; t < count; ++t) {
    workers.run([st] {
      const int64_t slot = st->slots.fetch_add(1);
      if (slot < st->count) st->take(slot);
    });
  }
  st->take(0);
  std::unique_lock<std::mutex> lock(st->mu);
  st->all_done.wait(lock, [&] { return st->finished.load() == items; });
}

// The workers worth using for `items` items of `flops` floating-point operations in all.
int64_t useful_workers(int64_t cpus, int64_t items, double flops) {
  return std::max<int64_t>(
      1, std::min({cpus, items, static_cast<int64_t>(flops / kFlopsPerThread) + 1}));
}

// combine_splits_to for out's element type.
void combine_splits(const Problem& pb) {
  switch (pb.p->out_f32 ? kFaF32 : pb.p->dtype) {
    case kFaF32:
      return combine_splits_to<float>(pb);
    case kFaF16:
      return combine_splits_to<Half>(pb);
    case kFaBF16:
      return combine_splits_to<BFloat16>(pb);
    case kFaI8:
    case kFaF8E4M3:  // a quantized cache's elements, never out's
      return;
  }
}

// The LSE of a call with H = 0, where every logit is 0 (scale * 0, soft-capped to 0) plus the
// bias: for each row, the log-sum-exp over its visible keys of their biases (log of their count
// without bias), in float64; -inf for a row that sees no key, as the kernel's l = 0 gives.
template <class BiasT>
void lse_without_head_dims(const AttentionParams& p) {
  const BiasT* bias = static_cast<const BiasT*>(p.bias);
  const int64_t* bs = p.bias_strides;
  const int64_t* ms = p.mask_strides;
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t q_len = p.q_lens ? std::clamp<int64_t>(p.q_lens[b], 0, p.T) : p.T;
    const int64_t kv_len = p.kv_lens ? std::clamp<int64_t>(p.kv_lens[b], 0, p.S) : p.S;
    for (int64_t i = 0; i < p.T; ++i) {
      int64_t lo, hi;
      fa_row_keys(p.rules, q_len, kv_len, i, &lo, &hi);
      const int64_t pos = fa_row_pos(p.rules, q_len, kv_len, i);
      for (int64_t n = 0; n < p.N; ++n) {
        const int64_t bias_row = b * bs[0] + n * bs[1] + i * bs[2];
        const int64_t mask_row = b * ms[0] + n * ms[1] + i * ms[2];
        const float slope = fa_alibi_slope(p.features, b, n);
        const auto visible = [&](int64_t j) {
          return (p.mask == nullptr || p.mask[mask_row + j * ms[3]]) &&
                 fa_same_segment(p.features, p.T, p.S, b, i, j);
        };
        const auto logit = [&](int64_t j) {
          return (bias == nullptr ? 0.0 : double{cpu::to_float(bias[bias_row + j * bs[3]])}) +
                 fa_alibi_term(slope, pos, j);
        };
        double m = -std::numeric_limits<double>::infinity();
        for (int64_t j = lo; j < hi; ++j) {
          if (visible(j)) m = std::max(m, logit(j));
        }
        double l = 0.0;
        if (m > -std::numeric_limits<double>::infinity()) {
          for (int64_t j = lo; j < hi; ++j) {
            if (visible(j)) l += std::exp(logit(j) - m);
          }
        }
        float lse = l == 0.0 ? -kInf : static_cast<float>(m + std::log(l));
        fa_join_sink(p.features, b, n, &lse);
        p.lse[(b * p.T + i) * p.N + n] = lse;
      }
    }
  }
}

// The plan of a call (Problem's sizes) and the workers worth using.
void plan(const AttentionParams& p, int64_t cpus, Problem* pb, int64_t* workers) {
  *pb = Problem{};
  pb->G = p.N / p.K;
  pb->packed_rows = p.T * pb->G;
  int64_t base_items;
  const DecodeLayout layout = decode_layout(p);
  pb->decode = layout != DecodeLayout::kNone;
  if (pb->decode) {
    const int64_t Hp = round_up(p.H, 16);
    pb->row_lanes = layout == DecodeLayout::kRowLanes;
    pb->decode_keys = std::clamp<int64_t>(kDecodeTileBytes / (8 * p.K * Hp) / 16 * 16, 16, kBc);
    // Rows in lanes: whole vectors of rows per head (16 covers every vector width).
    pb->ldq = pb->row_lanes ? round_up(pb->packed_rows, 16) : pb->packed_rows;
    pb->q_floats = p.K * pb->ldq * Hp;
    pb->kv_floats = 2 * pb->decode_keys * (p.K * Hp + kTilePad);
    pb->row_capacity = round_up(p.K * pb->ldq, 16);
    base_items = p.B;
  } else {
    pb->Br = kMaxBr;
    while (pb->Br > kBb && (pb->Br * p.H > kMaxQtFloats ||
                            p.B * p.K * ceil_div(pb->packed_rows, pb->Br) < 4 * cpus)) {
      pb->Br /= 2;
    }
    pb->tiles = ceil_div(pb->packed_rows, pb->Br);
    pb->q_floats = p.H * pb->Br;
    pb->kv_floats = 2 * kBc * p.H;
    pb->row_capacity = pb->Br;
    base_items = p.B * p.K * pb->tiles;
  }
  pb->splits = SplitCount(base_items, p.S, cpus, kMinSplitKeys, std::numeric_limits<int64_t>::max());
  pb->items = base_items * pb->splits;
  *workers = useful_workers(cpus, pb->items, 4.0 * p.B * p.N * p.T * p.S * p.H);
}

CpuPlan Describe(const Problem& pb, int64_t workers) {
  CpuPlan plan;
  plan.decode = pb.decode;
  plan.row_lanes = pb.row_lanes;
  plan.Br = pb.decode ? 0 : pb.Br;
  plan.Bc = pb.decode ? pb.decode_keys : kBc;
  plan.Bb = pb.decode && !pb.row_lanes ? 0 : kBb;
  plan.splits = pb.splits;
  plan.items = pb.items;
  plan.workers = workers;
  plan.scratch_floats = Scratch::floats(pb);
  plan.lanes = kernels().lanes;
  return plan;
}

bool Empty(const AttentionParams& p) {
  return p.B <= 0 || p.T <= 0 || p.N <= 0 || p.K <= 0 || p.H <= 0;
}

}  // namespace

CpuPlan PlanCpu(const AttentionParams& p, int64_t workers) {
  if (Empty(p)) return CpuPlan{};
  Problem pb;
  int64_t used;
  plan(p, std::max<int64_t>(workers, 1), &pb, &used);
  return Describe(pb, used);
}

CpuPlan attention_forward_cpu(const AttentionParams& params, const CpuWorkers& workers) {
  if (params.H == 0 && params.lse != nullptr && params.B > 0 && params.T > 0 && params.N > 0 &&
      params.K > 0) {
    // out has no elements; the LSE is defined by the logits, all 0 (plus the bias).
    switch (params.bias == nullptr ? kFaF32 : params.bias_dtype) {
      case kFaF32:
        lse_without_head_dims<float>(params);
        break;
      case kFaF16:
        lse_without_head_dims<Half>(params);
        break;
      case kFaBF16:
        lse_without_head_dims<BFloat16>(params);
        break;
      case kFaI8:
      case kFaF8E4M3:  // a quantized cache's elements, never a bias's
        break;
    }
    return CpuPlan{};
  }
  if (Empty(params)) return CpuPlan{};
  AttentionParams p = params;
  Problem pb;
  int64_t count;
  plan(p, std::max<int64_t>(workers.count, 1), &pb, &count);
  pb.p = &p;
  std::vector<float> partials;
  if (pb.splits > 1) {
    const int64_t rows = p.B * p.T * p.N;
    partials.resize(pb.splits * rows * (p.H + 2));
    pb.part_o = partials.data();
    pb.part_m = pb.part_o + pb.splits * rows * p.H;
    pb.part_l = pb.part_m + pb.splits * rows;
  }
  const Worker worker = kernels().forward;
  run_items(workers, count, pb.items, Scratch::floats(pb),
            [&](int64_t item, float* scratch) { worker(pb, scratch, item); });

  if (pb.splits > 1) combine_splits(pb);
  return Describe(pb, count);
}

namespace {

// The backward's plan: its key splits, items and workers.
CpuPlan plan_backward(const AttentionParams& p, int64_t cpus) {
  CpuPlan plan;
  plan.Br = kBwdBr;
  plan.Bc = kBwdBc;
  const int64_t tiles = std::max<int64_t>(1, ceil_div(p.S, kBwdBc));
  plan.splits = std::clamp<int64_t>(ceil_div(kBwdItemsPerWorker * cpus, p.B * p.K), 1,
                                    std::min(tiles, kBwdMaxSplits));
  plan.splits = ceil_div(tiles, ceil_div(tiles, plan.splits));  // none left empty
  plan.items = p.B * p.K * plan.splits;
  // The products S, dP, dV, dK and dQ, 2 H flops per score each.
  plan.workers = useful_workers(cpus, plan.items, 10.0 * p.B * p.N * p.T * p.S * p.H);
  plan.scratch_floats = kernels().backward_scratch(p.H);
  plan.lanes = kernels().lanes;
  return plan;
}

}  // namespace

CpuPlan PlanCpuBackward(const AttentionParams& p, int64_t workers) {
  if (p.B <= 0 || p.N <= 0 || p.K <= 0 || p.H <= 0) return CpuPlan{};
  return plan_backward(p, std::max<int64_t>(workers, 1));
}

CpuPlan attention_backward_cpu(const AttentionGradParams& params, const CpuWorkers& workers) {
  const AttentionParams& p = params.fwd;
  if (p.B <= 0 || p.N <= 0 || p.K <= 0 || p.H <= 0) return CpuPlan{};  // no output elements
  const CpuPlan plan = plan_backward(params.fwd, std::max<int64_t>(workers.count, 1));
  BackwardProblem bp;
  bp.g = &params;
  bp.splits = plan.splits;
  bp.split_tiles = ceil_div(std::max<int64_t>(1, ceil_div(p.S, kBwdBc)), plan.splits);
  bp.ldp = round_up(p.H, 16);
  // Every item zeroes its own part before adding to it.
  const std::unique_ptr<float[]> dq_part(new float[bp.splits * p.B * p.N * p.T * bp.ldp]);
  bp.dq_part = dq_part.get();
  const BackwardWorker worker = kernels().backward;
  run_items(workers, plan.workers, plan.items, plan.scratch_floats,
            [&](int64_t item, float* scratch) { worker(bp, scratch, item); });
  if (bp.splits > 1) {
    const DqWorker dq = kernels().backward_dq;
    const double adds = static_cast<double>(bp.splits) * p.B * p.N * p.T * p.H;
    run_items(workers, useful_workers(plan.workers, p.B * p.N, adds), p.B * p.N, 0,
              [&](int64_t item, float*) { dq(bp, item); });
  }
  return plan;
}

}  // namespace fastattn
