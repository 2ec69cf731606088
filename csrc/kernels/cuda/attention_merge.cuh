// The forward kernels' split-KV merge, a second kernel of their module that
// the handler launches after fa_forward when units are split: block u merges
// unit u's `parts` slots into out and lse. (Merged in fa_forward's own
// epilogue instead, the last segment's extra control flow made ptxas spill
// kernel 80 at H = 128.) Included by the forward sources alone
// (attention_wgmma.cu, attention_mma16.cu, attention_volta.cu): the decode and
// backward modules do not carry it.
#pragma once

#include "attention_split.cuh"

extern "C" __global__ void __launch_bounds__(kFaMergeThreads) fa_merge(const FaParams p) {
  const FaBlock blk = fa_block(p, kBr, kBc);  // blockIdx.x: the unit, split 0
  fa_merge_segments<8>(p, fa_workspace_slots(p.split, (long long)blk.unit * p.split.parts,
                                              kBr, p.H),
                       p.split.parts, min(kBr, p.T - blk.m0), threadIdx.x, kFaMergeThreads,
                       [&](int r) { return fa_at(p.out_stride, blk.b, blk.m0 + r, blk.n); },
                       [&](int r) { return fa_at(p.lse_stride, blk.b, blk.m0 + r, blk.n); },
                       [&](float* lse) { return fa_join_sink(p.features, blk.b, blk.n, lse); });
}
