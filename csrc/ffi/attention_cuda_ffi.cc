// XLA FFI handlers of the CUDA attention kernels (platform "CUDA"): target
// fastattn_attention_cuda, the forward kernels and the decode kernel, and
// target fastattn_attention_cuda_backward, the backward kernels; whichever
// variant the lowering chose (csrc/cuda/variants.h: PlanCall, passed as the
// `variant` attribute). Both share the instantiate stage and the site state.
//
// Stages:
//   instantiate  the call site's state (SiteState): its variant and index
//                rules, decoded once from the attributes;
//   initialize   before each execution, outside any CUDA graph capture: the
//                first time the site runs on a CUDA context, finds or builds
//                the kernel (NVRTC, disk cache: csrc/cuda/kernel_cache.cc),
//                plans its launch from the loaded kernel's tile and occupancy
//                (PlanLaunch) and allocates the site's split-KV counters;
//   execute      fills the parameters from the buffers and launches; safe to
//                capture into a command buffer.
#include <algorithm>
#include <array>
#include <atomic>
#include <climits>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cuda/driver.h"
#include "cuda/kernel_cache.h"
#include "cuda/variants.h"
#include "ffi/attention_attrs.h"
#include "ffi/handlers.h"
#include "kernels/cuda/attention_common.cuh"

namespace ffi = xla::ffi;
namespace cu = fastattn::cuda;
using fastattn::CallAttrs;
using fastattn::DtypeCode;

namespace {

// What a launch on one CUDA context needs, made once by the initialize stage.
struct ContextState {
  cu::CUcontext context = nullptr;
  const cu::LoadedKernel* kernel = nullptr;
  cu::LaunchPlan plan;
  // Split-KV counters, plan.counters words, zeroed once; each launch's last
  // segment of a unit sets its word back to 0 (attention_split.cuh). Launches
  // of one site on one context are ordered on XLA's stream, so they never
  // share the words at the same time.
  cu::CUdeviceptr counters = 0;
};

// The shapes the kernel sees: with folded heads, T' = G rows of N' = K heads.
fastattn::QkvDims KernelDims(const fastattn::QkvDims& d, bool fold) {
  fastattn::QkvDims k = d;
  if (fold) k.T = d.N / d.K, k.N = d.K;
  return k;
}

}  // namespace

// The state of one call site (HLO instruction), made by the instantiate
// stage and freed with the executable. XLA instantiates a site once per
// process, not per device: each CUDA context the site runs on gets its
// ContextState, published for the execute stage to read without a lock.
struct SiteState {
  static ffi::TypeId id;
  static constexpr int kMaxContexts = 64;

  cu::KernelVariant variant;
  FaRules rules{};
  bool fold_heads = false;

  std::mutex mu;  // serializes the initialize stages
  std::array<ContextState, kMaxContexts> contexts;
  std::atomic<int> count{0};

  const ContextState* Find(cu::CUcontext context) const {
    const int n = count.load(std::memory_order_acquire);
    for (int i = 0; i < n; ++i) {
      if (contexts[i].context == context) return &contexts[i];
    }
    return nullptr;
  }

  ~SiteState() {
    std::string error;
    const cu::Driver* d = cu::GetDriver(&error);
    if (!d) return;
    for (int i = 0; i < count.load(); ++i) {
      const ContextState& c = contexts[i];
      if (!c.counters || d->cuCtxPushCurrent(c.context) != 0) continue;  // context gone
      d->cuMemFree(c.counters);
      cu::CUcontext popped;
      d->cuCtxPopCurrent(&popped);
    }
  }
};

ffi::TypeId SiteState::id = XLA_FFI_UNKNOWN_TYPE_ID;

XLA_FFI_TypeId* CudaSiteStateTypeId() { return &SiteState::id; }

const XLA_FFI_TypeInfo* CudaSiteStateTypeInfo() {
  static const XLA_FFI_TypeInfo info = {XLA_FFI_TypeInfo_STRUCT_SIZE, nullptr,
                                        [](void* state) { delete static_cast<SiteState*>(state); }};
  return &info;
}

namespace {

// The forward's operands of a paged and/or quantized cache (empty buffers
// where it is neither).
struct CacheOperands {
  ffi::Buffer<ffi::S32>& block_table;
  ffi::Buffer<ffi::F32>& k_scale;
  ffi::Buffer<ffi::F32>& v_scale;
};

// Checks the buffers against the site's variant; *d gets the call's shapes.
// With the forward's cache operands (a non-empty block table: a paged cache;
// scales: a quantized one; only the decode kernel reads either), *paged and
// *scales get them.
ffi::Error CheckCall(const SiteState& site, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                     ffi::AnyBuffer out, fastattn::QkvDims* d,
                     const CacheOperands* cache = nullptr, fastattn::PagedKv* paged = nullptr,
                     fastattn::KvScales* scales = nullptr,
                     ffi::DataType out_type = ffi::DataType::INVALID) {
  if (out_type == ffi::DataType::INVALID) out_type = out.element_type();
  ffi::Buffer<ffi::S32>* table = cache ? &cache->block_table : nullptr;
  fastattn::PagedKv none;
  fastattn::KvScales plain;
  if (!scales) scales = &plain;
  if (cache) {
    if (auto err = fastattn::CheckKvScales(k.element_type(), k.dimensions(), cache->k_scale,
                                           cache->v_scale, scales);
        err.failure()) {
      return err;
    }
  }
  if (auto err = table ? fastattn::CheckQkvPaged(q.dimensions(), k.dimensions(), v.dimensions(),
                                                 *table, d, paged)
                       : fastattn::CheckQkv(q.dimensions(), k.dimensions(), v.dimensions(), d);
      err.failure()) {
    return err;
  }
  if (!paged) paged = &none;
  const cu::KernelVariant& var = site.variant;
  if ((paged->block_table != nullptr) != (var.paged != 0)) {
    return ffi::Error::InvalidArgument("CUDA attention kernel " + var.Describe() +
                                       (var.paged ? ": a paged build needs a block table"
                                                  : ": only the decode kernel's paged build "
                                                    "reads a paged cache"));
  }
  if (scales->dtype != (var.kv_quant ? var.kv_quant : -1)) {
    return ffi::Error::InvalidArgument("CUDA attention kernel " + var.Describe() +
                                       (var.kv_quant ? ": a quantized build needs scales"
                                                     : ": only the decode kernel's quantized "
                                                       "builds read a quantized cache"));
  }
  const ffi::DataType kv_type = var.kv_quant ? k.element_type() : q.element_type();
  if (DtypeCode(q.element_type()) != var.dtype || k.element_type() != kv_type ||
      v.element_type() != kv_type || DtypeCode(out_type) != var.out_dtype) {
    return ffi::Error::InvalidArgument("CUDA attention kernel " + var.Describe() +
                                       ": query, key, value or out has another dtype");
  }
  if (d->H % kFaRowAlign != 0 || d->H > var.head_dim || d->T >= (1 << 30) ||
      d->S >= (1 << 30) || !std::equal(out.dimensions().begin(), out.dimensions().end(),
                                       q.dimensions().begin())) {
    return ffi::Error::InvalidArgument(
        "CUDA attention kernel " + var.Describe() + " cannot take query " +
        fastattn::DimsString(q.dimensions()) + ", key " + fastattn::DimsString(k.dimensions()) +
        " and out " + fastattn::DimsString(out.dimensions()) +
        " (H a multiple of 8 up to the kernel's, T and S below 2^30)");
  }
  return ffi::Error::Success();
}

// The context of `stream` and the driver.
ffi::Error StreamContext(cu::CUstream stream, const cu::Driver** driver,
                         cu::CUcontext* context) {
  std::string error;
  *driver = cu::GetDriver(&error);
  if (!*driver) return ffi::Error::Internal(error);
  if (auto rc = (*driver)->cuStreamGetCtx(stream, context)) {
    return ffi::Error::Internal(cu::DriverError(**driver, rc, "cuStreamGetCtx"));
  }
  return ffi::Error::Success();
}

void RecordLaunch(const cu::KernelVariant& v, const fastattn::QkvDims& d,
                  const cu::LoadedKernel& kernel, const cu::LaunchPlan& plan) {
  fastattn::PlanFacts facts = {{"variant", v.Key()},
                               {"kernel_head_dim", v.head_dim},
                               {"decode_rows", v.decode_rows},
                               {"B", d.B}, {"T", d.T}, {"S", d.S},
                               {"N", d.N}, {"K", d.K}, {"H", d.H},
                               {"cc", kernel.cc},
                               {"multiprocessors", kernel.multiprocessors},
                               {"blocks_per_sm", kernel.blocks_per_sm}};
  for (auto& fact : plan.Facts()) facts.push_back(std::move(fact));
  fastattn::RecordPlan("cuda", std::move(facts));
}

ffi::ErrorOr<std::unique_ptr<SiteState>> InstantiateImpl(CallAttrs attrs) {
  auto site = std::make_unique<SiteState>();
  site->variant = cu::KernelVariant::FromKey(attrs.variant);
  if (std::string why = site->variant.Check(); !why.empty()) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        "CUDA attention: no kernel variant " + std::to_string(attrs.variant) + ": " + why));
  }
  site->rules = fastattn::RulesOf(attrs);
  site->fold_heads = attrs.fold_heads != 0;
  if (site->fold_heads) site->rules.causal = site->rules.end_aligned = 0;
  return site;
}

// The initialize stage of a checked call of shapes d: loads the site's
// kernel on the stream's context and plans its launch, once per context.
ffi::Error InitializeContext(cu::CUstream stream, SiteState* site, const fastattn::QkvDims& d) {
  const cu::Driver* driver;
  cu::CUcontext context;
  if (auto err = StreamContext(stream, &driver, &context); err.failure()) return err;
  std::lock_guard<std::mutex> lock(site->mu);
  if (site->Find(context)) return ffi::Error::Success();
  const int n = site->count.load(std::memory_order_relaxed);
  if (n == SiteState::kMaxContexts) {
    return ffi::Error::Internal("CUDA attention: a call site ran on more than " +
                                std::to_string(SiteState::kMaxContexts) + " CUDA contexts");
  }
  ContextState& c = site->contexts[n];
  c = ContextState{};
  c.context = context;
  std::string error;
  c.kernel = cu::GetLoadedKernel(*driver, context, site->variant, &error);
  if (!c.kernel) return ffi::Error::Internal(error);
  const fastattn::QkvDims kd = KernelDims(d, site->fold_heads);
  c.plan = cu::PlanLaunch(site->variant, kd.B, kd.T, kd.S, kd.N, kd.K, kd.H, c.kernel->cc,
                          c.kernel->multiprocessors, c.kernel->blocks_per_sm);
  if (c.plan.blocks > INT32_MAX) {
    return ffi::Error::InvalidArgument("CUDA attention: " + std::to_string(c.plan.blocks) +
                                       " thread blocks exceed the grid limit");
  }
  if (c.plan.counters > 0) {
    if (auto rc = driver->cuCtxPushCurrent(context)) {
      return ffi::Error::Internal(cu::DriverError(*driver, rc, "cuCtxPushCurrent"));
    }
    if (auto rc = driver->cuMemAlloc(&c.counters, c.plan.counters * sizeof(unsigned))) {
      error = cu::DriverError(*driver, rc, "cuMemAlloc(split counters)");
    } else if (auto rc = driver->cuMemsetD32Async(c.counters, 0, c.plan.counters, stream)) {
      error = cu::DriverError(*driver, rc, "cuMemsetD32Async(split counters)");
      driver->cuMemFree(c.counters);
    }
    cu::CUcontext popped;
    driver->cuCtxPopCurrent(&popped);
    if (!error.empty()) return ffi::Error::Internal(error);
  }
  site->count.store(n + 1, std::memory_order_release);
  RecordLaunch(site->variant, kd, *c.kernel, c.plan);
  return ffi::Error::Success();
}

ffi::Error InitializeImpl(cu::CUstream stream, SiteState* site, ffi::AnyBuffer q,
                          ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::F32>,
                          ffi::Buffer<ffi::PRED>, ffi::Buffer<ffi::S32>, ffi::Buffer<ffi::S32>,
                          ffi::Buffer<ffi::S32>, ffi::Buffer<ffi::S32>, ffi::Buffer<ffi::F32>,
                          ffi::Buffer<ffi::F32>,
                          ffi::Buffer<ffi::S32> block_table, ffi::Buffer<ffi::F32> k_scale,
                          ffi::Buffer<ffi::F32> v_scale, ffi::Result<ffi::AnyBuffer> out,
                          ffi::ResultBuffer<ffi::F32>, ffi::ResultBuffer<ffi::F32>, CallAttrs) {
  fastattn::QkvDims d;
  const CacheOperands cache{block_table, k_scale, v_scale};
  fastattn::PagedKv paged;
  if (auto err = CheckCall(*site, q, k, v, *out, &d, &cache, &paged); err.failure()) {
    return err;
  }
  return InitializeContext(stream, site, d);
}

// The backward's buffers: d_out and the gradients as query, key and value
// (CheckCall's rules, with d_out in out's place; dq float32 of
// cu::DqAccumulatorDims where the variant adds it by atomics), lse, delta and
// magnitude (B, T, N).
ffi::Error CheckBackward(const SiteState& site, ffi::AnyBuffer q, ffi::AnyBuffer k,
                         ffi::AnyBuffer v, ffi::AnyBuffer d_out, ffi::Buffer<ffi::F32> lse,
                         ffi::Buffer<ffi::F32> delta, ffi::Buffer<ffi::F32> magnitude,
                         ffi::AnyBuffer dq, ffi::AnyBuffer dk,
                         ffi::AnyBuffer dv, fastattn::QkvDims* d) {
  const bool atomic = site.variant.backward == 2;
  if (auto err = CheckCall(site, q, k, v, d_out, d, nullptr, nullptr, nullptr, dk.element_type());
      err.failure()) {
    return err;
  }
  const int64_t rows = d->B * d->T * d->N;
  const std::vector<int64_t> dq_dims =
      atomic ? cu::DqAccumulatorDims(site.variant, d->B, d->T, d->N)
             : std::vector<int64_t>(q.dimensions().begin(), q.dimensions().end());
  if (d_out.element_type() != q.element_type() ||
      !std::equal(dq.dimensions().begin(), dq.dimensions().end(), dq_dims.begin(),
                  dq_dims.end()) ||
      dq.element_type() != (atomic ? ffi::DataType::F32 : dk.element_type()) ||
      dv.element_type() != dk.element_type() || dk.element_count() != k.element_count() ||
      dv.element_count() != v.element_count() ||
      static_cast<int64_t>(lse.element_count()) != rows ||
      static_cast<int64_t>(delta.element_count()) != rows ||
      static_cast<int64_t>(magnitude.element_count()) != rows) {
    return ffi::Error::InvalidArgument(
        "CUDA attention backward: d_out must be as query, dk and dv as key and value in the "
        "output dtype, " +
        (atomic ? "dq float32 " + fastattn::DimsString(dq_dims)
                : std::string("dq as query in it too")) +
        ", lse, delta and magnitude (B, T, N)");
  }
  return ffi::Error::Success();
}

ffi::Error InitializeBackwardImpl(cu::CUstream stream, SiteState* site, ffi::AnyBuffer q,
                                  ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::F32>,
                                  ffi::Buffer<ffi::PRED>, ffi::Buffer<ffi::S32>,
                                  ffi::Buffer<ffi::S32>, ffi::Buffer<ffi::S32>,
                                  ffi::Buffer<ffi::S32>, ffi::Buffer<ffi::F32>,
                                  ffi::Buffer<ffi::F32>, ffi::AnyBuffer d_out,
                                  ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> delta,
                                  ffi::Buffer<ffi::F32> magnitude,
                                  ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                                  ffi::Result<ffi::AnyBuffer> dv, CallAttrs) {
  fastattn::QkvDims d;
  if (auto err =
          CheckBackward(*site, q, k, v, d_out, lse, delta, magnitude, *dq, *dk, *dv, &d);
      err.failure()) {
    return err;
  }
  return InitializeContext(stream, site, d);
}

// Fills the operands (pointers, strides, shapes) of a call whose kernel sees
// the shapes `kd` (the buffers' `d` with heads folded into rows or not).
void FillOperands(const fastattn::QkvDims& d, const fastattn::QkvDims& kd, bool fold,
                  ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer out,
                  ffi::Buffer<ffi::F32> lse, const int32_t* kv_lens, FaOperands* p) {
  p->q = q.untyped_data(), p->k = k.untyped_data(), p->v = v.untyped_data();
  p->out = out.untyped_data();
  p->lse = lse.typed_data();
  p->kv_lens = kv_lens;
  p->B = static_cast<int>(kd.B), p->T = static_cast<int>(kd.T), p->S = static_cast<int>(kd.S);
  p->N = static_cast<int>(kd.N), p->K = static_cast<int>(kd.K), p->H = static_cast<int>(kd.H);
  // Dense buffers; folded, row t' = g of head n' = kvh is query head kvh * G + g.
  const long long G = d.N / d.K;
  const long long row = d.N * d.H;
  const long long rows[3] = {d.T * row, fold ? d.H : row, fold ? G * d.H : d.H};
  const long long lses[3] = {d.T * d.N, fold ? 1 : d.N, fold ? G : 1};
  const long long keys[3] = {d.S * d.K * d.H, d.K * d.H, d.H};
  std::copy(rows, rows + 3, p->q_stride);
  std::copy(rows, rows + 3, p->out_stride);
  std::copy(lses, lses + 3, p->lse_stride);
  std::copy(keys, keys + 3, p->kv_stride);
}

// The bias and mask (broadcast to (B, N, T, S) of `kd` by strides) and the
// query lengths of a call, each absent when its buffer is empty.
ffi::Error FillExtras(const fastattn::QkvDims& kd, ffi::Buffer<ffi::F32> bias,
                      ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::S32> q_lens, FaParams* p) {
  const int64_t full[4] = {kd.B, kd.N, kd.T, kd.S};
  int64_t strides[4];
  if (bias.element_count() > 0) {
    if (auto err = fastattn::BroadcastStrides("bias", bias.dimensions(), full, strides);
        err.failure()) {
      return err;
    }
    std::copy(strides, strides + 4, p->bias_strides);
    p->bias = bias.typed_data();
  }
  if (mask.element_count() > 0) {
    if (auto err = fastattn::BroadcastStrides("mask", mask.dimensions(), full, strides);
        err.failure()) {
      return err;
    }
    std::copy(strides, strides + 4, p->mask_strides);
    p->mask = reinterpret_cast<const unsigned char*>(mask.typed_data());
  }
  return fastattn::CheckLengths("query_seq_lengths", q_lens, kd.B, &p->q_lens);
}

// The split-KV workspace: the lowering sized it for the most the plan can
// take (PlanLaunch at MaxBlocksPerSm); the loaded kernel's plan takes at most that.
ffi::Error FillSplit(const ContextState& c, ffi::Buffer<ffi::F32> workspace, int64_t H,
                     FaSplitKV* s) {
  s->parts = c.plan.parts;
  if (c.plan.slots == 0) return ffi::Error::Success();
  if (static_cast<int64_t>(workspace.element_count()) < c.plan.workspace_floats) {
    return ffi::Error::InvalidArgument(
        "CUDA attention: the workspace holds " + std::to_string(workspace.element_count()) +
        " floats, the launch needs " + std::to_string(c.plan.workspace_floats));
  }
  s->partial_out = workspace.typed_data();
  s->partial_lse = s->partial_out + c.plan.slots * c.plan.tile.Br * H;
  s->counters = reinterpret_cast<unsigned*>(c.counters);
  return ffi::Error::Success();
}

// The TMA descriptors kernel 90 reads q, k and v through (FaTmaMaps), from
// the parameters' strides. With S == 0 no key tile is read and k, v keep
// empty descriptors.
ffi::Error EncodeTmaMaps(const cu::Driver& d, const FaParams& p, const FaTile& tile,
                         FaTmaMaps* maps) {
  if (!d.cuTensorMapEncodeTiled) {
    return ffi::Error::Internal(
        "the CUDA driver lacks cuTensorMapEncodeTiled, which the sm90 kernel needs: "
        "update the driver (CUDA 12 or newer)");
  }
  auto encode = [&](FaTensorMap* map, const void* data, const long long (&stride)[3], int heads,
                    int len, int rows, const char* name) {
    using u64 = unsigned long long;
    const u64 dims[4] = {u64(p.H), u64(heads), u64(len), u64(p.B)};
    const u64 strides[3] = {u64(stride[2]) * 2, u64(stride[1]) * 2, u64(stride[0]) * 2};
    const unsigned box[4] = {64, 1, unsigned(rows), 1};
    const unsigned element_strides[4] = {1, 1, 1, 1};
    const cu::CUresult rc = d.cuTensorMapEncodeTiled(
        map, cu::kTensorMapUint16, 4, const_cast<void*>(data), dims, strides, box,
        element_strides, cu::kTensorMapInterleaveNone, cu::kTensorMapSwizzle128B,
        cu::kTensorMapL2Promotion256B, cu::kTensorMapOobFillZeros);
    return cu::DriverError(d, rc, name);
  };
  std::string error = encode(&maps->q, p.q, p.q_stride, p.N, p.T, tile.Br,
                             "cuTensorMapEncodeTiled(query)");
  if (error.empty() && p.S > 0) {
    error = encode(&maps->k, p.k, p.kv_stride, p.K, p.S, tile.Bc,
                   "cuTensorMapEncodeTiled(key)");
    if (error.empty()) {
      error = encode(&maps->v, p.v, p.kv_stride, p.K, p.S, tile.Bc,
                     "cuTensorMapEncodeTiled(value)");
    }
  }
  return error.empty() ? ffi::Error::Success() : ffi::Error::Internal(error);
}

ffi::Error ExecuteImpl(cu::CUstream stream, SiteState* site, ffi::AnyBuffer q, ffi::AnyBuffer k,
                       ffi::AnyBuffer v, ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::PRED> mask,
                       ffi::Buffer<ffi::S32> q_lens, ffi::Buffer<ffi::S32> kv_lens,
                       ffi::Buffer<ffi::S32> q_spans, ffi::Buffer<ffi::S32> kv_spans,
                       ffi::Buffer<ffi::F32> sinks, ffi::Buffer<ffi::F32> alibi,
                       ffi::Buffer<ffi::S32> block_table, ffi::Buffer<ffi::F32> k_scale,
                       ffi::Buffer<ffi::F32> v_scale, ffi::Result<ffi::AnyBuffer> out,
                       ffi::ResultBuffer<ffi::F32> lse, ffi::ResultBuffer<ffi::F32> workspace,
                       CallAttrs) {
  fastattn::QkvDims d;
  const CacheOperands cache{block_table, k_scale, v_scale};
  fastattn::PagedKv paged;
  fastattn::KvScales scales;
  if (auto err = CheckCall(*site, q, k, v, *out, &d, &cache, &paged, &scales); err.failure()) {
    return err;
  }
  const cu::Driver* driver;
  cu::CUcontext context;
  if (auto err = StreamContext(stream, &driver, &context); err.failure()) return err;
  const ContextState* c = site->Find(context);
  if (!c) {
    return ffi::Error::Internal("CUDA attention: the call site was not initialized on this "
                                "CUDA context");
  }
  if (d.B == 0 || d.N == 0 || d.T == 0) return ffi::Error::Success();
  const fastattn::QkvDims kd = KernelDims(d, site->fold_heads);
  const int32_t* kv_data;
  if (auto err = fastattn::CheckLengths("key_value_seq_lengths", kv_lens, d.B, &kv_data);
      err.failure()) {
    return err;
  }
  const cu::LoadedKernel& kn = *c->kernel;
  FaParams p{};
  FaDecodeParams dp{};
  FaTmaMaps maps{};
  void* args[2];
  if (site->variant.decode_rows) {
    FillOperands(d, kd, false, q, k, v, *out, *lse, kv_data, &dp);
    if (paged.block_table) {
      dp.kv_stride[0] = paged.page_size * d.K * d.H;
      dp.paged = FaPages{paged.block_table, static_cast<int>(paged.max_pages),
                         static_cast<int>(paged.pages),
                         static_cast<int>(paged.page_shift)};
    }
    if (scales.k) {
      dp.scales = FaKvScales{scales.k, scales.v,
                             {scales.k_strides[0], scales.k_strides[1], scales.k_strides[2]},
                             {scales.v_strides[0], scales.v_strides[1], scales.v_strides[2]}};
    }
    dp.rules = site->rules;
    if (auto err = FillSplit(*c, *workspace, d.H, &dp.split); err.failure()) return err;
    args[0] = &dp;
  } else {
    FillOperands(d, kd, site->fold_heads, q, k, v, *out, *lse, kv_data, &p);
    p.rules = site->rules;
    if (auto err = FillSplit(*c, *workspace, d.H, &p.split); err.failure()) return err;
    if (auto err = FillExtras(kd, bias, mask, q_lens, &p); err.failure()) return err;
    if (auto err = fastattn::CheckFeatures(q_spans, kv_spans, sinks, alibi, kd, &p.features);
        err.failure()) {
      return err;
    }
    if (site->variant.kernel_sm == 90) {
      if (auto err = EncodeTmaMaps(*driver, p, kn.tile, &maps); err.failure()) return err;
    }
    args[0] = &p;
    args[1] = &maps;  // kernel 90 takes both, the others p only
  }
  std::string error =
      cu::Launch(*driver, kn.function, static_cast<unsigned>(c->plan.blocks), kn.tile.threads,
                 kn.tile.smem_bytes, c->plan.cluster, stream, args, "launching fa_forward");
  if (error.empty() && kn.merge && c->plan.slots > 0) {
    error = cu::Launch(*driver, kn.merge, static_cast<unsigned>(c->plan.units), kFaMergeThreads,
                       0, 1, stream, args, "launching fa_merge");
  }
  return error.empty() ? ffi::Error::Success() : ffi::Error::Internal(error);
}

ffi::Error ExecuteBackwardImpl(cu::CUstream stream, SiteState* site, ffi::AnyBuffer q,
                               ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::F32> bias,
                               ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::S32> q_lens,
                               ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> q_spans,
                               ffi::Buffer<ffi::S32> kv_spans, ffi::Buffer<ffi::F32> sinks,
                               ffi::Buffer<ffi::F32> alibi, ffi::AnyBuffer d_out,
                               ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> delta,
                               ffi::Buffer<ffi::F32> magnitude,
                               ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                               ffi::Result<ffi::AnyBuffer> dv, CallAttrs) {
  fastattn::QkvDims d;
  if (auto err =
          CheckBackward(*site, q, k, v, d_out, lse, delta, magnitude, *dq, *dk, *dv, &d);
      err.failure()) {
    return err;
  }
  const cu::Driver* driver;
  cu::CUcontext context;
  if (auto err = StreamContext(stream, &driver, &context); err.failure()) return err;
  const ContextState* c = site->Find(context);
  if (!c) {
    return ffi::Error::Internal("CUDA attention backward: the call site was not initialized "
                                "on this CUDA context");
  }
  if (d.B == 0 || d.N == 0) return ffi::Error::Success();
  FaGradParams p{};
  const int32_t* kv_data;
  if (auto err = fastattn::CheckLengths("key_value_seq_lengths", kv_lens, d.B, &kv_data);
      err.failure()) {
    return err;
  }
  if (auto err = FillExtras(d, bias, mask, q_lens, &p); err.failure()) return err;
  if (auto err = fastattn::CheckFeatures(q_spans, kv_spans, sinks, alibi, d, &p.features);
      err.failure()) {
    return err;
  }
  // d_out stands in out's place: the kernels read it with out's strides.
  FillOperands(d, d, false, q, k, v, d_out, lse, kv_data, &p);
  p.rules = site->rules;
  p.split.parts = 1;
  p.d_out = d_out.untyped_data();
  p.delta = delta.typed_data();
  p.magnitude = magnitude.typed_data();
  p.dq = dq->untyped_data(), p.dk = dk->untyped_data(), p.dv = dv->untyped_data();
  std::copy(p.kv_stride, p.kv_stride + 3, p.dkv_stride);
  const cu::LoadedKernel& kn = *c->kernel;
  void* args[1] = {&p};
  std::string error;
  if (site->variant.backward == 2) {  // fa_backward_dkdv adds dQ into zeros
    if (auto rc = driver->cuMemsetD32Async(reinterpret_cast<cu::CUdeviceptr>(p.dq), 0,
                                           dq->element_count(), stream)) {
      return ffi::Error::Internal(cu::DriverError(*driver, rc, "cuMemsetD32Async(dq)"));
    }
  }
  if (c->plan.blocks > 0) {
    error = cu::Launch(*driver, kn.function, static_cast<unsigned>(c->plan.blocks),
                       kn.tile.threads, kn.tile.smem_bytes, 1, stream, args,
                       "launching fa_backward_dkdv");
  }
  if (error.empty() && c->plan.units > 0) {
    error = cu::Launch(*driver, kn.dq, static_cast<unsigned>(c->plan.units), kn.tile.threads,
                       kn.tile.smem_bytes, 1, stream, args, "launching fa_backward_dq");
  }
  return error.empty() ? ffi::Error::Success() : ffi::Error::Internal(error);
}

}  // namespace

// The context and the operands both targets start with.
#define FASTATTN_CUDA_OPERANDS(stage)                                \
  ffi::Ffi::Bind<stage>()                                           \
      .Ctx<ffi::PlatformStream<cu::CUstream>>()                     \
      .Ctx<ffi::State<SiteState>>()                                 \
      .Arg<ffi::AnyBuffer>()         /* query */                    \
      .Arg<ffi::AnyBuffer>()         /* key */                      \
      .Arg<ffi::AnyBuffer>()         /* value */                    \
      .Arg<ffi::Buffer<ffi::F32>>()  /* bias or empty */            \
      .Arg<ffi::Buffer<ffi::PRED>>() /* mask or empty */            \
      .Arg<ffi::Buffer<ffi::S32>>()  /* query lengths or empty */   \
      .Arg<ffi::Buffer<ffi::S32>>()  /* key lengths or empty */     \
      .Arg<ffi::Buffer<ffi::S32>>()  /* query segment spans */      \
      .Arg<ffi::Buffer<ffi::S32>>()  /* key segment spans */        \
      .Arg<ffi::Buffer<ffi::F32>>()  /* sinks or empty */           \
      .Arg<ffi::Buffer<ffi::F32>>()  /* ALiBi slopes or empty */

#define FASTATTN_CUDA_BINDING(stage)                                 \
  FASTATTN_CUDA_OPERANDS(stage)                                     \
      .Arg<ffi::Buffer<ffi::S32>>()  /* block table or empty */     \
      .Arg<ffi::Buffer<ffi::F32>>()  /* k_scale or empty */         \
      .Arg<ffi::Buffer<ffi::F32>>()  /* v_scale or empty */         \
      .Ret<ffi::AnyBuffer>()         /* out */                      \
      .Ret<ffi::Buffer<ffi::F32>>()  /* lse */                      \
      .Ret<ffi::Buffer<ffi::F32>>()  /* split-KV workspace */       \
      .Attrs<CallAttrs>()

#define FASTATTN_CUDA_BACKWARD_BINDING(stage)                        \
  FASTATTN_CUDA_OPERANDS(stage)                                     \
      .Arg<ffi::AnyBuffer>()         /* d_out */                    \
      .Arg<ffi::Buffer<ffi::F32>>()  /* lse */                      \
      .Arg<ffi::Buffer<ffi::F32>>()  /* delta: rowsum(dO o O) - dLSE */ \
      .Arg<ffi::Buffer<ffi::F32>>()  /* magnitude: rowsum(|dO o O|) */ \
      .Ret<ffi::AnyBuffer>()         /* dq */                       \
      .Ret<ffi::AnyBuffer>()         /* dk */                       \
      .Ret<ffi::AnyBuffer>()         /* dv */                       \
      .Attrs<CallAttrs>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttentionCudaBackwardInitialize, InitializeBackwardImpl,
                              FASTATTN_CUDA_BACKWARD_BINDING(ffi::ExecutionStage::kInitialize));
XLA_FFI_DEFINE_HANDLER_SYMBOL(AttentionCudaBackwardExecute, ExecuteBackwardImpl,
                              FASTATTN_CUDA_BACKWARD_BINDING(ffi::ExecutionStage::kExecute),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttentionCudaInstantiate, InstantiateImpl,
                              ffi::Ffi::Bind<ffi::ExecutionStage::kInstantiate>()
                                  .Attrs<CallAttrs>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(AttentionCudaInitialize, InitializeImpl,
                              FASTATTN_CUDA_BINDING(ffi::ExecutionStage::kInitialize));
XLA_FFI_DEFINE_HANDLER_SYMBOL(AttentionCudaExecute, ExecuteImpl,
                              FASTATTN_CUDA_BINDING(ffi::ExecutionStage::kExecute),
                              {ffi::Traits::kCmdBufferCompatible});
