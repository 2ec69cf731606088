// The extension module fastattn_jax._ffi: hands the XLA FFI handlers to
// Python as capsules (fastattn_jax/backends.py registers them), and answers
// Python's questions about the CUDA kernels from their one owner
// (csrc/cuda/variants.h) and the kernel cache, none of which needs a GPU.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "ascend/ascend_plan.h"
#include "ascend/kernel_sources.h"
#include "cuda/kernel_cache.h"
#include "cuda/kernel_sources.h"
#include "cuda/nvrtc.h"
#include "cuda/variants.h"
#include "ffi/attention_attrs.h"
#include "ffi/handlers.h"
#include "kernels/attention_dtypes.h"
#include "kernels/cuda/attention_common.cuh"
#include "kernels/cpu/attention_cpu.h"

// The build system that compiled this module ("cmake" or "bazel"), so that a
// test can tell which of the two builds it is testing.
#ifndef FASTATTN_BUILT_BY
#error "the build defines FASTATTN_BUILT_BY"
#endif

namespace nb = nanobind;
namespace cu = fastattn::cuda;

namespace {

nb::capsule Capsule(XLA_FFI_Error* (*handler)(XLA_FFI_CallFrame*)) {
  return nb::capsule(reinterpret_cast<void*>(handler));
}

nb::dict Dict(const fastattn::PlanFacts& facts) {
  nb::dict d;
  for (const auto& [name, value] : facts) d[name.c_str()] = value;
  return d;
}

nb::dict SourcesDict(const std::vector<std::pair<std::string, std::string>>& sources) {
  nb::dict d;
  for (const auto& [name, text] : sources) d[name.c_str()] = text;
  return d;
}

nb::dict VariantDict(const cu::KernelVariant& v) {
  nb::dict d = Dict({{"key", v.Key()},
                     {"kernel_sm", v.kernel_sm},
                     {"head_dim", v.head_dim},
                     {"dtype", v.dtype},
                     {"out_dtype", v.out_dtype},
                     {"extras", v.extras},
                     {"features", v.features},
                     {"decode_rows", v.decode_rows},
                     {"paged", v.paged},
                     {"kv_quant", v.kv_quant},
                     {"backward", v.backward}});
  d["describe"] = v.Describe();
  return d;
}

cu::KernelVariant CheckedVariant(int64_t key) {
  const cu::KernelVariant v = cu::KernelVariant::FromKey(key);
  if (std::string why = v.Check(); !why.empty()) {
    throw nb::value_error(("no kernel variant " + std::to_string(key) + ": " + why).c_str());
  }
  return v;
}

}  // namespace

NB_MODULE(_ffi, m) {
  m.attr("built_by") = FASTATTN_BUILT_BY;
  m.def("registrations", []() {
    nb::dict cpu, cuda, stages, targets;
    cpu["fastattn_attention_cpu"] = Capsule(AttentionCpu);
    cpu["fastattn_attention_cpu_backward"] = Capsule(AttentionCpuBackward);
    cpu["fastattn_attention_ascend_sim"] = Capsule(AttentionAscendSim);
    cpu["fastattn_attention_ascend"] = Capsule(AttentionAscend);
    stages["instantiate"] = Capsule(AttentionCudaInstantiate);
    stages["initialize"] = Capsule(AttentionCudaInitialize);
    stages["execute"] = Capsule(AttentionCudaExecute);
    cuda["fastattn_attention_cuda"] = stages;
    nb::dict backward;
    backward["instantiate"] = Capsule(AttentionCudaInstantiate);
    backward["initialize"] = Capsule(AttentionCudaBackwardInitialize);
    backward["execute"] = Capsule(AttentionCudaBackwardExecute);
    cuda["fastattn_attention_cuda_backward"] = backward;
    targets["cpu"] = cpu;
    targets["CUDA"] = cuda;
    return targets;
  }, "FFI targets by platform: {platform: {name: capsule or {stage: capsule}}}.");

  m.def("types", []() {
    nb::dict registration, cuda, types;
    registration["type_id"] = nb::capsule(CudaSiteStateTypeId());
    registration["type_info"] =
        nb::capsule(const_cast<XLA_FFI_TypeInfo*>(CudaSiteStateTypeInfo()));
    cuda["fastattn_cuda_site"] = registration;
    types["CUDA"] = cuda;
    return types;
  }, "FFI state types by platform: {platform: {name: {'type_id': capsule, 'type_info': capsule}}}.");

  m.def("recorded_plans", []() {
    nb::dict out;
    for (const auto& [target, facts] : fastattn::RecordedPlans()) out[target.c_str()] = Dict(facts);
    return out;
  }, "The plan each FFI target ran its latest call (CUDA: latest call site's first run) with.");

  m.def("dtype_codes", []() {
    return Dict({{"float16", kFaF16}, {"bfloat16", kFaBF16}, {"float32", kFaF32},
                 {"int8", kFaI8}, {"float8_e4m3fn", kFaF8E4M3}});
  }, "Every kernel's element type codes (csrc/kernels/attention_dtypes.h), by dtype name.");

  m.def("cpu_plan",
        [](int64_t B, int64_t T, int64_t S, int64_t N, int64_t K, int64_t H, int64_t workers,
           bool backward) {
          fastattn::AttentionParams p;
          p.B = B, p.T = T, p.S = S, p.N = N, p.K = K, p.H = H;
          return Dict((backward ? fastattn::PlanCpuBackward(p, workers)
                                : fastattn::PlanCpu(p, workers)).Facts());
        },
        nb::arg("B"), nb::arg("T"), nb::arg("S"), nb::arg("N"), nb::arg("K"), nb::arg("H"),
        nb::arg("workers"), nb::arg("backward") = false,
        "How the CPU kernel (or its backward) runs a call on that many workers.");

  // --- CUDA kernels: the rules (csrc/cuda/variants.h), no GPU needed ----------

  m.attr("min_page_size") = fastattn::kMinPageSize;
  m.def("cuda_limits", []() {
    nb::dict d;
    d["max_head_dim"] = kFaMaxHeadDim;
    d["row_align"] = kFaRowAlign;
    d["kernels"] = std::vector<int>{70, 75, 80, 90};
    return d;
  }, "Head-dim limit, row alignment (elements), kernel names.");
  m.def("cuda_runs_on", &fa_runs_on, nb::arg("kernel_sm"), nb::arg("cc"),
        "Whether a GPU of compute capability cc (10 * major + minor) runs kernel kernel_sm.");
  m.def("cuda_persistent_index", &fa_persistent_index, nb::arg("causal"), nb::arg("num_m"),
        nb::arg("work"), nb::arg("grid"), nb::arg("block"), nb::arg("step"),
        "The work block that block `block` of kernel 90's persistent forward takes at step "
        "`step` (-1: none at that step; `work` or more: no more).");
  m.def("cuda_default_kernel", &cu::DefaultKernel, nb::arg("cc"), nb::arg("head_dim"),
        "The kernel implementation=None runs on compute capability cc for head dim H.");
  m.def("cuda_plan_call",
        [](int kernel_sm, int64_t B, int64_t T, int64_t S, int64_t N, int64_t K, int64_t H,
           int dtype, bool bias, bool mask, bool row_operands, float scale, float softcap,
           int64_t causal, int64_t end_aligned, int64_t window_left, int64_t window_right,
           bool backward, bool deterministic, int out_dtype, bool for_backward, bool paged,
           int kv_quant, bool features) {
          cu::CallShape c{B, T, S, N, K, H, dtype, bias, mask, row_operands,
                          fa_make_rules(scale, softcap, causal, end_aligned, window_left,
                                        window_right),
                          backward, deterministic};
          c.out_dtype = out_dtype;
          c.for_backward = for_backward;
          c.paged = paged;
          c.kv_quant = kv_quant;
          c.features = features;
          cu::CallPlan plan;
          if (std::string why = cu::PlanCall(kernel_sm, c, &plan); !why.empty()) {
            throw nb::value_error(why.c_str());
          }
          nb::dict d = VariantDict(plan.variant);
          d["variant"] = plan.variant.Key();
          d["operand_dtype"] = plan.operand_dtype;
          d["row_elements"] = plan.row_elements;
          d["fold_heads"] = plan.fold_heads;
          d["dq_accumulator"] = cu::DqAccumulatorDims(plan.variant, B, T, N);
          return d;
        },
        nb::arg("kernel_sm"), nb::arg("B"), nb::arg("T"), nb::arg("S"), nb::arg("N"),
        nb::arg("K"), nb::arg("H"), nb::arg("dtype"), nb::arg("bias"), nb::arg("mask"),
        nb::arg("row_operands"), nb::arg("scale"), nb::arg("softcap"), nb::arg("causal"),
        nb::arg("end_aligned"), nb::arg("window_left"), nb::arg("window_right"),
        nb::arg("backward") = false, nb::arg("deterministic") = false,
        nb::arg("out_dtype") = -1, nb::arg("for_backward") = false, nb::arg("paged") = false,
        nb::arg("kv_quant") = 0, nb::arg("features") = false,
        "The variant and operand layout kernel kernel_sm serves a call (or its backward, "
        "deterministic: with a fixed summation order) "
        "with; out_dtype: the forward's out dtype code (-1: dtype's); for_backward: the "
        "VJP's forward, whose logits the backward recomputes bit for bit; paged: k and v "
        "are pools of pages (only the decode kernel's paged build reads them); kv_quant: "
        "the code of a quantized cache's element (0: none; only the decode kernel's build "
        "80 reads one); features: segment ids or ALiBi (a features build or the extras); "
        "ValueError names why it cannot. dq_accumulator: the dims of the backward's float32 "
        "dq where its variant adds dQ by atomics (else empty: dq is as the query).");
  m.def("cuda_plan_launch",
        [](int64_t key, int64_t B, int64_t T, int64_t S, int64_t N, int64_t K, int64_t H,
           int cc, int multiprocessors, int blocks_per_sm) {
          const cu::KernelVariant v = CheckedVariant(key);
          if (blocks_per_sm <= 0) blocks_per_sm = cu::MaxBlocksPerSm(v.Tile(cc), cc);
          const cu::LaunchPlan l =
              cu::PlanLaunch(v, B, T, S, N, K, H, cc, multiprocessors, blocks_per_sm);
          nb::dict d = Dict(l.Facts());
          d["blocks_per_sm"] = blocks_per_sm;
          return d;
        },
        nb::arg("variant"), nb::arg("B"), nb::arg("T"), nb::arg("S"), nb::arg("N"),
        nb::arg("K"), nb::arg("H"), nb::arg("cc"), nb::arg("multiprocessors"),
        nb::arg("blocks_per_sm") = 0,
        "The launch of a variant on a GPU of compute capability cc (90) with that many "
        "multiprocessors; blocks_per_sm 0: the most the multiprocessor's limits allow.");
  m.def("cuda_operand_dtype", &cu::OperandDtype, nb::arg("kernel_sm"), nb::arg("dtype"),
        "The dtype code the forward kernel kernel_sm multiplies dtype inputs in.");
  m.def("cuda_variant", [](int64_t key) { return VariantDict(CheckedVariant(key)); },
        nb::arg("variant"), "The fields of a variant key.");
  m.def("cuda_variant_key",
        [](int kernel_sm, int head_dim, int dtype, int out_dtype, bool extras, int decode_rows,
           bool paged, int kv_quant) {
          cu::KernelVariant v;
          v.kernel_sm = kernel_sm, v.head_dim = head_dim, v.dtype = dtype;
          v.out_dtype = out_dtype, v.extras = extras, v.decode_rows = decode_rows;
          v.paged = paged, v.kv_quant = kv_quant;
          return v.Key();
        },
        nb::arg("kernel_sm"), nb::arg("head_dim"), nb::arg("dtype"), nb::arg("out_dtype"),
        nb::arg("extras") = false, nb::arg("decode_rows") = 0, nb::arg("paged") = false,
        nb::arg("kv_quant") = 0,
        "The key of a variant given by its fields (checked when it is compiled or loaded).");
  m.def("cuda_shipped_variants",
        [](int cc, const std::vector<int>& head_dims, const std::vector<int>& dtypes) {
          std::vector<int64_t> keys;
          for (const cu::KernelVariant& v : cu::ShippedVariants(cc, head_dims, dtypes)) {
            keys.push_back(v.Key());
          }
          return keys;
        },
        nb::arg("cc"), nb::arg("head_dims"), nb::arg("dtypes"),
        "Keys of the variants precompile builds for compute capability cc.");

  // --- CUDA kernels: compiling and caching --------------------------------------

  m.def("cuda_sources", []() { return SourcesDict(cu::KernelSources()); },
        "The CUDA kernels' sources embedded at build time: {file name: text}.");
  m.def("set_nvrtc_candidates", &cu::SetNvrtcCandidates, nb::arg("paths"),
        "libnvrtc paths or sonames to try, in order.");
  m.def("set_cache_dir", &cu::SetCacheDir, nb::arg("path"),
        "Folder of the on-disk kernel cache ('' disables it).");
  m.def("nvrtc_version_for",
        [](int cc) {
          std::string error;
          std::string version = cu::NvrtcVersionFor(cc, &error);
          if (version.empty()) throw std::runtime_error(error);
          return version;
        },
        nb::arg("cc"),
        "The NVRTC version that compiles for compute capability cc (70); RuntimeError if none.");
  m.def("compile_kernel",
        [](int64_t key, int cc) {
          const cu::KernelVariant v = cu::KernelVariant::FromKey(key);
          cu::CompiledKernel k;
          std::string error;
          bool ok;
          {
            nb::gil_scoped_release release;
            ok = cu::GetCompiledKernel(v, cc, &k, &error);
          }
          if (!ok) throw std::runtime_error(error);
          nb::dict r;
          r["variant"] = v.Describe();
          r["target"] = k.target;
          r["from_cache"] = k.from_cache;
          r["seconds"] = k.seconds;
          r["log"] = k.log;
          r["nvrtc"] = k.nvrtc;
          r["cubin_bytes"] = k.cubin.size();
          return r;
        },
        nb::arg("variant"), nb::arg("cc"),
        "Compiles a variant for compute capability cc (90) or reads it from the disk cache; "
        "'target' is NVRTC's target it compiled for ('sm_90a'). Raises RuntimeError with "
        "NVRTC's log on failure.");

  // --- Ascend kernel: its plan (csrc/ascend/ascend_plan.h) and sources ---------

  m.def("ascend_limits", []() {
    return Dict({{"max_head_dim", kFaAscendMaxHeadDim}, {"cores", kFaAscendCores},
                 {"fractal", kFaAscendFractal}, {"ub_bytes", kFaAscendUbBytes},
                 {"l1_bytes", kFaAscendL1Bytes}, {"l0a_bytes", kFaAscendL0aBytes},
                 {"l0b_bytes", kFaAscendL0bBytes}, {"l0c_bytes", kFaAscendL0cBytes}});
  }, "The 910B capacities (bytes), AI cores, fractal and largest head dim.");
  m.def("ascend_plan",
        [](int64_t B, int64_t T, int64_t S, int64_t N, int64_t K, int64_t H, int64_t dtype,
           std::optional<std::vector<int64_t>> tile) {
          namespace asc = fastattn::ascend;
          asc::AscendPlan plan;
          FaAscendTile chosen{};
          if (tile) {
            if (tile->size() != 4) throw nb::value_error("tile must be (Br, Bc, Bb, Hp)");
            chosen = FaAscendTile{(*tile)[0], (*tile)[1], (*tile)[2], (*tile)[3], dtype};
          }
          if (std::string why = asc::PlanAscend(B, T, S, N, K, H, dtype, tile ? &chosen : nullptr,
                                                &plan);
              !why.empty()) {
            throw nb::value_error(why.c_str());
          }
          const FaAscendBuffers& b = plan.buffers;
          return Dict({{"Br", plan.tile.Br}, {"Bc", plan.tile.Bc}, {"Bb", plan.tile.Bb},
                       {"Hp", plan.tile.Hp}, {"dtype", plan.tile.dtype}, {"Tp", plan.Tp},
                       {"Sp", plan.Sp}, {"splits", plan.splits}, {"cores", plan.cores},
                       {"workspace_floats", plan.workspace_floats},
                       {"l1_bytes", b.l1}, {"l0a_bytes", b.l0a}, {"l0b_bytes", b.l0b},
                       {"l0c_bytes", b.l0c}, {"ub_bytes", b.ub},
                       {"l1_q", b.l1_q}, {"l1_k", b.l1_k}, {"l1_p", b.l1_p}, {"l1_v", b.l1_v},
                       {"l0a_q", b.l0a_q}, {"l0a_p", b.l0a_p}, {"l0b_k", b.l0b_k},
                       {"l0b_v", b.l0b_v}, {"l0c_s", b.l0c_s}, {"l0c_o", b.l0c_o},
                       {"ub_acc", b.ub_acc}, {"ub_m", b.ub_m}, {"ub_l", b.ub_l},
                       {"ub_alpha", b.ub_alpha}, {"ub_s", b.ub_s}, {"ub_tmp", b.ub_tmp},
                       {"ub_mask", b.ub_mask}, {"ub_ramp", b.ub_ramp}, {"ub_p", b.ub_p},
                       {"ub_pv", b.ub_pv}, {"ub_bool", b.ub_bool}, {"ub_rows", b.ub_rows},
                       {"ub_index", b.ub_index}});
        },
        nb::arg("B"), nb::arg("T"), nb::arg("S"), nb::arg("N"), nb::arg("K"), nb::arg("H"),
        nb::arg("dtype"), nb::arg("tile") = nb::none(),
        "How the Ascend kernel serves a call: tile, padded T and S, split-KV, workspace, and "
        "each buffer's offset and total (bytes); tile (Br, Bc, Bb, Hp) replaces the chosen "
        "one. ValueError if it cannot (head dim, heads, a buffer past its capacity).");
  m.def("ascend_sources", []() { return SourcesDict(fastattn::ascend::KernelSources()); },
        "The Ascend kernel's sources embedded at build time: {file name: text}.");
}
