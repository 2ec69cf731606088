// FastAttention's NPU forward for Ascend A2/A3 (910B), in PTO-ISA tile
// instructions (Lin et al. 2024, section 4.1 and appendix B; FlashAttention-2's
// online softmax, Dao 2023, Algorithm 1). One source builds two ways:
//  - for PTO's CPU simulator (clang, -D__CPU_SIM): a shared library whose
//    fa_ascend_forward/fa_ascend_merge run one simulated AI core each; the
//    FFI handler (csrc/ffi/attention_ascend_ffi.cc) runs them over the
//    cores. The simulator executes the tile instructions functionally and
//    checks every buffer against the 910B capacities.
//  - for the NPU (CANN's bisheng): the same functions as the bodies of the
//    kernel entry fa_ascend_kernel below (written, not run: no NPU here).
//
// Per work unit (b, n, Br query rows, one split of their key tiles):
//   Cube:   S = Q K^T for a Br x Bc tile (L1 -> L0A/L0B -> L0C, fp32), to GM;
//   Vector: in Bb-row slices (the second tiling level): scale, soft cap,
//           bias; the visible keys from a column ramp against each row's key
//           bounds (the tiling-mask: nothing of size T x S), the boolean
//           mask and the segment ids, selected (masked logits replaced, so
//           a NaN or inf in a hidden key never enters); online softmax; P
//           (16-bit) to GM;
//   Cube:   P V (Br x Hp, fp32) to GM;
//   Vector: acc = acc * alpha + P V per slice; at the end, out and LSE
//           with the sink joined (sinks: a logit per head in every row's
//           denominator).
// The next tile's Q K^T is issued before this tile's softmax (two S buffers
// in the workspace), so on the NPU the Cube's product overlaps the Vector's
// softmax; the pipe flags (PtoSetWaitFlag) order each unit's own pipes.
// GQA: query head n reads key/value head n / (N / K).
#include <pto/pto-inst.hpp>

#include "attention_ascend.h"

using namespace pto;

#if !defined(FA_BR) || !defined(FA_BC) || !defined(FA_BB) || !defined(FA_HP) || !defined(FA_DTYPE)
#error "build with -DFA_BR= -DFA_BC= -DFA_BB= -DFA_HP= -DFA_DTYPE= (fa_ascend_tile)"
#endif

namespace {

constexpr int Br = FA_BR, Bc = FA_BC, Bb = FA_BB, Hp = FA_HP;
constexpr FaAscendTile kTile{Br, Bc, Bb, Hp, FA_DTYPE};
constexpr FaAscendBuffers kBuf = fa_ascend_buffers(kTile);
static_assert(Br % kFaAscendFractal == 0 && Bc % kFaAscendFractal == 0 &&
              Hp % kFaAscendFractal == 0 && Br % Bb == 0, "tile off the 16 x 16 fractal");
static_assert(kBuf.l1 <= kFaAscendL1Bytes && kBuf.l0a <= kFaAscendL0aBytes &&
              kBuf.l0b <= kFaAscendL0bBytes && kBuf.l0c <= kFaAscendL0cBytes &&
              kBuf.ub <= kFaAscendUbBytes, "tile past the 910B buffers (fa_ascend_overflow)");

using E = std::conditional_t<FA_DTYPE == kFaBF16, bfloat16_t, half>;

// GM views: rows x cols with a run-time row stride (in elements).
template <typename T, int R, int C>
using Gm = GlobalTensor<T, Shape<1, 1, 1, R, C>, Stride<1, 1, 1, DYNAMIC, 1>>;
// K^T: Hp rows, Bc columns of a row-major K whose rows are `stride` apart.
using GmKt = GlobalTensor<E, Shape<1, 1, 1, Hp, Bc>, Stride<1, 1, 1, 1, DYNAMIC>, Layout::DN>;

template <typename T, int R, int C>
AICORE Gm<T, R, C> gm(T* data, int64_t row_stride) {
  return Gm<T, R, C>(data, {}, typename Gm<T, R, C>::Stride(row_stride));
}

template <typename T, int R, int C>
using Mat = Tile<TileType::Mat, T, R, C, BLayout::ColMajor, R, C, SLayout::RowMajor, 512>;
template <typename T, int R, int C>
using Vec = Tile<TileType::Vec, T, R, C, BLayout::RowMajor, R, C>;
// One value per row (a Bb x 8 tile of which column 0 is valid: 32 bytes a row).
using RowVec = Tile<TileType::Vec, float, Bb, 8, BLayout::RowMajor, Bb, 1>;
using IndexRow = Tile<TileType::Vec, int32_t, 1, Bc, BLayout::RowMajor, 1, Bc>;
using FloatRow = Tile<TileType::Vec, float, 1, Bc, BLayout::RowMajor, 1, Bc>;

template <typename T>
AICORE T at(int64_t offset) {
  T t;
  TASSIGN(t, offset);
  return t;
}

// Orders two pipes of this core (MTE2: GM -> L1/UB, MTE1: L1 -> L0, M: Cube,
// FIX: L0C -> GM, V: Vector, MTE3: UB -> GM). No-ops in the simulator, which
// runs each instruction to completion.
template <pipe_t From, pipe_t To>
AICORE void pipe() {
  PtoSetWaitFlag<From, To>();
}

// The NPU runs one mixed kernel per AI core: its Cube core (AIC) executes
// the cube_* steps, its two Vector cores (AIV) the vector_* steps on
// alternate Bb-row slices, and they hand S, P and P V over through GM with
// FFTS cross-core flags (the public PTO-ISA samples' scheme: producer
// ffts_cross_core_sync(pipe, getFFTSMsg(2, flag)), consumer
// wait_flag_dev(flag); mode 2 = an AIC and its own two AIVs). The simulator
// runs both halves in program order on one thread: there every step is on,
// and hand-offs are no-ops. Written to the samples; never compiled with
// bisheng nor run (no CANN, no NPU here).
#if defined(__CPU_SIM)
constexpr bool kCube = true, kVector = true;
constexpr int kVectorCores = 1;
AICORE int vector_core() { return 0; }
template <pipe_t Pipe>
AICORE void signal(int) {}
AICORE void await(int, int) {}
#else
#if defined(__DAV_CUBE__) || defined(__DAV_C220_CUBE__)
constexpr bool kCube = true, kVector = false;
#else
constexpr bool kCube = false, kVector = true;
#endif
constexpr int kVectorCores = 2;
AICORE int vector_core() { return get_subblockid(); }
template <pipe_t Pipe>
AICORE void signal(int flag) {
  ffts_cross_core_sync(Pipe, 0x1 + (2 << 4) + ((flag & 0xf) << 8));
}
AICORE void await(int flag, int times) {
  for (int i = 0; i < times; ++i) wait_flag_dev(flag);
}
#endif
// Hand-off flags: S of buffer b ready (kFlagS0 + b, AIC -> AIV), P ready
// (AIV -> AIC), P V ready (AIC -> AIV), P V consumed (AIV -> AIC).
enum : int { kFlagS0 = 0, kFlagP = 2, kFlagPv = 3, kFlagPvFree = 4 };

struct Unit {
  int64_t b, n, kvh, i0, split;
  int64_t q_len, kv_len;
  int64_t j_begin, j_end;  // key tiles of this split: [j_begin, j_end) x Bc
};

AICORE Unit unit_of(const FaAscendParams& p, int64_t u) {
  Unit x;
  const int64_t tiles = p.Tp / Br;
  x.split = u % p.splits;
  int64_t rest = u / p.splits;
  const int64_t it = rest % tiles;
  rest /= tiles;
  x.n = rest % p.N;
  x.b = rest / p.N;
  x.kvh = x.n / (p.N / p.K);
  x.i0 = it * Br;
  x.q_len = p.q_lens[x.b];
  x.kv_len = p.kv_lens[x.b];
  int64_t lo, hi;
  fa_rows_keys(p.rules, x.q_len, x.kv_len, x.i0, x.i0 + Br, &lo, &hi);
  fa_segment_keys(p.features, p.Tp, x.b, x.i0, x.i0 + Br, &lo, &hi);
  const int64_t first = lo / Bc, last = hi > lo ? (hi + Bc - 1) / Bc : first;
  const int64_t count = last - first;
  x.j_begin = first + count * x.split / p.splits;
  x.j_end = first + count * (x.split + 1) / p.splits;
  return x;
}

// The Cube's S = Q K^T of key tile j into the workspace's S buffer `s`.
AICORE void cube_scores(const FaAscendParams& p, const Unit& x, int64_t j, float* s) {
  auto mk = at<Mat<E, Hp, Bc>>(kBuf.l1_k);
  auto lq = at<TileLeft<E, Br, Hp>>(kBuf.l0a_q);
  auto rk = at<TileRight<E, Hp, Bc>>(kBuf.l0b_k);
  auto acc = at<TileAcc<float, Br, Bc>>(kBuf.l0c_s);
  const E* k = static_cast<const E*>(p.k) + ((x.b * p.Sp + j * Bc) * p.K + x.kvh) * Hp;
  auto gk = GmKt(const_cast<E*>(k), {}, GmKt::Stride(p.K * Hp));
  TLOAD(mk, gk);
  pipe<PIPE_MTE2, PIPE_MTE1>();
  TMOV(rk, mk);
  pipe<PIPE_MTE1, PIPE_M>();
  TMATMUL(acc, lq, rk);
  pipe<PIPE_M, PIPE_FIX>();
  auto gs = gm<float, Br, Bc>(s, Bc);
  TSTORE(gs, acc);
}

// The Cube's P V of key tile j: P from the workspace, P V into it.
AICORE void cube_values(const FaAscendParams& p, const Unit& x, int64_t j, E* pw, float* pv) {
  auto mp = at<Mat<E, Br, Bc>>(kBuf.l1_p);
  auto mv = at<Mat<E, Bc, Hp>>(kBuf.l1_v);
  auto lp = at<TileLeft<E, Br, Bc>>(kBuf.l0a_p);
  auto rv = at<TileRight<E, Bc, Hp>>(kBuf.l0b_v);
  auto acc = at<TileAcc<float, Br, Hp>>(kBuf.l0c_o);
  const E* v = static_cast<const E*>(p.v) + ((x.b * p.Sp + j * Bc) * p.K + x.kvh) * Hp;
  auto gp = gm<E, Br, Bc>(pw, Bc);
  TLOAD(mp, gp);
  auto gv = gm<E, Bc, Hp>(const_cast<E*>(v), p.K * Hp);
  TLOAD(mv, gv);
  pipe<PIPE_MTE2, PIPE_MTE1>();
  TMOV(lp, mp);
  TMOV(rv, mv);
  pipe<PIPE_MTE1, PIPE_M>();
  TMATMUL(acc, lp, rv);
  pipe<PIPE_M, PIPE_FIX>();
  auto gpv = gm<float, Br, Hp>(pv, Hp);
  TSTORE(gpv, acc);
}

// The Vector unit's slices. Row vectors of the Br rows live at kBuf.ub_m,
// ub_l, ub_alpha; a slice's are Bb rows into them.
struct Slice {
  RowVec m, l, alpha;  // views of this slice's rows
  RowVec mn, mb, lb, lo, hi, t;
};

AICORE Slice slice_at(int64_t r0) {
  Slice s;
  const int64_t row = r0 * kFaAscendRowBytes, rv = Bb * kFaAscendRowBytes;
  TASSIGN(s.m, kBuf.ub_m + row);
  TASSIGN(s.l, kBuf.ub_l + row);
  TASSIGN(s.alpha, kBuf.ub_alpha + row);
  TASSIGN(s.mn, kBuf.ub_rows);
  TASSIGN(s.mb, kBuf.ub_rows + rv);
  TASSIGN(s.lb, kBuf.ub_rows + 2 * rv);
  TASSIGN(s.lo, kBuf.ub_rows + 3 * rv);
  TASSIGN(s.hi, kBuf.ub_rows + 4 * rv);
  TASSIGN(s.t, kBuf.ub_rows + 5 * rv);
  return s;
}

AICORE void set_row(RowVec& v, int r, float x) { v.data()[r * 8] = x; }

// The bias operand's element (t, c) of this unit's (b, n): its strides are 0
// along broadcast dims. A full bias is read as a Bb x Bc tile; one broadcast
// over T as one row expanded down the slice, over S as one column expanded
// across it, over both as a scalar (DMA takes no zero row stride).
AICORE void add_bias(const FaAscendParams& p, const Unit& x, int64_t i, int64_t j0,
                     Vec<float, Bb, Bc>& s, Vec<float, Bb, Bc>& tmp, RowVec& column) {
  const float* bias = p.bias + x.b * p.bias_stride_b + x.n * p.bias_stride_n +
                      i * p.bias_stride_t + j0 * p.bias_stride_s;
  if (p.bias_stride_t && p.bias_stride_s) {
    auto g = gm<float, Bb, Bc>(const_cast<float*>(bias), p.bias_stride_t);
    TLOAD(tmp, g);
    pipe<PIPE_MTE2, PIPE_V>();
    TADD(s, s, tmp);
  } else if (p.bias_stride_s) {
    auto row = at<FloatRow>(kBuf.ub_index + 2 * Bc * 4);
    auto g = gm<float, 1, Bc>(const_cast<float*>(bias), Bc);
    TLOAD(row, g);
    pipe<PIPE_MTE2, PIPE_V>();
    TCOLEXPAND(tmp, row);
    TADD(s, s, tmp);
  } else if (p.bias_stride_t) {
    auto g = gm<float, Bb, 1>(const_cast<float*>(bias), p.bias_stride_t);
    TLOAD(column, g);
    pipe<PIPE_MTE2, PIPE_V>();
    TROWEXPANDADD(s, s, column);
  } else {
    TADDS(s, s, *bias);
  }
}

// visible *= the mask operand (true: 1, false: 0), broadcast as the bias is.
AICORE void and_mask(const FaAscendParams& p, const Unit& x, int64_t i, int64_t j0,
                     Vec<float, Bb, Bc>& visible, Vec<float, Bb, Bc>& tmp, RowVec& column) {
  const uint8_t* m = p.mask + x.b * p.mask_stride_b + x.n * p.mask_stride_n +
                     i * p.mask_stride_t + j0 * p.mask_stride_s;
  if (p.mask_stride_t && p.mask_stride_s) {
    auto bytes = at<Vec<uint8_t, Bb, Bc>>(kBuf.ub_bool);
    auto g = gm<uint8_t, Bb, Bc>(const_cast<uint8_t*>(m), p.mask_stride_t);
    TLOAD(bytes, g);
    pipe<PIPE_MTE2, PIPE_V>();
    TCVT(tmp, bytes, RoundMode::CAST_NONE);
    TMUL(visible, visible, tmp);
  } else if (p.mask_stride_s) {
    auto bytes = at<Tile<TileType::Vec, uint8_t, 1, Bc, BLayout::RowMajor, 1, Bc>>(kBuf.ub_bool);
    auto row = at<FloatRow>(kBuf.ub_index + 2 * Bc * 4);
    auto g = gm<uint8_t, 1, Bc>(const_cast<uint8_t*>(m), Bc);
    TLOAD(bytes, g);
    pipe<PIPE_MTE2, PIPE_V>();
    TCVT(row, bytes, RoundMode::CAST_NONE);
    TCOLEXPAND(tmp, row);
    TMUL(visible, visible, tmp);
  } else if (p.mask_stride_t) {
    auto bytes = at<Tile<TileType::Vec, uint8_t, Bb, 32, BLayout::RowMajor, Bb, 1>>(kBuf.ub_bool);
    auto g = gm<uint8_t, Bb, 1>(const_cast<uint8_t*>(m), p.mask_stride_t);
    TLOAD(bytes, g);
    pipe<PIPE_MTE2, PIPE_V>();
    TCVT(column, bytes, RoundMode::CAST_NONE);
    TROWEXPANDMUL(visible, visible, column);
  } else {
    TMULS(visible, visible, *m ? 1.0f : 0.0f);
  }
}

// visible *= whether rows [i, + Bb) and keys [j0, + Bc) share a segment id,
// built on the scalar unit (only slices whose rows and keys hold more than
// one id come here: fa_segment_whole).
AICORE void and_segments(const FaAscendParams& p, const Unit& x, int64_t i, int64_t j0,
                         Vec<float, Bb, Bc>& visible, Vec<float, Bb, Bc>& tmp) {
  pipe<PIPE_V, PIPE_S>();
  for (int k = 0; k < Bb; ++k) {
    for (int c = 0; c < Bc; ++c) {
      tmp.data()[k * Bc + c] =
          fa_same_segment<int64_t>(p.features, p.Tp, p.Sp, x.b, i + k, j0 + c) ? 1.0f : 0.0f;
    }
  }
  pipe<PIPE_S, PIPE_V>();
  TMUL(visible, visible, tmp);
}

// Online softmax of rows [i0 + r0, + Bb) against key tile j: S from the
// workspace, P to it; updates the rows' max, sum and rescale factor.
AICORE void vector_softmax(const FaAscendParams& p, const Unit& x, int64_t j, int64_t r0,
                    const float* sw, E* pw) {
  Slice r = slice_at(r0);
  auto s = at<Vec<float, Bb, Bc>>(kBuf.ub_s);
  auto tmp = at<Vec<float, Bb, Bc>>(kBuf.ub_tmp);
  auto mask = at<Vec<float, Bb, Bc>>(kBuf.ub_mask);
  auto ramp = at<Vec<float, Bb, Bc>>(kBuf.ub_ramp);
  auto pe = at<Vec<E, Bb, Bc>>(kBuf.ub_p);
  const int64_t i = x.i0 + r0, j0 = j * Bc;
  const FaRules& rules = p.rules;
  auto gs = gm<float, Bb, Bc>(const_cast<float*>(sw) + r0 * Bc, Bc);
  TLOAD(s, gs);
  pipe<PIPE_MTE2, PIPE_V>();
  TMULS(s, s, rules.scale);
  if (rules.softcap > 0) {  // c * tanh(x / c) = c - 2c / (exp(2x / c) + 1)
    TMULS(tmp, s, 2.0f / rules.softcap);
    TEXP(tmp, tmp);
    TADDS(tmp, tmp, 1.0f);
    TRECIP(tmp, tmp);
    TMULS(tmp, tmp, -2.0f * rules.softcap);
    TADDS(s, tmp, rules.softcap);
  }
  if (p.bias) add_bias(p, x, i, j0, s, tmp, r.t);
  const bool partial = !fa_all_visible<int64_t>(rules, x.q_len, x.kv_len, i, i + Bb, j0, j0 + Bc);
  const bool mixed =
      !fa_segment_whole<int64_t>(p.features, p.Tp, p.Sp, x.b, i, i + Bb, j0, j0 + Bc);
  if (partial || p.mask || mixed) {
    // Visibility as 0 / 1 in `mask`: the index rules, then the mask operand.
    if (partial) {
      // The tiling-mask: each row's key bounds [lo, hi) from the index rules
      // (relative to j0), against the column ramp: visible iff
      // clamp(hi - c, 0, 1) * clamp(c - lo + 1, 0, 1) = 1.
      for (int k = 0; k < Bb; ++k) {
        int64_t lo, hi;
        fa_row_keys<int64_t>(rules, x.q_len, x.kv_len, i + k, &lo, &hi);
        set_row(r.lo, k, static_cast<float>(lo - j0 < -1 ? -1 : lo - j0 > Bc ? Bc : lo - j0));
        set_row(r.hi, k,
                static_cast<float>(hi - j0 < -1 ? -1 : hi - j0 > Bc + 1 ? Bc + 1 : hi - j0));
      }
      pipe<PIPE_S, PIPE_V>();
      TROWEXPANDSUB(tmp, ramp, r.hi);  // c - hi
      TMULS(tmp, tmp, -1.0f);
      TMINS(tmp, tmp, 1.0f);
      TMAXS(tmp, tmp, 0.0f);
      TROWEXPANDSUB(mask, ramp, r.lo);  // c - lo
      TADDS(mask, mask, 1.0f);
      TMINS(mask, mask, 1.0f);
      TMAXS(mask, mask, 0.0f);
      TMUL(mask, mask, tmp);
    } else {
      TEXPANDS(mask, 1.0f);
    }
    if (p.mask) and_mask(p, x, i, j0, mask, tmp, r.t);
    if (mixed) and_segments(p, x, i, j0, mask, tmp);
    // Select, not add: a masked logit is kFaAscendMasked even where the key
    // row holds NaN or inf (keys hidden by a mask are never used).
    auto bits = at<Tile<TileType::Vec, uint8_t, Bb, Bc, BLayout::RowMajor, Bb, Bc / 8>>(
        kBuf.ub_bool);
    TCMPS(bits, mask, 0.5f, CmpMode::GT);
    TEXPANDS(tmp, kFaAscendMasked);
    TSEL(s, bits, s, tmp, pe);
  }
  TROWMAX(r.mb, s, tmp);
  TMAX(r.mn, r.m, r.mb);
  TSUB(r.alpha, r.m, r.mn);
  TEXP(r.alpha, r.alpha);
  TROWEXPANDSUB(s, s, r.mn);
  TEXP(s, s);
  TROWSUM(r.lb, s, tmp);
  TMUL(r.l, r.l, r.alpha);
  TADD(r.l, r.l, r.lb);
  TMOV(r.m, r.mn);
  TCVT(pe, s, RoundMode::CAST_RINT);
  pipe<PIPE_V, PIPE_MTE3>();
  auto gp = gm<E, Bb, Bc>(pw + r0 * Bc, Bc);
  TSTORE(gp, pe);
}

// acc = acc * alpha + P V over rows [r0, r0 + Bb).
AICORE void vector_accumulate(int64_t r0, const float* pvw) {
  Slice r = slice_at(r0);
  auto acc = at<Vec<float, Bb, Hp>>(kBuf.ub_acc + r0 * Hp * 4);
  auto pv = at<Vec<float, Bb, Hp>>(kBuf.ub_pv);
  auto gpv = gm<float, Bb, Hp>(const_cast<float*>(pvw) + r0 * Hp, Hp);
  TLOAD(pv, gpv);
  pipe<PIPE_MTE2, PIPE_V>();
  TROWEXPANDMUL(acc, acc, r.alpha);
  TADD(acc, acc, pv);
}

// Rows [r0, + Bb) of unit x's outputs: out (rounded to E) and LSE, with
// the sink of (b, n) joined first (fa_join_sink, on the scalar unit; `factor`
// a free row vector).
AICORE void store_rows(const FaAscendParams& p, const Unit& x, int64_t r0,
                       Vec<float, Bb, Hp>& acc, RowVec& lse, RowVec& factor) {
  if (p.features.sinks) {
    pipe<PIPE_V, PIPE_S>();
    for (int k = 0; k < Bb; ++k) {
      float joined = lse.data()[k * 8];
      set_row(factor, k, fa_join_sink(p.features, x.b, x.n, &joined));
      set_row(lse, k, joined);
    }
    pipe<PIPE_S, PIPE_V>();
    TROWEXPANDMUL(acc, acc, factor);
  }
  auto oe = at<Vec<E, Bb, Hp>>(kBuf.ub_pv);
  TCVT(oe, acc, RoundMode::CAST_RINT);
  pipe<PIPE_V, PIPE_MTE3>();
  const int64_t row = (x.b * p.Tp + x.i0 + r0) * p.N + x.n;
  auto gout = gm<E, Bb, Hp>(static_cast<E*>(p.out) + row * Hp, p.N * Hp);
  TSTORE(gout, oe);
  auto glse = gm<float, Bb, 1>(p.lse + row, p.N);
  TSTORE(glse, lse);
}

// Rows [r0, + Bb): out = acc / l and LSE = m + log l where the row saw a key
// (its max above kFaAscendDeadMax), else out 0 and LSE -inf; to the outputs,
// or with split-KV to the unit's partial in the workspace.
AICORE void vector_finish(const FaAscendParams& p, const Unit& x, int64_t r0, float* partial) {
  Slice r = slice_at(r0);
  auto acc = at<Vec<float, Bb, Hp>>(kBuf.ub_acc + r0 * Hp * 4);
  // flag = clamp(m - kFaAscendDeadMax, 0, 1): 1 for a live row, 0 for a dead one.
  TADDS(r.t, r.m, -kFaAscendDeadMax);
  TMINS(r.t, r.t, 1.0f);
  TMAXS(r.t, r.t, 0.0f);
  TMAXS(r.lb, r.l, 1.0f);  // a live row's sum is at least 1 (its max's term)
  TDIV(r.mb, r.t, r.lb);
  TROWEXPANDMUL(acc, acc, r.mb);
  TMUL(r.lb, r.l, r.t);  // log 0 = -inf for a dead row
  TLOG(r.lb, r.lb);
  TADD(r.lb, r.lb, r.m);
  pipe<PIPE_V, PIPE_MTE3>();
  if (partial) {
    auto gpart = gm<float, Bb, Hp>(partial + r0 * Hp, Hp);
    TSTORE(gpart, acc);
    auto gplse = gm<float, Bb, 1>(partial + Br * Hp + r0, 1);
    TSTORE(gplse, r.lb);
    return;
  }
  store_rows(p, x, r0, acc, r.lb, r.mb);
}

AICORE float* core_workspace(const FaAscendParams& p, int64_t core) {
  return p.workspace + core * fa_ascend_core_floats(kTile);
}

AICORE float* partial_of(const FaAscendParams& p, int64_t u) {
  return p.workspace + p.cores * fa_ascend_core_floats(kTile) + u * (Br * Hp + Br);
}

// The column ramp c = 0 .. Bc - 1 in every row of a slice, built once per core.
AICORE void build_ramp() {
  auto index = at<IndexRow>(kBuf.ub_index);
  auto row = at<FloatRow>(kBuf.ub_index + Bc * 4);
  auto ramp = at<Vec<float, Bb, Bc>>(kBuf.ub_ramp);
  TCI<IndexRow, int32_t, 0>(index, 0);
  TCVT(row, index, RoundMode::CAST_NONE);
  TCOLEXPAND(ramp, row);
}

AICORE void run_unit(const FaAscendParams& p, int64_t u, float* ws) {
  const Unit x = unit_of(p, u);
  float* sw[2] = {ws, ws + Br * Bc};  // S of tiles j and j + 1 (the overlap)
  E* pw = reinterpret_cast<E*>(ws + 2 * Br * Bc);
  float* pvw = ws + 2 * Br * Bc + Br * Bc / 2;
  // This Vector core's slices: every kVectorCores-th, from its index.
  const int64_t first = vector_core() * Bb, step = kVectorCores * Bb;
  if (kVector) {
    for (int64_t r0 = first; r0 < Br; r0 += step) {
      Slice r = slice_at(r0);
      TEXPANDS(r.m, kFaAscendMasked);
      TEXPANDS(r.l, 0.0f);
      auto acc = at<Vec<float, Bb, Hp>>(kBuf.ub_acc + r0 * Hp * 4);
      TEXPANDS(acc, 0.0f);
    }
  }
  if (kCube && x.j_begin < x.j_end) {
    auto mq = at<Mat<E, Br, Hp>>(kBuf.l1_q);
    auto lq = at<TileLeft<E, Br, Hp>>(kBuf.l0a_q);
    const E* q = static_cast<const E*>(p.q) + ((x.b * p.Tp + x.i0) * p.N + x.n) * Hp;
    auto gq = gm<E, Br, Hp>(const_cast<E*>(q), p.N * Hp);
    TLOAD(mq, gq);
    pipe<PIPE_MTE2, PIPE_MTE1>();
    TMOV(lq, mq);
    cube_scores(p, x, x.j_begin, sw[0]);
    signal<PIPE_FIX>(kFlagS0);
  }
  for (int64_t j = x.j_begin; j < x.j_end; ++j) {
    const int64_t buffer = (j - x.j_begin) % 2;
    if (kCube && j + 1 < x.j_end) {
      cube_scores(p, x, j + 1, sw[1 - buffer]);
      signal<PIPE_FIX>(kFlagS0 + 1 - buffer);
    }
    if (kVector) {
      await(kFlagS0 + buffer, 1);
      for (int64_t r0 = first; r0 < Br; r0 += step) vector_softmax(p, x, j, r0, sw[buffer], pw);
      signal<PIPE_MTE3>(kFlagP);
    }
    if (kCube) {
      await(kFlagP, kVectorCores);
      if (j > x.j_begin) await(kFlagPvFree, kVectorCores);
      cube_values(p, x, j, pw, pvw);
      signal<PIPE_FIX>(kFlagPv);
    }
    if (kVector) {
      await(kFlagPv, 1);
      for (int64_t r0 = first; r0 < Br; r0 += step) vector_accumulate(r0, pvw);
      if (j + 1 < x.j_end) signal<PIPE_V>(kFlagPvFree);
    }
  }
  if (kVector) {
    for (int64_t r0 = first; r0 < Br; r0 += step) {
      vector_finish(p, x, r0, p.splits > 1 ? partial_of(p, u) : nullptr);
    }
  }
}

// Merges the splits of (b, n, row tile) g: out = sum_s w_s O_s / sum_s w_s
// and LSE = M + log sum_s w_s, w_s = exp(LSE_s - M), M the largest LSE_s (or
// kFaAscendMasked when every split is dead: then out 0, LSE -inf).
AICORE void merge_group(const FaAscendParams& p, int64_t g) {
  const Unit x = unit_of(p, g * p.splits);
  for (int64_t r0 = vector_core() * Bb; r0 < Br; r0 += kVectorCores * Bb) {
    Slice r = slice_at(r0);
    auto acc = at<Vec<float, Bb, Hp>>(kBuf.ub_acc);
    auto part = at<Vec<float, Bb, Hp>>(kBuf.ub_pv);
    TEXPANDS(r.mn, kFaAscendMasked);
    for (int64_t s = 0; s < p.splits; ++s) {
      auto glse = gm<float, Bb, 1>(partial_of(p, g * p.splits + s) + Br * Hp + r0, 1);
      TLOAD(r.mb, glse);
      pipe<PIPE_MTE2, PIPE_V>();
      TMAX(r.mn, r.mn, r.mb);
    }
    TEXPANDS(r.l, 0.0f);
    TEXPANDS(acc, 0.0f);
    for (int64_t s = 0; s < p.splits; ++s) {
      float* partial = partial_of(p, g * p.splits + s);
      auto glse = gm<float, Bb, 1>(partial + Br * Hp + r0, 1);
      TLOAD(r.mb, glse);
      auto gpart = gm<float, Bb, Hp>(partial + r0 * Hp, Hp);
      TLOAD(part, gpart);
      pipe<PIPE_MTE2, PIPE_V>();
      TSUB(r.mb, r.mb, r.mn);
      TEXP(r.mb, r.mb);
      TADD(r.l, r.l, r.mb);
      TROWEXPANDMUL(part, part, r.mb);
      TADD(acc, acc, part);
    }
    TMAXS(r.lb, r.l, 1.0f);  // the largest split's weight is 1
    TROWEXPANDDIV(acc, acc, r.lb);
    TLOG(r.l, r.l);
    TADD(r.l, r.l, r.mn);
    store_rows(p, x, r0, acc, r.l, r.lb);
  }
}

}  // namespace

// One AI core's share of the forward: units core, core + cores, ...
extern "C" AICORE void fa_ascend_forward(const FaAscendParams* p, int64_t core) {
  if (kVector) build_ramp();
  const int64_t units = fa_ascend_units(kTile, p->B, p->Tp, p->N, p->splits);
  for (int64_t u = core; u < units; u += p->cores) run_unit(*p, u, core_workspace(*p, core));
}

// One AI core's share of the split-KV merge (after every core's forward).
extern "C" AICORE void fa_ascend_merge(const FaAscendParams* p, int64_t core) {
  if (!kVector) return;
  const int64_t groups = fa_ascend_units(kTile, p->B, p->Tp, p->N, 1);
  for (int64_t g = core; g < groups; g += p->cores) merge_group(*p, g);
}

#if defined(__CPU_SIM)
// The tile this library was built for (the handler checks it against its plan).
extern "C" void fa_ascend_tile_of(FaAscendTile* tile) { *tile = kTile; }
#else
// The NPU build: blocks are AI cores; the parameters (FaAscendParams with
// device pointers) sit in GM. fa_ascend_launch is the host function that
// csrc/ascend/acl_runtime.cc calls; it passes the FFTS base address the
// cross-core flags need (libruntime's rtGetC2cCtrlAddr).
extern "C" __global__ AICORE void fa_ascend_kernel(__gm__ uint64_t* ffts, __gm__ uint8_t* params,
                                                   int32_t merge) {
  set_ffts_base_addr(reinterpret_cast<uint64_t>(ffts));
  FaAscendParams p = *reinterpret_cast<__gm__ FaAscendParams*>(params);
  if (merge) {
    fa_ascend_merge(&p, get_block_idx());
  } else {
    fa_ascend_forward(&p, get_block_idx());
  }
}

extern "C" int32_t rtGetC2cCtrlAddr(uint64_t* addr, uint32_t* len);

extern "C" int fa_ascend_launch(uint32_t cores, void* stream, void* params, int merge) {
  uint64_t ffts = 0;
  uint32_t len = 0;
  if (const int32_t rc = rtGetC2cCtrlAddr(&ffts, &len)) return rc;
  fa_ascend_kernel<<<cores, nullptr, stream>>>(reinterpret_cast<__gm__ uint64_t*>(ffts),
                                                 static_cast<__gm__ uint8_t*>(params), merge);
  return 0;
}
#endif
