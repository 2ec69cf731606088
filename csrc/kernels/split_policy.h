// How many ways to split each unit's keys (split-KV, Flash-Decoding) when a
// call has too few units of work for the parallel workers: the one policy of
// the CPU kernel (workers: threads) and the CUDA forward kernels (workers:
// the resident blocks of a wave, from the loaded kernel's occupancy).
// Framework-free; host code only.
#pragma once

#include <algorithm>
#include <cstdint>

namespace fastattn {

// 1 when `units` fill the `workers`; else enough splits for every worker to
// get one, each over at least `min_keys` of the `keys`, at most `most`.
inline int64_t SplitCount(int64_t units, int64_t keys, int64_t workers, int64_t min_keys,
                          int64_t most) {
  if (units <= 0 || units >= workers) return 1;
  const int64_t wanted = (workers + units - 1) / units;
  return std::max<int64_t>(1, std::min({wanted, keys / min_keys, most}));
}

}  // namespace fastattn
