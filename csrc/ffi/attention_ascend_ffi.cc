// XLA FFI handlers of the Ascend kernel (csrc/kernels/ascend/attention_ascend.cpp),
// both on JAX's host platform:
//  - fastattn_attention_ascend_sim: the kernel built for PTO-ISA's CPU
//    simulator (a shared library compiled at first use by
//    fastattn_jax.ascend), run over the 910B's AI cores one after another on
//    the calling thread;
//  - fastattn_attention_ascend: the kernel built by CANN's bisheng, run on
//    an NPU through the ACL runtime (csrc/ascend/acl_runtime.h).
// Both check the operands, plan the call (csrc/ascend/ascend_plan.h) and
// record the plan they ran.
#include <dlfcn.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "ascend/acl_runtime.h"
#include "ascend/ascend_plan.h"
#include "ffi/attention_attrs.h"
#include "ffi/handlers.h"

namespace ffi = xla::ffi;

namespace fastattn::ascend {

// The rule attributes every target takes (backends.rule_attrs; CallAttrs'
// first six: XLA FFI decodes one flat struct per handler) and the kernel
// library built for the call's tile.
struct AscendAttrs {
  float scale;
  float softcap;
  int64_t is_causal;
  int64_t end_aligned;
  int64_t window_left;
  int64_t window_right;
  std::string_view library;
};

}  // namespace fastattn::ascend

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(fastattn::ascend::AscendAttrs,
                                      StructMember<float>("scale"),
                                      StructMember<float>("softcap"),
                                      StructMember<int64_t>("is_causal"),
                                      StructMember<int64_t>("end_aligned"),
                                      StructMember<int64_t>("window_left"),
                                      StructMember<int64_t>("window_right"),
                                      StructMember<std::string_view>("library"));

namespace fastattn::ascend {
namespace {

// One call's operands as the kernel takes them (padded by fastattn_jax.ascend).
struct Call {
  FaAscendParams params{};
  AscendPlan plan;
  OperandBytes bytes;
};

ffi::Error Prepare(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer bias,
                   ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::S32> q_lens,
                   ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> q_spans,
                   ffi::Buffer<ffi::S32> kv_spans, ffi::Buffer<ffi::F32> sinks,
                   ffi::Buffer<ffi::F32> alibi, ffi::AnyBuffer out,
                   ffi::Buffer<ffi::F32> lse, const AscendAttrs& attrs, Call* c) {
  QkvDims d;
  if (auto err = CheckQkv(q.dimensions(), k.dimensions(), v.dimensions(), &d); err.failure()) {
    return err;
  }
  const ffi::DataType type = q.element_type();
  const int dtype = DtypeCode(type);
  if (k.element_type() != type || v.element_type() != type || out.element_type() != type ||
      (dtype != kFaF16 && dtype != kFaBF16)) {
    return ffi::Error::InvalidArgument(
        "query, key, value and out must share one of F16, BF16");
  }
  if (std::string why = PlanAscend(d.B, d.T, d.S, d.N, d.K, d.H, dtype, nullptr, &c->plan);
      !why.empty()) {
    return ffi::Error::InvalidArgument(why);
  }
  if (c->plan.Tp != d.T || c->plan.Sp != d.S || c->plan.tile.Hp != d.H) {
    return ffi::Error::InvalidArgument(
        "query " + DimsString(q.dimensions()) + " and key " + DimsString(k.dimensions()) +
        " are not padded to whole tiles (fastattn_jax.ascend pads them)");
  }
  if (q_lens.element_count() != static_cast<size_t>(d.B) ||
      kv_lens.element_count() != static_cast<size_t>(d.B)) {
    return ffi::Error::InvalidArgument("query and key lengths must both have shape (B,)");
  }
  if (lse.element_count() != static_cast<size_t>(d.B * d.T * d.N)) {
    return ffi::Error::InvalidArgument("lse must have shape (B, T, N)");
  }
  FaAscendParams& p = c->params;
  if (auto err = CheckFeatures(q_spans, kv_spans, sinks, alibi, d, &p.features);
      err.failure()) {
    return err;
  }
  const int64_t full[4] = {d.B, d.N, d.T, d.S};
  int64_t strides[4];
  if (bias.element_count() > 0) {
    if (bias.element_type() != ffi::DataType::F32) {
      return ffi::Error::InvalidArgument("bias must be F32");
    }
    if (auto err = BroadcastStrides("bias", bias.dimensions(), full, strides); err.failure()) {
      return err;
    }
    p.bias = static_cast<const float*>(bias.untyped_data());
    p.bias_stride_b = strides[0], p.bias_stride_n = strides[1];
    p.bias_stride_t = strides[2], p.bias_stride_s = strides[3];
  }
  if (mask.element_count() > 0) {
    if (auto err = BroadcastStrides("mask", mask.dimensions(), full, strides); err.failure()) {
      return err;
    }
    p.mask = reinterpret_cast<const uint8_t*>(mask.typed_data());
    p.mask_stride_b = strides[0], p.mask_stride_n = strides[1];
    p.mask_stride_t = strides[2], p.mask_stride_s = strides[3];
  }
  p.q = q.untyped_data(), p.k = k.untyped_data(), p.v = v.untyped_data();
  p.q_lens = q_lens.typed_data(), p.kv_lens = kv_lens.typed_data();
  p.out = out.untyped_data(), p.lse = lse.typed_data();
  p.B = d.B, p.Tp = d.T, p.Sp = d.S, p.N = d.N, p.K = d.K;
  p.splits = c->plan.splits, p.cores = c->plan.cores;
  p.rules = RulesOf(attrs);
  c->bytes = OperandBytes{q.size_bytes(), k.size_bytes(), v.size_bytes(), bias.size_bytes(),
                          mask.size_bytes(), q_lens.size_bytes(), kv_lens.size_bytes(),
                          out.size_bytes(), lse.size_bytes(),
                          static_cast<size_t>(c->plan.workspace_floats) * sizeof(float),
                          q_spans.size_bytes(), kv_spans.size_bytes(), sinks.size_bytes()};
  return ffi::Error::Success();
}

void Record(const char* name, const Call& c) {
  const FaAscendParams& p = c.params;
  const FaAscendTile& t = c.plan.tile;
  RecordPlan(name, {{"B", p.B}, {"Tp", p.Tp}, {"Sp", p.Sp}, {"N", p.N}, {"K", p.K},
                    {"Br", t.Br}, {"Bc", t.Bc}, {"Bb", t.Bb}, {"Hp", t.Hp},
                    {"splits", p.splits}, {"cores", p.cores},
                    {"ub_bytes", c.plan.buffers.ub}, {"l1_bytes", c.plan.buffers.l1},
                    {"l0c_bytes", c.plan.buffers.l0c},
                    {"workspace_floats", c.plan.workspace_floats}});
}

// A simulator library: its per-core entry points, checked against the plan.
struct SimLibrary {
  void (*forward)(const FaAscendParams*, int64_t) = nullptr;
  void (*merge)(const FaAscendParams*, int64_t) = nullptr;
  FaAscendTile tile{};
};

ffi::Error LoadSim(std::string_view path, const SimLibrary** out) {
  static std::mutex mu;
  static auto* loaded = new std::map<std::string, SimLibrary, std::less<>>();
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = loaded->find(path); it != loaded->end()) {
    *out = &it->second;
    return ffi::Error::Success();
  }
  const std::string file(path);
  void* handle = dlopen(file.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle) {
    return ffi::Error::Internal("cannot load the simulated Ascend kernel " + file + ": " +
                                dlerror());
  }
  SimLibrary lib;
  lib.forward = reinterpret_cast<decltype(lib.forward)>(dlsym(handle, "fa_ascend_forward"));
  lib.merge = reinterpret_cast<decltype(lib.merge)>(dlsym(handle, "fa_ascend_merge"));
  auto tile_of = reinterpret_cast<void (*)(FaAscendTile*)>(dlsym(handle, "fa_ascend_tile_of"));
  if (!lib.forward || !lib.merge || !tile_of) {
    return ffi::Error::Internal(file + " is not a simulated Ascend kernel (entry points missing)");
  }
  tile_of(&lib.tile);
  *out = &loaded->emplace(file, lib).first->second;
  return ffi::Error::Success();
}

bool SameTile(const FaAscendTile& a, const FaAscendTile& b) {
  return a.Br == b.Br && a.Bc == b.Bc && a.Bb == b.Bb && a.Hp == b.Hp && a.dtype == b.dtype;
}

// Runs a prepared call on PTO-ISA's simulator: the library's cores one after
// another on this thread (each host thread is a simulated AI core), then the
// split-KV merge.
ffi::Error RunSim(const AscendAttrs& attrs, Call& c) {
  const SimLibrary* lib = nullptr;
  if (auto err = LoadSim(attrs.library, &lib); err.failure()) return err;
  if (!SameTile(lib->tile, c.plan.tile)) {
    return ffi::Error::InvalidArgument(std::string(attrs.library) +
                                       " was built for another tile than the call's plan");
  }
  std::vector<float> workspace(c.plan.workspace_floats);
  c.params.workspace = workspace.data();
  for (int64_t core = 0; core < c.params.cores; ++core) lib->forward(&c.params, core);
  if (c.params.splits > 1) {
    for (int64_t core = 0; core < c.params.cores; ++core) lib->merge(&c.params, core);
  }
  return ffi::Error::Success();
}

// Runs a prepared call on NPU 0 (csrc/ascend/acl_runtime.h).
ffi::Error RunNpu(const AscendAttrs& attrs, Call& c) {
  std::string error;
  if (!RunOnNpu(std::string(attrs.library), c.params, c.bytes, &error)) {
    return ffi::Error::Internal(error);
  }
  return ffi::Error::Success();
}

// A target: checks and plans the call, runs it with `Run`, records it as `name`.
template <ffi::Error (*Run)(const AscendAttrs&, Call&), const char* name>
ffi::Error AscendImpl(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer bias,
                      ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::S32> q_lens,
                      ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> q_spans,
                      ffi::Buffer<ffi::S32> kv_spans, ffi::Buffer<ffi::F32> sinks,
                      ffi::Buffer<ffi::F32> alibi, ffi::Result<ffi::AnyBuffer> out,
                      ffi::ResultBuffer<ffi::F32> lse, AscendAttrs attrs) {
  if (alibi.element_count()) {
    return ffi::Error::InvalidArgument("the Ascend kernel takes no ALiBi slopes");
  }
  Call c;
  if (auto err = Prepare(q, k, v, bias, mask, q_lens, kv_lens, q_spans, kv_spans, sinks, alibi,
                         *out, *lse, attrs, &c);
      err.failure()) {
    return err;
  }
  if (auto err = Run(attrs, c); err.failure()) return err;
  Record(name, c);
  return ffi::Error::Success();
}

constexpr char kSimName[] = "ascend_sim";
constexpr char kNpuName[] = "ascend";

auto Bind() {
  return ffi::Ffi::Bind()
      .Arg<ffi::AnyBuffer>()            // query (B, Tp, N, Hp)
      .Arg<ffi::AnyBuffer>()            // key (B, Sp, K, Hp)
      .Arg<ffi::AnyBuffer>()            // value
      .Arg<ffi::AnyBuffer>()            // bias (F32) or empty
      .Arg<ffi::Buffer<ffi::PRED>>()    // mask or empty
      .Arg<ffi::Buffer<ffi::S32>>()     // query lengths (B,)
      .Arg<ffi::Buffer<ffi::S32>>()     // key lengths (B,)
      .Arg<ffi::Buffer<ffi::S32>>()     // query segment spans (B, Tp, 4) or empty
      .Arg<ffi::Buffer<ffi::S32>>()     // key segment spans (B, Sp, 4) or empty
      .Arg<ffi::Buffer<ffi::F32>>()     // sinks (B|1, N) or empty
      .Arg<ffi::Buffer<ffi::F32>>()     // ALiBi slopes: empty
      .Ret<ffi::AnyBuffer>()            // out (B, Tp, N, Hp)
      .Ret<ffi::Buffer<ffi::F32>>()     // lse (B, Tp, N)
      .Attrs<AscendAttrs>();
}

}  // namespace
}  // namespace fastattn::ascend

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    AttentionAscendSim,
    (fastattn::ascend::AscendImpl<fastattn::ascend::RunSim, fastattn::ascend::kSimName>),
    fastattn::ascend::Bind());
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    AttentionAscend,
    (fastattn::ascend::AscendImpl<fastattn::ascend::RunNpu, fastattn::ascend::kNpuName>),
    fastattn::ascend::Bind());
