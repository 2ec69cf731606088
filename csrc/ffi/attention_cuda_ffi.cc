// XLA FFI handlers of the fused CUDA attention (platform "CUDA").
//
// Two stages: "initialize" runs before each execution and outside any CUDA
// graph capture, and finds or builds the kernel for the stream's device
// (NVRTC compile, disk cache, module load: csrc/cuda/kernel_cache.cc);
// "execute" only fills FaParams and launches on XLA's stream, so it is safe
// to capture into a command buffer. The decode target has a third stage,
// "instantiate", which gives each call site its split counters (state that
// outlives the calls, see DecodeCounters).
#include <algorithm>
#include <climits>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "cuda/driver.h"
#include "cuda/kernel_cache.h"
#include "ffi/attention_attrs.h"
#include "ffi/handlers.h"
#include "kernels/cuda/attention_common.cuh"

namespace ffi = xla::ffi;
using fastattn::AttentionAttrs;
using fastattn::DecodeAttrs;
using fastattn::BroadcastStrides;
namespace cu = fastattn::cuda;

namespace {

int DtypeCode(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F16: return 0;
    case ffi::DataType::BF16: return 1;
    case ffi::DataType::F32: return 2;
    default: return -1;
  }
}

// What both handlers fill alike: checks the q, k, v shapes into *d, and
// sets FaParams' shapes, operand pointers and index rules (the rest zero).
template <typename Attrs>
ffi::Error StartParams(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer out,
                       ffi::Buffer<ffi::F32> lse, const Attrs& attrs, FaParams* p,
                       fastattn::QkvDims* d) {
  if (auto err = fastattn::CheckQkv(q.dimensions(), k.dimensions(), v.dimensions(), d);
      err.failure()) {
    return err;
  }
  *p = FaParams{};
  p->B = d->B, p->T = d->T, p->S = d->S, p->N = d->N, p->K = d->K, p->H = d->H;
  p->q = q.untyped_data(), p->k = k.untyped_data(), p->v = v.untyped_data();
  p->out = out.untyped_data();
  p->lse = lse.typed_data();
  p->scale = attrs.scale;
  p->softcap = attrs.softcap;
  p->causal = attrs.is_causal != 0;
  p->end_aligned = attrs.end_aligned != 0;
  p->window_left = static_cast<int>(attrs.window_left);
  p->window_right = static_cast<int>(attrs.window_right);
  return ffi::Error::Success();
}

// Checks the operands, fills the parameters and picks the variant.
ffi::Error Prepare(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::F32> bias,
                   ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::S32> q_lens,
                   ffi::Buffer<ffi::S32> kv_lens, ffi::AnyBuffer out, ffi::Buffer<ffi::F32> lse,
                   const AttentionAttrs& attrs, FaParams* p, cu::KernelVariant* variant) {
  fastattn::QkvDims d;
  if (auto err = StartParams(q, k, v, out, lse, attrs, p, &d); err.failure()) return err;
  variant->path = static_cast<int>(attrs.kernel_path);
  variant->head_dim = p->H;
  variant->dtype = DtypeCode(q.element_type());
  variant->out_dtype = DtypeCode(out.element_type());
  // Plain kernels take row maxima of the unscaled logits, valid for scale > 0.
  variant->general = bias.element_count() > 0 || mask.element_count() > 0 ||
                     attrs.softcap > 0 || !(attrs.scale > 0);
  if (k.element_type() != q.element_type() || v.element_type() != q.element_type() ||
      variant->dtype > 1 || variant->out_dtype < 0) {
    return ffi::Error::InvalidArgument(
        "CUDA attention takes float16 or bfloat16 query, key and value of one dtype and "
        "writes float16, bfloat16 or float32");
  }
  if (std::string why = variant->Check(); !why.empty()) {
    return ffi::Error::InvalidArgument("CUDA attention kernel " + variant->Describe() + ": " + why);
  }
  // Split-KV: out and lse hold kv_splits partial results, (kv_splits * B, T, N, H) float32.
  const auto od = out.dimensions();
  p->kv_splits = d.B > 0 && od.size() == 4 ? static_cast<int>(od[0] / d.B) : 1;
  if (d.B > 0 && (od.size() != 4 || od[0] % d.B != 0 || p->kv_splits < 1 || od[1] != d.T ||
                  od[2] != d.N || od[3] != d.H ||
                  (p->kv_splits > 1 && variant->out_dtype != 2))) {
    return ffi::Error::InvalidArgument(
        "CUDA attention: out " + fastattn::DimsString(od) + " is neither (B, T, N, H) = " +
        fastattn::DimsString(q.dimensions()) + " nor float32 (kv_splits * B, T, N, H)");
  }
  const int64_t full[4] = {p->B, p->N, p->T, p->S};
  int64_t strides[4];
  if (bias.element_count() > 0) {
    if (auto err = BroadcastStrides("bias", bias.dimensions(), full, strides); err.failure()) {
      return err;
    }
    std::copy(strides, strides + 4, p->bias_strides);
    p->bias = bias.typed_data();
  }
  if (mask.element_count() > 0) {
    if (auto err = BroadcastStrides("mask", mask.dimensions(), full, strides); err.failure()) {
      return err;
    }
    std::copy(strides, strides + 4, p->mask_strides);
    p->mask = reinterpret_cast<const unsigned char*>(mask.typed_data());
  }
  if (auto err = fastattn::CheckLengths("query_seq_lengths", q_lens, p->B, &p->q_lens);
      err.failure()) {
    return err;
  }
  if (auto err = fastattn::CheckLengths("key_value_seq_lengths", kv_lens, p->B, &p->kv_lens);
      err.failure()) {
    return err;
  }
  return ffi::Error::Success();
}

// Finds the kernel `variant` for the device of `stream`, building it if needed.
ffi::Error LoadKernel(cu::CUstream stream, const cu::KernelVariant& variant,
                      const cu::Driver** driver, const cu::LoadedKernel** kernel) {
  std::string error;
  *driver = cu::GetDriver(&error);
  if (!*driver) return ffi::Error::Internal(error);
  cu::CUcontext context;
  if (auto rc = (*driver)->cuStreamGetCtx(stream, &context)) {
    return ffi::Error::Internal(cu::DriverError(**driver, rc, "cuStreamGetCtx"));
  }
  *kernel = cu::GetLoadedKernel(**driver, context, variant, &error);
  return *kernel ? ffi::Error::Success() : ffi::Error::Internal(error);
}

// Checks the operands and finds the kernel for the device of `stream`.
ffi::Error FindKernel(cu::CUstream stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                      ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::PRED> mask,
                      ffi::Buffer<ffi::S32> q_lens, ffi::Buffer<ffi::S32> kv_lens,
                      ffi::AnyBuffer out, ffi::Buffer<ffi::F32> lse, const AttentionAttrs& attrs,
                      FaParams* p, const cu::Driver** driver, const cu::LoadedKernel** kernel) {
  cu::KernelVariant variant;
  if (auto err = Prepare(q, k, v, bias, mask, q_lens, kv_lens, out, lse, attrs, p, &variant);
      err.failure()) {
    return err;
  }
  return LoadKernel(stream, variant, driver, kernel);
}

// The TMA descriptors FA_PATH 90 reads q, k and v through (FaTmaMaps).
// With S == 0 no key tile is read and k, v keep empty descriptors.
ffi::Error EncodeTmaMaps(const cu::Driver& d, const FaParams& p, const cu::LoadedKernel& kn,
                         FaTmaMaps* maps) {
  if (!d.cuTensorMapEncodeTiled) {
    return ffi::Error::Internal(
        "the CUDA driver lacks cuTensorMapEncodeTiled, which the sm90 kernel needs: "
        "update the driver (CUDA 12 or newer)");
  }
  auto encode = [&](FaTensorMap* map, const void* data, int heads, int len, int rows,
                    const char* name) {
    using u64 = unsigned long long;
    const u64 row_bytes = u64(p.H) * 2;
    const u64 dims[4] = {u64(p.H), u64(heads), u64(len), u64(p.B)};
    const u64 strides[3] = {row_bytes, row_bytes * heads, row_bytes * heads * len};
    const unsigned box[4] = {64, 1, unsigned(rows), 1};
    const unsigned element_strides[4] = {1, 1, 1, 1};
    const cu::CUresult rc = d.cuTensorMapEncodeTiled(
        map, cu::kTensorMapUint16, 4, const_cast<void*>(data), dims, strides, box,
        element_strides, cu::kTensorMapInterleaveNone, cu::kTensorMapSwizzle128B,
        cu::kTensorMapL2Promotion256B, cu::kTensorMapOobFillZeros);
    return cu::DriverError(d, rc, name);
  };
  std::string error = encode(&maps->q, p.q, p.N, p.T, kn.block_m, "cuTensorMapEncodeTiled(query)");
  if (error.empty() && p.S > 0) {
    error = encode(&maps->k, p.k, p.K, p.S, kn.block_n, "cuTensorMapEncodeTiled(key)");
    if (error.empty()) {
      error = encode(&maps->v, p.v, p.K, p.S, kn.block_n, "cuTensorMapEncodeTiled(value)");
    }
  }
  return error.empty() ? ffi::Error::Success() : ffi::Error::Internal(error);
}

ffi::Error InitializeImpl(cu::CUstream stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                          ffi::AnyBuffer v, ffi::Buffer<ffi::F32> bias,
                          ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::S32> q_lens,
                          ffi::Buffer<ffi::S32> kv_lens, ffi::Result<ffi::AnyBuffer> out,
                          ffi::ResultBuffer<ffi::F32> lse, AttentionAttrs attrs) {
  FaParams p;
  const cu::Driver* driver;
  const cu::LoadedKernel* kernel;
  return FindKernel(stream, q, k, v, bias, mask, q_lens, kv_lens, *out, *lse, attrs, &p, &driver,
                    &kernel);
}

ffi::Error ExecuteImpl(cu::CUstream stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::PRED> mask,
                       ffi::Buffer<ffi::S32> q_lens, ffi::Buffer<ffi::S32> kv_lens,
                       ffi::Result<ffi::AnyBuffer> out, ffi::ResultBuffer<ffi::F32> lse,
                       AttentionAttrs attrs) {
  FaParams p;
  const cu::Driver* driver;
  const cu::LoadedKernel* kernel;
  if (auto err = FindKernel(stream, q, k, v, bias, mask, q_lens, kv_lens, *out, *lse, attrs, &p,
                            &driver, &kernel);
      err.failure()) {
    return err;
  }
  const cu::LoadedKernel& kn = *kernel;
  if (p.B == 0 || p.N == 0 || p.T == 0) return ffi::Error::Success();
  const int64_t blocks =
      (int64_t{p.T} + kn.block_m - 1) / kn.block_m * p.N * p.B * p.kv_splits;
  if (blocks > INT32_MAX) {
    return ffi::Error::InvalidArgument("CUDA attention: ceil(T / " + std::to_string(kn.block_m) +
                                       ") * N * B * kv_splits = " + std::to_string(blocks) +
                                       " thread blocks exceed the grid limit");
  }
  FaTmaMaps maps{};
  if (attrs.kernel_path == 90) {
    if (auto err = EncodeTmaMaps(*driver, p, kn, &maps); err.failure()) return err;
  }
  void* args[] = {&p, &maps};  // path 90 takes both, the others p only
  if (auto rc = driver->cuLaunchKernel(kn.function, static_cast<unsigned>(blocks), 1, 1,
                                       kn.threads, 1, 1, kn.smem_bytes, stream, args, nullptr)) {
    return ffi::Error::Internal(cu::DriverError(*driver, rc, "cuLaunchKernel(fa_forward)"));
  }
  return ffi::Error::Success();
}


// --- The decode kernel (attention_decode.cu) ----------------------------------

// Rows per block the decode kernel is built for: T * G rounded up to a power
// of two; 0 when T * G > 8 (the host never sends such calls here).
int DecodeRows(int64_t rows) {
  for (int r : {1, 2, 4, 8}) {
    if (rows <= r) return r;
  }
  return 0;
}

// Floats of the decode workspace for up to `splits` splits: partial out,
// then partial LSE; none without a split.
int64_t DecodeWorkspaceWords(int64_t B, int64_t K, int64_t H, int rows, int64_t splits) {
  return splits > 1 ? B * K * splits * rows * (H + 1) : 0;
}

// Split-KV: the number of splits, at most `most` (the workspace's bound), for
// `heads` = B * K key/value heads of S keys on a GPU with `wave` resident
// blocks. Blocks run in ceil(heads * splits / wave) waves, each as long as a
// split's keys plus a fixed cost (launch, first loads, the merge and the
// tail: about kSplitCostKeys keys' worth); the count with the shortest
// modeled time wins, the smallest on ties. A partial extra wave doubles the
// time (400 blocks on 396 slots: 544 us against 413 us at B = 1, S = 256K).
// The fixed cost, fitted on the H100 at H = 128 (B = 1, S = 128K: 16 splits
// in one wave 196 us, 33 in two 200 us; B = 8, S = 128K: 2 splits in one
// wave 1441 us, 33 in sixteen 1458 us), is 180-430 keys' worth: one wave of
// blocks that leave a few multiprocessors idle beats more waves that fill
// them, as memory bandwidth, not the multiprocessors, bounds the walk.
int DecodeSplits(int64_t heads, int64_t S, int64_t most, int64_t wave) {
  constexpr int64_t kSplitCostKeys = 512;
  int best = 1;
  int64_t best_cost = INT64_MAX;
  for (int64_t s = 1; s <= most; ++s) {
    const int64_t waves = (heads * s + wave - 1) / std::max<int64_t>(wave, 1);
    const int64_t cost = waves * ((S + s - 1) / s + kSplitCostKeys);
    if (cost < best_cost) best = static_cast<int>(s), best_cost = cost;
  }
  return best;
}

}  // namespace

// The split-KV counters of one decode call site (one HLO instruction): B * K
// words per CUDA context, allocated and zeroed by the "initialize" stage the
// first time the site runs on that context. The kernel's last block of each
// (b, kvh) sets its word back to 0, so the counters are zero at every launch
// without a memset node before each one. Made by the "instantiate" stage and
// freed with the executable; launches of one site on one context are ordered
// on XLA's stream, so they never share the words at the same time.
struct DecodeCounters {
  static ffi::TypeId id;
  struct Slab {
    cu::CUcontext context;
    cu::CUdeviceptr words;
    int64_t count;
  };
  std::mutex mu;
  std::vector<Slab> slabs;

  ~DecodeCounters() {
    std::string error;
    const cu::Driver* d = cu::GetDriver(&error);
    if (!d) return;
    for (const Slab& s : slabs) {
      if (d->cuCtxPushCurrent(s.context) != 0) continue;  // context gone, and the memory with it
      d->cuMemFree(s.words);
      cu::CUcontext popped;
      d->cuCtxPopCurrent(&popped);
    }
  }
};

ffi::TypeId DecodeCounters::id = XLA_FFI_UNKNOWN_TYPE_ID;

XLA_FFI_TypeId* DecodeCountersTypeId() { return &DecodeCounters::id; }

const XLA_FFI_TypeInfo* DecodeCountersTypeInfo() {
  static const XLA_FFI_TypeInfo info = {XLA_FFI_TypeInfo_STRUCT_SIZE, nullptr,
                                        [](void* state) { delete static_cast<DecodeCounters*>(state); }};
  return &info;
}

namespace {

// The `count` counters of `site` on `context` (that of `stream`, as found
// when the kernel was looked up): allocated and zeroed (in stream order) if
// `allocate` and not there yet.
ffi::Error SiteCounters(const cu::Driver& d, cu::CUcontext context, cu::CUstream stream,
                        DecodeCounters* site, int64_t count, bool allocate,
                        unsigned** counters) {
  std::lock_guard<std::mutex> lock(site->mu);
  for (const DecodeCounters::Slab& s : site->slabs) {
    if (s.context != context) continue;
    if (s.count < count) {  // a site's shapes are fixed: never expected
      return ffi::Error::Internal("CUDA decode attention: the call site's split counters hold " +
                                  std::to_string(s.count) + " words, the call needs " +
                                  std::to_string(count));
    }
    *counters = reinterpret_cast<unsigned*>(s.words);
    return ffi::Error::Success();
  }
  if (!allocate) {
    return ffi::Error::Internal("CUDA decode attention: no split counters of " +
                                std::to_string(count) +
                                " words for this context; the initialize stage makes them");
  }
  DecodeCounters::Slab slab{context, 0, count};
  if (auto rc = d.cuCtxPushCurrent(context)) {
    return ffi::Error::Internal(cu::DriverError(d, rc, "cuCtxPushCurrent"));
  }
  std::string error;
  if (auto rc = d.cuMemAlloc(&slab.words, count * sizeof(unsigned))) {
    error = cu::DriverError(d, rc, "cuMemAlloc(split counters)");
  } else if (auto rc = d.cuMemsetD32Async(slab.words, 0, count, stream)) {
    error = cu::DriverError(d, rc, "cuMemsetD32Async(split counters)");
    d.cuMemFree(slab.words);
  }
  cu::CUcontext popped;
  d.cuCtxPopCurrent(&popped);
  if (!error.empty()) return ffi::Error::Internal(error);
  site->slabs.push_back(slab);
  *counters = reinterpret_cast<unsigned*>(slab.words);
  return ffi::Error::Success();
}

// Checks the operands, fills the parameters (all but the workspace pointers)
// and picks the decode variant.
ffi::Error PrepareDecode(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                         ffi::Buffer<ffi::S32> kv_lens, ffi::AnyBuffer out,
                         ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> workspace,
                         const DecodeAttrs& attrs, FaParams* p, cu::KernelVariant* variant) {
  fastattn::QkvDims d;
  if (auto err = StartParams(q, k, v, out, lse, attrs, p, &d); err.failure()) return err;
  const int64_t rows = d.K ? d.T * (d.N / d.K) : 0;
  variant->path = attrs.kernel_path >= 80 ? 80 : 75;  // with cp.async or without
  variant->decode_rows = DecodeRows(rows);
  variant->head_dim = static_cast<int>((d.H + 31) / 32 * 32);
  variant->dtype = DtypeCode(q.element_type());
  variant->out_dtype = DtypeCode(out.element_type());
  if (k.element_type() != q.element_type() || v.element_type() != q.element_type() ||
      variant->dtype < 0 || variant->dtype > 1 || variant->out_dtype < 0) {
    return ffi::Error::InvalidArgument(
        "CUDA decode attention takes float16 or bfloat16 query, key and value of one dtype "
        "and writes float16, bfloat16 or float32");
  }
  if (variant->decode_rows == 0 || d.H % 8 != 0 || d.H > 256 || attrs.kv_splits < 1 ||
      attrs.kv_splits > 128) {
    return ffi::Error::InvalidArgument(
        "CUDA decode attention needs T * N / K <= 8, H a multiple of 8 up to 256 and "
        "1 <= kv_splits <= 128; got query " + fastattn::DimsString(q.dimensions()) + ", key " +
        fastattn::DimsString(k.dimensions()) + ", kv_splits " + std::to_string(attrs.kv_splits));
  }
  if (out.dimensions().size() != 4 ||
      !std::equal(out.dimensions().begin(), out.dimensions().end(), q.dimensions().begin())) {
    return ffi::Error::InvalidArgument("CUDA decode attention: out " +
                                       fastattn::DimsString(out.dimensions()) +
                                       " is not (B, T, N, H) = " +
                                       fastattn::DimsString(q.dimensions()));
  }
  // The workspace is sized for attrs.kv_splits, the most splits the call may use.
  const int64_t words = DecodeWorkspaceWords(d.B, d.K, d.H, variant->decode_rows, attrs.kv_splits);
  if (static_cast<int64_t>(workspace.element_count()) != words) {
    return ffi::Error::InvalidArgument(
        "CUDA decode attention: the workspace holds " +
        std::to_string(workspace.element_count()) + " floats, the call needs " +
        std::to_string(words));
  }
  p->kv_splits = static_cast<int>(attrs.kv_splits);
  if (auto err = fastattn::CheckLengths("key_value_seq_lengths", kv_lens, p->B, &p->kv_lens);
      err.failure()) {
    return err;
  }
  return ffi::Error::Success();
}

// Checks the operands and finds the decode kernel for the device of `stream`.
ffi::Error FindDecodeKernel(cu::CUstream stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                            ffi::AnyBuffer v, ffi::Buffer<ffi::S32> kv_lens, ffi::AnyBuffer out,
                            ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> workspace,
                            const DecodeAttrs& attrs, FaParams* p, cu::KernelVariant* variant,
                            const cu::Driver** driver, const cu::LoadedKernel** kernel) {
  if (auto err = PrepareDecode(q, k, v, kv_lens, out, lse, workspace, attrs, p, variant);
      err.failure()) {
    return err;
  }
  return LoadKernel(stream, *variant, driver, kernel);
}

ffi::ErrorOr<std::unique_ptr<DecodeCounters>> DecodeInstantiateImpl(DecodeAttrs) {
  return std::make_unique<DecodeCounters>();
}

ffi::Error DecodeInitializeImpl(cu::CUstream stream, DecodeCounters* site, ffi::AnyBuffer q,
                                ffi::AnyBuffer k, ffi::AnyBuffer v,
                                ffi::Buffer<ffi::S32> kv_lens, ffi::Result<ffi::AnyBuffer> out,
                                ffi::ResultBuffer<ffi::F32> lse,
                                ffi::ResultBuffer<ffi::F32> workspace, DecodeAttrs attrs) {
  FaParams p;
  cu::KernelVariant variant;
  const cu::Driver* driver;
  const cu::LoadedKernel* kernel;
  if (auto err = FindDecodeKernel(stream, q, k, v, kv_lens, *out, *lse, *workspace, attrs, &p,
                                  &variant, &driver, &kernel);
      err.failure()) {
    return err;
  }
  if (p.kv_splits <= 1 || p.B == 0 || p.K == 0) return ffi::Error::Success();
  unsigned* counters;
  return SiteCounters(*driver, kernel->context, stream, site, int64_t{p.B} * p.K,
                      /*allocate=*/true, &counters);
}

ffi::Error DecodeExecuteImpl(cu::CUstream stream, DecodeCounters* site, ffi::AnyBuffer q,
                             ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::S32> kv_lens,
                             ffi::Result<ffi::AnyBuffer> out, ffi::ResultBuffer<ffi::F32> lse,
                             ffi::ResultBuffer<ffi::F32> workspace, DecodeAttrs attrs) {
  FaParams p;
  cu::KernelVariant variant;
  const cu::Driver* driver;
  const cu::LoadedKernel* kernel;
  if (auto err = FindDecodeKernel(stream, q, k, v, kv_lens, *out, *lse, *workspace, attrs, &p,
                                  &variant, &driver, &kernel);
      err.failure()) {
    return err;
  }
  if (p.B == 0 || p.N == 0 || p.T == 0) return ffi::Error::Success();
  const int64_t heads = int64_t{p.B} * p.K;
  p.kv_splits = DecodeSplits(heads, p.S, p.kv_splits,
                             int64_t{kernel->blocks_per_sm} * kernel->multiprocessors);
  if (p.kv_splits > 1) {
    const int64_t parts = heads * p.kv_splits * variant.decode_rows;
    p.partial_out = workspace->typed_data();
    p.partial_lse = p.partial_out + parts * p.H;
    if (auto err = SiteCounters(*driver, kernel->context, stream, site, heads,
                                /*allocate=*/false, &p.counters);
        err.failure()) {
      return err;
    }
  }
  const int64_t blocks = heads * p.kv_splits;
  if (blocks > INT32_MAX) {
    return ffi::Error::InvalidArgument("CUDA decode attention: B * K * kv_splits = " +
                                       std::to_string(blocks) +
                                       " thread blocks exceed the grid limit");
  }
  void* args[] = {&p};
  if (auto rc = driver->cuLaunchKernel(kernel->function, static_cast<unsigned>(blocks), 1, 1,
                                       kernel->threads, 1, 1, kernel->smem_bytes, stream, args,
                                       nullptr)) {
    return ffi::Error::Internal(cu::DriverError(*driver, rc, "cuLaunchKernel(decode)"));
  }
  return ffi::Error::Success();
}

}  // namespace

#define FASTATTN_CUDA_BINDING(stage)                      \
  ffi::Ffi::Bind<stage>()                                \
      .Ctx<ffi::PlatformStream<cu::CUstream>>()          \
      .Arg<ffi::AnyBuffer>()         /* query */         \
      .Arg<ffi::AnyBuffer>()         /* key */           \
      .Arg<ffi::AnyBuffer>()         /* value */         \
      .Arg<ffi::Buffer<ffi::F32>>()  /* bias or empty */ \
      .Arg<ffi::Buffer<ffi::PRED>>() /* mask or empty */ \
      .Arg<ffi::Buffer<ffi::S32>>()  /* query lengths */ \
      .Arg<ffi::Buffer<ffi::S32>>()  /* key lengths */   \
      .Ret<ffi::AnyBuffer>()         /* out */           \
      .Ret<ffi::Buffer<ffi::F32>>()  /* lse */           \
      .Attrs<AttentionAttrs>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttentionForwardCudaInitialize, InitializeImpl,
                              FASTATTN_CUDA_BINDING(ffi::ExecutionStage::kInitialize));
XLA_FFI_DEFINE_HANDLER_SYMBOL(AttentionForwardCudaExecute, ExecuteImpl,
                              FASTATTN_CUDA_BINDING(ffi::ExecutionStage::kExecute),
                              {ffi::Traits::kCmdBufferCompatible});

#define FASTATTN_DECODE_BINDING(stage)                    \
  ffi::Ffi::Bind<stage>()                                \
      .Ctx<ffi::PlatformStream<cu::CUstream>>()          \
      .Ctx<ffi::State<DecodeCounters>>()                 \
      .Arg<ffi::AnyBuffer>()         /* query */         \
      .Arg<ffi::AnyBuffer>()         /* key */           \
      .Arg<ffi::AnyBuffer>()         /* value */         \
      .Arg<ffi::Buffer<ffi::S32>>()  /* key lengths */   \
      .Ret<ffi::AnyBuffer>()         /* out */           \
      .Ret<ffi::Buffer<ffi::F32>>()  /* lse */           \
      .Ret<ffi::Buffer<ffi::F32>>()  /* workspace */     \
      .Attrs<DecodeAttrs>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeCudaInstantiate, DecodeInstantiateImpl,
                              ffi::Ffi::Bind<ffi::ExecutionStage::kInstantiate>()
                                  .Attrs<DecodeAttrs>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeCudaInitialize, DecodeInitializeImpl,
                              FASTATTN_DECODE_BINDING(ffi::ExecutionStage::kInitialize));
XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeCudaExecute, DecodeExecuteImpl,
                              FASTATTN_DECODE_BINDING(ffi::ExecutionStage::kExecute),
                              {ffi::Traits::kCmdBufferCompatible});
