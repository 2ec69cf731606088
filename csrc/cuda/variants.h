// The one owner of the CUDA kernels' rules on the host: which kernel variant
// serves a call (for its shapes, dtype, features and GPU), how it is launched
// (grid, split-KV, workspace) and how it is compiled. The FFI handlers and,
// through the extension module, Python (fastattn_jax/cuda.py) ask here;
// nothing else derives these facts. The shape facts underneath (head-dim
// rounding, tiles per GPU) are in csrc/kernels/cuda/attention_tiles.cuh,
// which the kernels are compiled from too.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kernels/attention_dtypes.h"
#include "kernels/attention_rules.h"
#include "kernels/cuda/attention_tiles.cuh"

namespace fastattn::cuda {

// One compiled specialization of a kernel (attention_common.cuh lists what
// each field turns into).
struct KernelVariant {
  int kernel_sm = 80;   // 70, 75, 80, 90; the decode kernel: its build, 75, 80 or 90
  int head_dim = 128;   // the kernel head dim (fa_kernel_head_dim)
  int dtype = kFaF16;   // q, k, v: kFaF16 or kFaBF16 (kernels/attention_dtypes.h)
  int out_dtype = kFaF16;
  int extras = 0;       // forward kernels: bias, mask and soft cap compiled in
  int features = 0;     // the plain forward kernel 90 (extras 0): segment ids and
                        // ALiBi compiled in (extras builds have them too)
  int decode_rows = 0;  // > 0: the decode kernel, with this many rows per block
  int paged = 0;        // the decode kernel: k and v are pools of pages read
                        // through a block table (FaPages)
  int kv_quant = 0;     // the decode kernel, build 80: 0, or kFaI8 / kFaF8E4M3,
                        // k and v a quantized cache read with scales (FaKvScales)
  int backward = 0;     // the backward kernels (kernel_sm 70, 75, 80 or 90): 1 dQ
                        // in a pass of its own (deterministic), 2 (kernel 90)
                        // dQ added into a float32 buffer by atomics

  // "sm80 H=128 bf16->bf16", "... extras", "decode sm80 rows=4 ...": for logs.
  std::string Describe() const;
  // Empty if the variant exists, else why not.
  std::string Check() const;
  // The kernel source and its NVRTC -D options.
  std::string SourceFile() const;
  std::vector<std::string> Defines() const;
  // The tile on a GPU of compute capability `cc` (10 * major + minor: 90).
  FaTile Tile(int cc) const;
  // The variant as one integer, the FFI attribute that names it to a handler.
  int64_t Key() const;
  static KernelVariant FromKey(int64_t key);
};

// A call as the lowering sees it. dtype: kFaF16, kFaBF16 or kFaF32 (float32
// inputs are rounded to float16 for the products).
struct CallShape {
  int64_t B = 0, T = 0, S = 0, N = 0, K = 0, H = 0;
  int dtype = kFaF16;
  // A bias, a mask, and operands only the forward kernels read (query
  // lengths, sinks): each keeps the call off the decode kernel; the first two
  // compile the extras in.
  bool bias = false, mask = false, row_operands = false;
  FaRules rules{};
  bool backward = false;  // the gradients' kernels (attention_backward.cu)
  bool deterministic = false;  // backward: a fixed summation order (no atomics)
  // Forward: the dtype of out (kFaF16, kFaBF16, kFaF32); -1: dtype's. The
  // VJP's forward asks float32 for 16-bit inputs (AttentionConfig.float32_out),
  // so that the backward's D = rowsum(dO o O) sees O unrounded. The backward's
  // gradients are always in dtype.
  int out_dtype = -1;
  // Forward: the VJP's (AttentionConfig.for_backward), whose logits the
  // backward must recompute bit for bit: not the decode kernel's build 75,
  // which sums q . k on CUDA cores where the backward sums on tensor cores.
  bool for_backward = false;
  // Forward: k and v are pools of pages with a block table, which only the
  // decode kernel's paged build reads in place (the caller gathers the pages
  // for any other kernel).
  bool paged = false;
  // Forward: k and v are a quantized cache (kFaI8 or kFaF8E4M3; 0: not), which
  // only the decode kernel's build 80 reads in place, at H a multiple of 16
  // (16-byte rows; the caller dequantizes the cache for any other kernel).
  int kv_quant = 0;
  // Segment ids or ALiBi, per-element terms of the logits: kernel 90's
  // features build (or the extras); off the decode kernel.
  bool features = false;
};

// How a kernel serves a call.
struct CallPlan {
  KernelVariant variant;
  int operand_dtype = kFaF16;  // q, k, v are converted to this (when they are not)
  int64_t row_elements = 0;  // H rounded up to kFaRowAlign: the operands' rows
                             // (H itself unless it is not a multiple of 8)
  // T = 1 with more query heads per key/value head than the decode kernel holds, and
  // one visibility for them all: the G heads of a key/value head become the
  // rows of a K-head call (T' = G, N' = K), by strides alone.
  bool fold_heads = false;
};

// The dims of the gradient buffer dq of a backward variant `v` that adds dQ
// by atomics (v.backward == 2): float32 (B, N, panels, rows, pitch) as
// fa_wgmma_backward_dq_rows lays it out; empty for the other variants, whose
// dq is as the query.
std::vector<int64_t> DqAccumulatorDims(const KernelVariant& v, int64_t B, int64_t T, int64_t N);

// The plan for `shape` on kernel `kernel_sm` ("" on success, else why the
// kernels cannot serve it).
std::string PlanCall(int kernel_sm, const CallShape& shape, CallPlan* plan);

// The launch of a planned call on a GPU of compute capability `cc` whose
// `multiprocessors` each hold `blocks_per_sm` blocks of the kernel (the
// loaded kernel's occupancy; MaxBlocksPerSm bounds it before loading).
struct LaunchPlan {
  FaTile tile{};
  int64_t units = 0;      // forward: row blocks of Br rows; decode: B * K heads;
                          // backward: fa_backward_dq's grid (row blocks; 0
                          // where dK/dV's kernel adds dQ by atomics)
  int64_t blocks = 0;     // the grid (backward: fa_backward_dkdv's, key tiles;
                          // forward kernel 90: at most a wave, persistent)
  int parts = 1;          // FaSplitKV::parts: forward splits per unit; decode:
                          // blocks of the lean partition
  int64_t slots = 0;      // partial states in the workspace (0: no split)
  int64_t workspace_floats = 0;  // slots * rows * (H + 1)
  int64_t counters = 0;   // the decode kernel's split counters (units, when
                          // split); the forward kernels merge in a second
                          // launch (fa_merge) of `units` blocks instead
  int cluster = 1;        // blocks per thread block cluster (decode on sm_90:
                          // a unit's segments, merged in shared memory)

  // Every field above by name (the tile's four first), for logs and Python.
  std::vector<std::pair<std::string, int64_t>> Facts() const;
};
LaunchPlan PlanLaunch(const KernelVariant& variant, int64_t B, int64_t T, int64_t S, int64_t N,
                      int64_t K, int64_t H, int cc, int multiprocessors, int blocks_per_sm);

// An upper bound of the resident blocks per multiprocessor of `tile` on
// `cc`, from the multiprocessor's thread and shared-memory limits (the
// registers, known once compiled, can only lower it).
int MaxBlocksPerSm(const FaTile& tile, int cc);

// The dtype the forward kernels multiply `dtype` inputs in (kFaF16, kFaBF16 or
// kFaF32) on kernel `kernel_sm`: bfloat16 where the tensor cores have it
// (kernels 80 and 90), else float16; float32 is rounded to float16 (the
// 10-bit significand of the TF32 that XLA's float32 products use). The
// decode kernel reads bfloat16 on every GPU (CallPlan says which applies).
int OperandDtype(int kernel_sm, int dtype);

// The backward kernel of the path of forward kernel `kernel_sm` at head dim
// H: the path's own, except that path 90 runs kernel 80's above
// fa_backward_max_head_dim(90) (its column parts take H up to 256).
int BackwardKernel(int kernel_sm, int64_t head_dim);

// The backward builds of backward kernel `kernel_sm` (KernelVariant::backward
// 1 .. this): 2 for kernel 90, whose default adds dQ by atomics (build 2)
// and whose deterministic one (1) runs dQ in a pass of its own; 1 elsewhere.
int BackwardBuilds(int kernel_sm);

// The kernel `implementation=None` runs on a GPU of compute capability `cc`
// (10 * major + minor) for head dim H: the newest that runs there, except
// that 90 takes only H whose 32-multiple is a 64-multiple (it would compute
// on 32 zero columns otherwise).
int DefaultKernel(int cc, int64_t head_dim);

// The variants `python -m fastattn_jax.precompile` builds for compute
// capability `cc`: every kernel the GPU runs, at each head dim (rounded as
// the kernel rounds it) and input dtype (kFaF16, kFaBF16; output alike), with
// and without extras, the decode kernel at each rows per block, and the
// backward kernels (BackwardKernel, up to each one's fa_backward_max_head_dim).
std::vector<KernelVariant> ShippedVariants(int cc, const std::vector<int>& head_dims,
                                           const std::vector<int>& dtypes);

}  // namespace fastattn::cuda
