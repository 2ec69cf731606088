"""The CUDA kernels: where NVRTC and the kernel cache are, which variants exist.

The kernels (``csrc/kernels/cuda/``) are compiled at run time by NVRTC for the
exact GPU and specialization, by the extension (``csrc/cuda/``), and kept in an
on-disk cache. This module tells the extension which ``libnvrtc`` to try
(the one matching the CUDA major version of the installed JAX plugin first)
and where the cache lives, and lists the variants that
``python -m fastattn_jax.precompile`` builds.

Environment:
  FASTATTN_CACHE_DIR  the kernel cache folder (default: the user cache folder,
                      ``$XDG_CACHE_HOME/fastattn_jax`` or ``~/.cache/fastattn_jax``);
                      an empty value turns the disk cache off.
  FASTATTN_NVRTC      path of a ``libnvrtc.so`` to try before all others.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.metadata
import importlib.util
import os

from fastattn_jax import _ffi

#: Forced CUDA paths: implementation name -> kernel path code.
PATHS = {"cuda_sm70": 70, "cuda_sm75": 75, "cuda_sm80": 80, "cuda_sm90": 90}
#: Head dims the kernels are specialized for; H is padded up to the next one.
HEAD_DIMS = tuple(range(32, 257, 32))
#: Rows per block the decode kernel (attention_decode.cu) is built for: it
#: serves calls with T * N / K query rows per key/value head up to the last.
DECODE_ROWS = (1, 2, 4, 8)
#: Kernel dtype codes (csrc/kernels/cuda/attention_common.cuh).
DTYPE_CODES = {"float16": 0, "bfloat16": 1, "float32": 2}


def plugin_cuda_major() -> int | None:
  """CUDA major version of the installed JAX CUDA plugin (12, 13), or None."""
  for major in (13, 12):
    for name in (f"jax-cuda{major}-plugin", f"jax_cuda{major}_plugin"):
      try:
        importlib.metadata.version(name)
        return major
      except importlib.metadata.PackageNotFoundError:
        pass
  return None


def _nvidia_lib_dirs() -> list[str]:
  """lib folders of the nvidia-* wheels (nvidia/cuda_nvrtc/lib, nvidia/cu13/lib...)."""
  spec = importlib.util.find_spec("nvidia")
  roots = list(spec.submodule_search_locations) if spec and spec.submodule_search_locations else []
  return [d for root in roots for d in sorted(glob.glob(os.path.join(root, "*", "lib")))]


def nvrtc_candidates() -> list[str]:
  """libnvrtc paths or sonames to try, best first."""
  found = []
  if os.environ.get("FASTATTN_NVRTC"):
    found.append(os.environ["FASTATTN_NVRTC"])
  dirs = _nvidia_lib_dirs()
  cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
  dirs += [os.path.join(cuda_home, "lib64"), os.path.join(cuda_home, "lib")]
  libs = [p for d in dirs for p in sorted(glob.glob(os.path.join(d, "libnvrtc.so.*")))
          if p.rsplit(".so.", 1)[1].isdigit()]  # libnvrtc.so.12, not builtins or .alt
  major = plugin_cuda_major()
  libs.sort(key=lambda p: p.rsplit(".so.", 1)[1] != str(major))  # stable: matching first
  found += libs
  found += [f"libnvrtc.so.{m}" for m in (major, 13, 12) if m] + ["libnvrtc.so"]
  return list(dict.fromkeys(found))


def cache_dir() -> str:
  """The kernel cache folder ('' when FASTATTN_CACHE_DIR is set empty)."""
  if "FASTATTN_CACHE_DIR" in os.environ:
    return os.environ["FASTATTN_CACHE_DIR"]
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "fastattn_jax")


def configure() -> None:
  """Hands the NVRTC candidates and the cache folder to the extension."""
  _ffi.set_nvrtc_candidates(nvrtc_candidates())
  _ffi.set_cache_dir(cache_dir())


def kernel_head_dim(head_dim: int, path: int = 80) -> int:
  """The specialization serving head dim H: H rounded up to a multiple of 32,
  of 64 on path 90 (its shared-memory rows are 64-element panels)."""
  step = 64 if path == 90 else 32
  return -(-head_dim // step) * step


def runs_on(path: int, capability: tuple[int, int]) -> bool:
  """Whether a GPU of compute capability (major, minor) runs kernel ``path``.

  Newer GPUs run the older paths' instructions; path 90 uses wgmma, which
  only the arch-specific sm_90a target has, so it runs on 9.0 alone.
  """
  if path == 90:
    return tuple(capability) == (9, 0)
  return tuple(capability) >= divmod(path, 10)


def operand_dtype(path: int, dtype: str) -> str:
  """The dtype q, k and v are converted to for a kernel path.

  Paths 80 and 90 compute in the input's float16 or bfloat16; the Volta and Turing
  tensor cores have no bfloat16, so paths 70 and 75 round bfloat16 inputs to
  float16 (finite values above 65504 overflow). float32 inputs are rounded to
  float16 on every path: the same 10-bit significand as the TF32 that XLA uses
  for float32 matrix products on Ampere and newer. Accumulation and the
  softmax are float32 on every path, and the output keeps the input dtype.
  """
  return dtype if (path >= 80 and dtype == "bfloat16") else "float16"


def decode_path(path: int) -> int:
  """The decode kernel build serving kernel ``path``: 80 (cp.async) from
  path 80 on, else 75."""
  return 80 if path >= 80 else 75


def decode_rows(rows: int) -> int:
  """The decode kernel's rows per block for T * N / K rows: the smallest of
  ``DECODE_ROWS`` that holds them, or 0 when none does."""
  return next((r for r in DECODE_ROWS if rows <= r), 0)


@dataclasses.dataclass(frozen=True)
class Variant:
  """One kernel specialization. ``decode_rows`` > 0 names the decode kernel
  (general False), in two builds: path 80 (cp.async, for the sm80 and sm90
  paths) and path 75 (for sm70 and sm75); it reads float16 and bfloat16
  alike on every arch."""
  path: int
  head_dim: int
  dtype: str
  out_dtype: str
  general: bool
  decode_rows: int = 0

  def compile(self, arch: str) -> dict:
    """Compiles for ``arch`` ("sm_90") or reads the cache; see ``_ffi.compile_kernel``."""
    return _ffi.compile_kernel(arch, self.path, self.head_dim, DTYPE_CODES[self.dtype],
                               DTYPE_CODES[self.out_dtype], int(self.general),
                               self.decode_rows)


def paths_for_arch(arch: str) -> list[int]:
  """Kernel paths a GPU of ``arch`` ("sm_90") can run; see ``runs_on``."""
  sm = int(arch.removeprefix("sm_"))
  return [p for p in PATHS.values() if runs_on(p, divmod(sm, 10))]


def shipped_variants(arch: str, head_dims=HEAD_DIMS, dtypes=("float16", "bfloat16"),
                     general=(False, True)) -> list[Variant]:
  """The variants ``precompile`` builds for ``arch``: each path the arch runs,
  head dim, input dtype (output in the same dtype) and feature set, and the
  decode kernel for each head dim, input dtype and row count."""
  variants = []
  for path in paths_for_arch(arch):
    for dtype in dtypes:
      op = operand_dtype(path, dtype)
      for head_dim in head_dims:
        for g in general:
          variants.append(Variant(path, kernel_head_dim(head_dim, path), op, dtype, g))
  for path in sorted({decode_path(p) for p in paths_for_arch(arch)}):
    for dtype in dtypes:
      op = dtype if dtype == "bfloat16" else "float16"
      for head_dim in head_dims:
        for rows in DECODE_ROWS:
          variants.append(Variant(path, kernel_head_dim(head_dim), op, dtype, False, rows))
  return list(dict.fromkeys(variants))


def parse_arch(text: str) -> str:
  """'sm_90', 'sm90', '90' or '9.0' -> 'sm_90'."""
  t = text.strip().lower().removeprefix("sm_").removeprefix("sm").replace(".", "")
  if not t.isdigit() or int(t) < 70:
    raise ValueError(f"not a CUDA arch of compute capability >= 7.0: {text!r}")
  return f"sm_{t}"


configure()
