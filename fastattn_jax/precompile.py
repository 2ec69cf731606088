"""Fills the CUDA kernel cache ahead of time, with no GPU needed.

    python -m fastattn_jax.precompile --arch sm_70,sm_75,sm_80,sm_90 \\
        [--head-dims 64,128] [--dtypes float16,bfloat16] [--jobs N]

For air-gapped clusters and CI images: run it where NVRTC is installed with
the same ``FASTATTN_CACHE_DIR`` (default: the user cache folder) that the GPU
jobs will use. NVRTC's version is part of each cache key, so precompile with
the NVRTC the jobs will load (``cuda.nvrtc_candidates``: the one matching the
JAX CUDA plugin first).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import sys

from fastattn_jax import _ffi, cuda
from fastattn_jax.shapes import KERNEL_DTYPES


def spills(log: str) -> int:
  """Bytes of register spill stores + loads in a ptxas report (0: none)."""
  return sum(int(a) + int(b) for a, b in re.findall(
      r"(\d+) bytes spill stores, (\d+) bytes spill loads", log))


def serialized_wgmma(log: str) -> bool:
  """Whether ptxas serialized a kernel's wgmma instructions, which takes away
  every overlap of the tensor cores with the rest of the kernel: any of its
  notes "Potential Performance Loss: wgmma.mma_async instructions are
  serialized due to ..." (C7514: an instruction between a wgmma's issue and
  its wait that it cannot prove leaves the accumulators alone; C7520: a
  wait on one control-flow path for a wgmma issued on another; others
  likewise). C7519, an arrive the compiler injected, is not one."""
  return "wgmma.mma_async instructions are serialized" in log


def _csv(kind):
  return lambda text: [kind(x) for x in text.split(",") if x.strip()]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m fastattn_jax.precompile",
      description="Compile fastattn_jax's CUDA kernels into the kernel cache (no GPU needed).")
  parser.add_argument("--arch", dest="ccs", type=_csv(cuda.parse_cc), required=True,
                      help="comma-separated GPU archs, e.g. sm_70,sm_75,sm_80,sm_90")
  parser.add_argument("--head-dims", type=_csv(int),
                      default=list(range(32, cuda.MAX_HEAD_DIM + 1, 32)),
                      help="head dims (each rounded up as its kernel rounds it); default: all")
  parser.add_argument("--dtypes", type=_csv(str), default=["float16", "bfloat16"],
                      help="input dtypes: float16, bfloat16, float32")
  parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                      help="parallel compiles (default: CPU count)")
  args = parser.parse_args(argv)
  for d in args.dtypes:
    if d not in {dtype.name for dtype in KERNEL_DTYPES}:
      parser.error(f"--dtypes: unknown dtype {d!r}")
  cuda.configure()  # FASTATTN_CACHE_DIR / FASTATTN_NVRTC as set now
  if not args.head_dims or not all(0 < h <= cuda.MAX_HEAD_DIM for h in args.head_dims):
    parser.error(f"--head-dims must be in 1..{cuda.MAX_HEAD_DIM}")
  jobs = [(cc, key) for cc in args.ccs
          for key in cuda.shipped_variants(cc, args.head_dims, args.dtypes)]

  print(f"cache: {cuda.cache_dir() or '(disabled)'}; {len(jobs)} kernels", flush=True)
  failed, built = [], 0
  with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
    futures = {pool.submit(cuda.compile_variant, key, cc): (cc, key) for cc, key in jobs}
    for done, fut in enumerate(concurrent.futures.as_completed(futures), 1):
      cc, key = futures[fut]
      try:
        r = fut.result()
        built += not r["from_cache"]
        if spills(r["log"]):
          print(f"note: {r['variant']} for {r['target']} spills registers "
                f"({spills(r['log'])} bytes)")
        if serialized_wgmma(r["log"]):
          print(f"note: {r['variant']} for {r['target']} runs its wgmma serialized (ptxas)")
      except RuntimeError as err:
        failed.append(f"{_ffi.cuda_variant(key)['describe']} for compute capability {cc}: {err}")
      if sys.stderr.isatty():
        print(f"\r{done}/{len(jobs)} kernels", end="" if done < len(jobs) else "\n",
              file=sys.stderr, flush=True)
  for f in failed:
    print(f, file=sys.stderr)
  print(f"{len(jobs) - len(failed)} ready ({built} compiled, {len(jobs) - len(failed) - built} "
        f"already cached), {len(failed)} failed")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
