// Fused forward attention on Hopper's warpgroup tensor cores: kernel 90
// (wgmma.mma_async, sm_90a), fp16/bf16, kernel head dims multiples of 64.
//
// Each block owns Br = 128 query rows of one (batch, head) and is warp
// specialized, as in FlashAttention-3: a producer warpgroup loads Q, then K
// and V tile by tile, into a ring of kStages shared-memory stages with the
// tensor memory accelerator (TMA, cp.async.bulk.tensor), and two consumer
// warpgroups of 64 rows compute. mbarriers link them: the producer's loads
// complete a stage's "full" barrier, each consumer warp arrives on its
// "empty" one once its wgmma has read it. The producer gives most of its
// registers to the consumers (setmaxnreg).
//
// TMA zero-fills rows past T and S and columns past H, but keys in [kv_len,
// S) hold whatever the caller left there (NaN included), and P V must see
// zeros for them: the one tile that crosses kv_len is copied with cp.async,
// which zero-fills by row.
//
// Per key tile of Bc keys, a consumer warpgroup computes S = Q K^T with
// wgmma reading Q and K from shared memory, runs the online softmax on the
// accumulators in float32 (the accumulator layout of m64nN is that of
// mma.m16n8 per warp: attention_m16n8.cuh), and issues O += P V with P
// straight from registers and V from shared memory. The products of one tile
// are issued together with those of the next, so that the softmax of tile j
// runs while the tensor cores compute P(j-1) V(j-1).
//
// Shared memory: every tile (Q, K, V) is stored as H / 64 panels of 128-byte
// rows (64 elements), 16-byte chunks XOR-swizzled by row % 8: the 128-byte
// swizzle that TMA writes and wgmma reads; a panel is one TMA box. Q and K
// are K-major operands; V, the B operand of P V, is N-major (H contiguous)
// and read with the transpose flag.
#include "attention_m16n8.cuh"

#if FA_KERNEL_SM != 90
#error "attention_wgmma.cu serves kernel 90"
#endif

#if FA_DTYPE == 1
#define FA_WG_T "bf16"
#else
#define FA_WG_T "f16"
#endif

namespace {

constexpr int kH = FA_HEAD_DIM;
constexpr FaTile kTile = fa_forward_tile(90, kH, FA_EXTRAS, __CUDA_ARCH__);
constexpr int kWG = 2;                     // warpgroups of 64 rows
constexpr int kThreads = kTile.threads;    // (kWG + 1) * 128: + the producer warpgroup
constexpr int kLoaders = 128;              // producer threads
// Registers per thread after setmaxnreg: 128 * 24 + 256 * 240 <= 65536.
constexpr int kProducerRegs = 24, kConsumerRegs = 240;
constexpr int kBr = kTile.block_m;         // kWG * 64
constexpr int kBc = kTile.block_n;         // attention_tiles.cuh: fa_wgmma_bc
constexpr int kChunks = kH / 8;            // 16-byte chunks per row
constexpr int kStages = kFaWgmmaStages;
constexpr int kQBytes = kBr * kH * 2;
constexpr int kKVBytes = kBc * kH * 2;
constexpr int kNs = kBc / 8;  // n8 blocks of S
constexpr int kNo = kH / 8;   // n8 blocks of O
static_assert(kThreads == (kWG + 1) * 128 && kBr == kWG * 64, "tile");

// Byte offset of 16-byte chunk c of row r in a tile of `rows` rows.
__device__ __forceinline__ unsigned swz(int rows, int r, int c) {
  return (c >> 3) * rows * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4);
}

// wgmma shared-memory descriptor, 128-byte swizzle.
__device__ __forceinline__ unsigned long long desc(unsigned addr, unsigned lbo,
                                                   unsigned sbo) {
  return (unsigned long long)((addr & 0x3FFFF) >> 4) |
         ((unsigned long long)(lbo >> 4) << 16) |
         ((unsigned long long)(sbo >> 4) << 32) | (1ull << 62);
}

// The producer's cp.async copy of a tile into its swizzled panels (the tile
// that crosses kv_len): 16-byte chunks, chunk c of the tile to thread
// c % 128; rows past rows_valid become zeros. Not unrolled: the producer runs
// on few registers.
template <int ROWS>
__device__ __forceinline__ void tile_async(unsigned dst, const FaTileSrc& s,
                                           int tid) {
#pragma unroll 1
  for (int c = tid; c < ROWS * kChunks; c += kLoaders) {
    const int r = c / kChunks, ch = c % kChunks;
    const bool ok = r < s.rows_valid && ch * 8 < s.cols;
    const unsigned short* src = s.base + (ok ? r * (int)s.ld + ch * 8 : 0);
    fa_cp_async16(dst + swz(ROWS, r, ch), src, ok);
  }
}

// TMA load of the box at coordinates (c0, c1, c2, c3) of `map` (innermost
// first) into dst; its bytes complete the transaction count of `bar`.
__device__ __forceinline__ void tma_load_4d(unsigned dst, const FaTensorMap& map, int c0, int c1,
                                            int c2, int c3, unsigned bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];" ::"r"(dst),
      "l"(reinterpret_cast<unsigned long long>(&map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
      "r"(bar)
      : "memory");
}

// TMA load of ROWS rows from `row` of head `head`, batch b: one box per
// 64-column panel.
template <int ROWS>
__device__ __forceinline__ void tile_tma(unsigned dst, const FaTensorMap& map, int head, int row,
                                         int b, unsigned bar) {
#pragma unroll
  for (int c = 0; c < kH / 64; ++c) {
    tma_load_4d(dst + c * ROWS * 128, map, c * 64, head, row, b, bar);
  }
}

__device__ __forceinline__ void wg_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wg_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
// Waits until at most N of this warpgroup's committed wgmma groups are
// pending (groups complete in commit order).
template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Keeps the compiler from touching accumulators across wgmma issue / wait.
template <int N>
__device__ __forceinline__ void reg_fence(float* d) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

template <int N>
__device__ void wgmma_ss(float* d, unsigned long long a, unsigned long long b, int acc);
template <int N>
__device__ void wgmma_rs(float* d, const unsigned (&a)[4], unsigned long long b);

template <>
__device__ __forceinline__ void wgmma_ss<32>(float* d, unsigned long long a, unsigned long long b, int acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32." FA_WG_T "." FA_WG_T " "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(a), "l"(b), "r"(acc));
}

template <>
__device__ __forceinline__ void wgmma_ss<64>(float* d, unsigned long long a, unsigned long long b, int acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." FA_WG_T "." FA_WG_T " "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(a), "l"(b), "r"(acc));
}

template <>
__device__ __forceinline__ void wgmma_ss<128>(float* d, unsigned long long a, unsigned long long b, int acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." FA_WG_T "." FA_WG_T " "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(a), "l"(b), "r"(acc));
}

template <>
__device__ __forceinline__ void wgmma_rs<64>(float* d, const unsigned (&a)[4], unsigned long long b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." FA_WG_T "." FA_WG_T " "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, 1, 1, 1, 1;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

template <>
__device__ __forceinline__ void wgmma_rs<128>(float* d, const unsigned (&a)[4], unsigned long long b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." FA_WG_T "." FA_WG_T " "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

template <>
__device__ __forceinline__ void wgmma_rs<192>(float* d, const unsigned (&a)[4], unsigned long long b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n192k16.f32." FA_WG_T "." FA_WG_T " "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, {%96, %97, %98, %99}, %100, 1, 1, 1, 1;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

template <>
__device__ __forceinline__ void wgmma_rs<256>(float* d, const unsigned (&a)[4], unsigned long long b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n256k16.f32." FA_WG_T "." FA_WG_T " "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, 1, 1, 1, 1;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// mbarriers: the producer's loads complete the "full" ones, the consumer
// warps' arrivals (one per warp) the "empty" ones.
__device__ __forceinline__ void mbar_init(unsigned bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// Arrives and announces `bytes` that TMA loads will deliver to this phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}
// Arrives once all of this thread's earlier cp.async copies have landed.
__device__ __forceinline__ void mbar_arrive_cp_async(unsigned bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned bar, int parity) {
  asm volatile(
      "{\n .reg .pred done;\n WAIT:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra WAIT;\n}" ::"r"(bar), "r"(parity) : "memory");
}
template <int N>
__device__ __forceinline__ void set_max_regs_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void set_max_regs_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}

}  // namespace

extern "C" __constant__ int fa_params_bytes = sizeof(FaParams);

extern "C" __global__ void __launch_bounds__(kThreads, 1)
    fa_forward(const FaParams p, const __grid_constant__ FaTmaMaps maps) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wg = warp >> 2;
  const int g = lane >> 2, t4 = lane & 3;

  const FaBlock blk = fa_block(p, kBr, kBc);
  const int b = blk.b, n = blk.n, kvh = blk.kvh, m0 = blk.m0;
  const int q_len = blk.q_len, kv_len = blk.kv_len;

  const int t_begin = blk.t_begin, t_end = blk.t_end;

  const unsigned sbase = (fa_smem_u32(smem) + 1023) & ~1023u;
  const unsigned sq = sbase;
  auto sk = [&](int st) { return sbase + kQBytes + st * 2 * kKVBytes; };
  auto sv = [&](int st) { return sk(st) + kKVBytes; };
  const unsigned bars = sbase + kQBytes + kStages * 2 * kKVBytes;
  const unsigned q_full = bars;
  auto k_full = [&](int st) { return bars + 8 + st * 8; };
  auto v_full = [&](int st) { return bars + 8 + (kStages + st) * 8; };
  auto k_empty = [&](int st) { return bars + 8 + (2 * kStages + st) * 8; };
  auto v_empty = [&](int st) { return bars + 8 + (3 * kStages + st) * 8; };
  if (tid == 0) {
    mbar_init(q_full, 1);
    for (int st = 0; st < kStages; ++st) {
      mbar_init(k_full(st), kLoaders);
      mbar_init(v_full(st), kLoaders);
      mbar_init(k_empty(st), kWG * 4);
      mbar_init(v_empty(st), kWG * 4);
    }
  }
  __syncthreads();

  if (wg == kWG) {
    // Producer warpgroup: Q, then K and V tile by tile into the stages the
    // consumers have released. Tile u of the block uses stage u % kStages
    // for the (u / kStages)-th time; its first use waits for nothing.
    set_max_regs_dec<kProducerRegs>();
    const int ltid = tid - kWG * 128;
    const bool lead = ltid == 0;  // issues the TMA loads
    // A K or V tile into a stage: TMA when all its keys are below kv_len;
    // else cp.async by every producer thread. The full barrier counts one
    // arrival per producer thread either way.
    auto load_kv = [&](unsigned dst, const FaTensorMap& map, const void* src, int j0,
                       unsigned full) {
      if (j0 + kBc <= kv_len) {
        if (lead) {
          mbar_arrive_expect_tx(full, kKVBytes);
          tile_tma<kBc>(dst, map, kvh, j0, b, full);
        } else {
          mbar_arrive(full);
        }
      } else {
        tile_async<kBc>(dst, FaTileSrc{static_cast<const unsigned short*>(src) +
                                           fa_at(p.kv_stride, b, j0, kvh),
                                       p.kv_stride[1], kv_len - j0, p.H},
                        ltid);
        mbar_arrive_cp_async(full);
      }
    };
    if (t_end > t_begin) {
      if (lead) {
        mbar_arrive_expect_tx(q_full, kQBytes);
        tile_tma<kBr>(sq, maps.q, n, m0, b, q_full);
      }
      for (int tile = t_begin; tile < t_end; ++tile) {
        const int u = tile - t_begin, st = u % kStages, ph = (u / kStages) & 1;
        mbar_wait(k_empty(st), ph ^ 1);
        load_kv(sk(st), maps.k, p.k, tile * kBc, k_full(st));
        mbar_wait(v_empty(st), ph ^ 1);
        load_kv(sv(st), maps.v, p.v, tile * kBc, v_full(st));
      }
    }
    return;
  }

  set_max_regs_inc<kConsumerRegs>();
  // This warp's 16 rows decide the elementwise mask.
  const int w0 = m0 + wg * 64 + (warp & 3) * 16, w1 = w0 + 16;

  float o[kNo][4];
#pragma unroll
  for (int i = 0; i < kNo; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float row_m[2] = {FA_NEG_INF, FA_NEG_INF}, row_l[2] = {0.f, 0.f};
  const float to_log2 = FA_EXTRAS ? 1.f : p.rules.scale * kFaLog2e;

  float s[kNs][4];
  unsigned pa[kBc / 16][4];  // P of the previous tile, as wgmma A fragments
  float alpha[2];
  // Waits for a full stage; a cp.async tile came through the generic proxy,
  // wgmma reads through the async one.
  auto acquire = [&](unsigned bar, int parity) {
    mbar_wait(bar, parity);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  };
  auto release = [&](unsigned bar) {
    __syncwarp();
    if (lane == 0) mbar_arrive(bar);
  };
  // S = Q K^T for a tile: H / 16 k-steps; a k-step is 32 bytes into a
  // 128-byte row, every fourth one starts the next panel.
  auto issue_s = [&](int st) {
#pragma unroll
    for (int kk = 0; kk < kH / 16; ++kk) {
      const unsigned ka = sk(st) + (kk >> 2) * kBc * 128 + (kk & 3) * 32;
      const unsigned qa = sq + (kk >> 2) * kBr * 128 + wg * 64 * 128 + (kk & 3) * 32;
      wgmma_ss<kBc>(&s[0][0], desc(qa, 16, 1024), desc(ka, 16, 1024), kk > 0);
    }
    wg_commit();
  };
  // O += P V for the tile whose P is in pa.
  auto issue_pv = [&](int st) {
#pragma unroll
    for (int kk = 0; kk < kBc / 16; ++kk) {
      // N-major: LBO steps between 64-column panels, SBO between 8-key atoms.
      wgmma_rs<kH>(&o[0][0], pa[kk], desc(sv(st) + kk * 2048, kBc * 128, 1024));
    }
    wg_commit();
  };
  // The softmax of S: probabilities in s, the rescale factors in alpha.
  auto probs = [&](int tile) {
    const int n0 = tile * kBc;
    if (!fa_all_visible(p.rules, q_len, kv_len, w0, w1, n0, n0 + kBc))
      fa_mask_rows(p.rules, s, w0 + g, n0, q_len, kv_len, t4);
    fa_softmax_probs(p, s, row_m, row_l, alpha, b, n, w0 + g, n0, t4, to_log2);
  };
  auto pack = [&]() {
#pragma unroll
    for (int kk = 0; kk < kBc / 16; ++kk) fa_pack_a(s, kk, pa[kk]);
  };

  if (t_end > t_begin) {
    // Software pipeline: while the tensor cores run O += P(j-1) V(j-1), the
    // softmax of S(j) runs on the CUDA cores.
    acquire(q_full, 0);
    for (int tile = t_begin; tile < t_end; ++tile) {
      const int u = tile - t_begin, st = u % kStages, ph = (u / kStages) & 1;
      const int pst = (u + kStages - 1) % kStages, pph = ((u - 1) / kStages) & 1;
      acquire(k_full(st), ph);
      if (u > 0) acquire(v_full(pst), pph);
      reg_fence<kNo * 4>(&o[0][0]);
      wg_fence();
      issue_s(st);
      if (u > 0) issue_pv(pst);
      if (u > 0) wg_wait<1>(); else wg_wait<0>();
      reg_fence<kNs * 4>(&s[0][0]);
      release(k_empty(st));
      probs(tile);
      wg_wait<0>();
      reg_fence<kNo * 4>(&o[0][0]);
      if (u > 0) release(v_empty(pst));
      fa_rescale_rows(o, alpha);
      pack();
    }
    // The last tile's P V.
    const int u = t_end - 1 - t_begin;
    acquire(v_full(u % kStages), (u / kStages) & 1);
    reg_fence<kNo * 4>(&o[0][0]);
    wg_fence();
    issue_pv(u % kStages);
    wg_wait<0>();
    reg_fence<kNo * 4>(&o[0][0]);
  }

  // The block's unit, recomputed rather than kept live across the loop.
  const FaBlock end = fa_block(p, kBr, kBc);
  fa_write_rows(p, o, row_m, row_l, end.b, end.n, end.m0, kBr, w0 + g, t4, to_log2,
                fa_forward_slot(p, end));
}
