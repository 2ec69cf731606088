"""The CUDA kernels from Python: which one serves a call, and the custom call that runs it.

Every rule about the kernels (which kernel a GPU runs, head dims, rows per
block, operand dtypes, split-KV, workspace) has one owner, in C++
(``csrc/cuda/variants.h``, on the tile facts of
``csrc/kernels/cuda/attention_tiles.cuh``), which this module asks through the
extension; nothing here derives them again. The kernels are compiled at first
use by NVRTC for the exact GPU and kept in an on-disk cache; this module tells
the extension which ``libnvrtc`` to try (the one matching the CUDA major
version of the installed JAX plugin first) and where the cache lives.

Environment:
  FASTATTN_CACHE_DIR  the kernel cache folder (default: the user cache folder,
                      ``$XDG_CACHE_HOME/fastattn_jax`` or ``~/.cache/fastattn_jax``);
                      an empty value turns the disk cache off.
  FASTATTN_NVRTC      path of a ``libnvrtc.so`` to try before all others.
"""

from __future__ import annotations

import functools
import glob
import importlib.metadata
import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np

from fastattn_jax import _ffi
from fastattn_jax.custom_calls import kernel_call
from fastattn_jax.reference import plain_kv
from fastattn_jax.shapes import DTYPE_CODES, AttentionConfig

#: The CUDA targets: every forward kernel, and the backward kernels; the
#: variant chosen by the lowering.
TARGET = "fastattn_attention_cuda"
BACKWARD_TARGET = "fastattn_attention_cuda_backward"
_LIMITS = _ffi.cuda_limits()
#: Largest head dim of the CUDA kernels.
MAX_HEAD_DIM = _LIMITS["max_head_dim"]
#: Rows of q, k and v a multiple of this many elements are read in place; the
#: kernels pad other head dims (a copy) to one.
ROW_ALIGN = _LIMITS["row_align"]
#: Implementation name -> the kernel (the sm it was written for).
IMPLEMENTATIONS = {f"cuda_sm{kernel}": kernel for kernel in _LIMITS["kernels"]}
_DTYPE_NAMES = {code: name for name, code in DTYPE_CODES.items()}


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
  """Hands the NVRTC candidates and the cache folder, as the environment
  names them now, to the extension. The first CUDA call does it once
  (``_configured``); call it again after changing the environment."""
  _ffi.set_nvrtc_candidates(nvrtc_candidates())
  _ffi.set_cache_dir(cache_dir())


@functools.cache
def _configured() -> None:
  """``configure()``, once per process, before the extension compiles or
  runs a kernel: not at import, which on a machine without a GPU would
  search the disk for NVRTC for nothing."""
  configure()


# --- which kernel ----------------------------------------------------------------

def compute_capability(device=None) -> int:
  """10 * major + minor of ``device`` (default: the first CUDA device)."""
  device = device or jax.devices("cuda")[0]
  major, minor = str(device.compute_capability).split(".")
  return 10 * int(major) + int(minor)


def multiprocessors(device=None) -> int:
  """The multiprocessor count of ``device`` (default: the first CUDA device)."""
  device = device or jax.devices("cuda")[0]
  return int(device.core_count)


def default_implementation(cc: int, head_dim: int | None) -> str:
  """The CUDA implementation ``implementation=None`` runs on compute
  capability ``cc`` for head dim H (None: any)."""
  return f"cuda_sm{_ffi.cuda_default_kernel(cc, 64 if head_dim is None else head_dim)}"


def runs_on(implementation: str, cc: int) -> bool:
  """Whether a GPU of compute capability ``cc`` runs ``implementation``."""
  return _ffi.cuda_runs_on(IMPLEMENTATIONS[implementation], cc)


def operand_dtype(implementation: str, dtype) -> str:
  """The dtype ``implementation``'s forward kernels multiply ``dtype`` inputs in."""
  code = _ffi.cuda_operand_dtype(IMPLEMENTATIONS[implementation],
                                 DTYPE_CODES[jnp.dtype(dtype).name])
  return _DTYPE_NAMES[code]


def plan(implementation: str, config: AttentionConfig, q_shape, k_shape, dtype,
         bias: bool = False, mask: bool = False, q_lens: bool = False,
         backward: bool = False, kv_dtype=None) -> dict:
  """How ``implementation`` serves a call (with ``backward``, its gradients,
  in a fixed summation order where ``config.deterministic``): the owner's
  ``CallPlan`` as a dict (variant key and fields, operand dtype code, row
  elements, fold_heads). The forward's out is float32 where
  ``config.float32_out`` (the variant's out_dtype), else in ``dtype``. With
  ``config.has_block_table``, ``k_shape`` is the cache the pages make, (B,
  max_pages * page_size, K, H), and a decode variant is the paged build.
  With ``config.has_kv_scales``, ``kv_dtype`` is the quantized cache's
  (int8 or float8_e4m3fn), and the decode kernel's build 80 reads it in
  place at H a multiple of 16 (``reads_quantized``).

  Raises:
    ValueError: the kernels cannot serve the call (e.g. H > 256; the backward:
      H > 128 on the sm70 and sm75 paths; symbolic dims, as ``jax.export``
      makes them: a launch is planned for concrete sizes), saying why.
  """
  symbolic = [d for d in (*q_shape, *k_shape) if not isinstance(d, (int, np.integer))]
  if symbolic:
    raise ValueError(
        f"the CUDA kernels plan their launch for concrete sizes, got query {tuple(q_shape)} "
        f"and key {tuple(k_shape)}: export with concrete dims, or with implementation='xla'")
  B, T, N, H = q_shape
  S, K = k_shape[1], k_shape[2]
  left, right = config.window_bounds
  # Sinks (the rows' final write) are in every forward kernel; segment ids
  # and ALiBi, per-element terms, in the features and extras builds. None is
  # in the decode kernel.
  return _ffi.cuda_plan_call(
      IMPLEMENTATIONS[implementation], B, T, S, N, K, H, DTYPE_CODES[jnp.dtype(dtype).name],
      bias, mask, q_lens or config.has_sinks,
      config.scale, config.softcap or 0.0, config.is_causal,
      config.end_aligned, left, right, backward, config.deterministic,
      DTYPE_CODES["float32"] if config.float32_out and not backward else -1,
      config.for_backward and not backward, config.has_block_table and not backward,
      DTYPE_CODES[jnp.dtype(kv_dtype).name] if config.has_kv_scales and not backward else 0,
      config.has_segment_ids or config.has_alibi)


def describe_variant(plan_: dict) -> str:
  """The kernel variant of a plan in words, e.g. "sm80 H=128 bfloat16->bfloat16"."""
  return _ffi.cuda_variant(plan_["variant"])["describe"]


def kernel_shape(plan_: dict, q_shape, k_shape) -> tuple[int, ...]:
  """(B, T, S, N, K, H) as the kernel sees them: with folded heads, T' = G
  rows of N' = K heads; H is the operands' row length."""
  B, T, N, _ = q_shape
  S, K = k_shape[1], k_shape[2]
  if plan_["fold_heads"]:
    T, N = N // K, K
  return B, T, S, N, K, plan_["row_elements"]


def launch(plan_: dict, q_shape, k_shape, device=None, blocks_per_sm: int = 0) -> dict:
  """The owner's ``LaunchPlan`` for a planned call on ``device`` (default:
  the first CUDA device): tile, grid, split-KV parts, workspace floats. With
  ``blocks_per_sm`` 0, the most blocks the multiprocessor could hold: the
  workspace the lowering allocates covers the loaded kernel's real plan."""
  cc = compute_capability(device)
  return _ffi.cuda_plan_launch(plan_["variant"], *kernel_shape(plan_, q_shape, k_shape),
                               cc, multiprocessors(device), blocks_per_sm)


def call(implementation: str, config: AttentionConfig, q, k, v, bias=None, mask=None,
         q_lens=None, kv_lens=None, block_table=None, k_scale=None, v_scale=None, *,
         features=None):
  """Runs the kernel ``implementation`` plans for the call; returns (out, lse).

  q (B, T, N, H), k and v (B, S, K, H), converted to the plan's operand dtype
  when they are not in it; H not a multiple of 8 is zero-padded to one (16-byte
  rows: the one case that copies the operands); the bias in float32. out is in
  q's dtype, or float32 where ``config.float32_out`` (the kernel writes it so,
  unrounded). The split-KV workspace is a third result, sized by the owner.
  With ``block_table`` (B, max_pages), k and v are pools of pages: the decode
  kernel reads them in place where the plan takes it (``reads_pages``), and
  any other kernel gets them gathered into one (B, S, K, H) cache. With
  ``k_scale`` and ``v_scale``, k and v are a quantized cache: the decode
  kernel reads it in place where the plan takes it (``reads_quantized``),
  any other kernel gets it dequantized to the plan's operand dtype first.
  """
  _configured()
  B, T, N, H = q.shape
  k_shape = k.shape
  if block_table is not None:
    k_shape = (B, block_table.shape[1] * k.shape[1], *k.shape[2:])
  p = plan(implementation, config, q.shape, k_shape, q.dtype, bias is not None,
           mask is not None, q_lens is not None, kv_dtype=k.dtype)
  in_place = block_table is not None and reads_pages(p)
  quantized = k_scale is not None and reads_quantized(p)
  k, v = plain_kv(k, v, None if in_place else block_table, None if quantized else k_scale,
                  None if quantized else v_scale, jnp.dtype(_DTYPE_NAMES[p["operand_dtype"]]))
  if not in_place:
    block_table = None
  if not quantized:
    k_scale = v_scale = jnp.zeros((0,), jnp.float32)
  out_dtype = jnp.dtype(_DTYPE_NAMES[p["out_dtype"]])
  if quantized:  # H a multiple of 16: the 8-bit rows as they are
    (q,) = _kernel_rows(p, q)
  else:
    q, k, v = _kernel_rows(p, q, k, v)
  workspace = launch(p, q.shape, k_shape)["workspace_floats"]
  out, lse, _ = kernel_call(TARGET, (jax.ShapeDtypeStruct(q.shape, out_dtype),
                                     jax.ShapeDtypeStruct((B, T, N), jnp.float32),
                                     jax.ShapeDtypeStruct((workspace,), jnp.float32)),
                            config, q, k, v, bias, mask, q_lens, kv_lens,
                            jnp.zeros((0,), jnp.int32) if block_table is None else block_table,
                            k_scale, v_scale, features=features, bias_dtype=jnp.float32,
                            variant=np.int64(p["variant"]),
                            fold_heads=np.int64(p["fold_heads"]))
  return out[..., :H], lse


def reads_quantized(plan_: dict) -> bool:
  """Whether the kernel of ``plan_`` reads a quantized cache in place: the
  decode kernel's quantized builds do (``csrc/kernels/cuda/attention_decode.cu``)."""
  return bool(_ffi.cuda_variant(plan_["variant"])["kv_quant"])


def reads_pages(plan_: dict) -> bool:
  """Whether the kernel of ``plan_`` reads a paged cache in place: the decode
  kernel's paged build does (``csrc/kernels/cuda/attention_decode.cu``)."""
  return bool(_ffi.cuda_variant(plan_["variant"])["paged"])


def _kernel_rows(p: dict, *xs):
  """``xs`` (..., H) in plan ``p``'s operand dtype and rows of its row
  elements: converted where their dtype differs, zero-padded (a copy) where H
  is not a multiple of 8."""
  operand = jnp.dtype(_DTYPE_NAMES[p["operand_dtype"]])
  H = xs[0].shape[-1]
  xs = [x if x.dtype == operand else x.astype(operand) for x in xs]
  if p["row_elements"] != H:
    pad = [(0, 0)] * (xs[0].ndim - 1) + [(0, p["row_elements"] - H)]
    xs = [jnp.pad(x, pad) for x in xs]
  return xs


def call_backward(implementation: str, config: AttentionConfig, q, k, v, bias, mask, q_lens,
                  kv_lens, d_out, lse, delta, magnitude, *, features=None):
  """Runs the backward kernels ``implementation`` plans for the call; returns
  (dq, dk, dv) in q's, k's and v's shapes and dtypes.

  ``delta`` is D = rowsum(dO o O) - dLSE (B, T, N float32), reduced by the
  caller (``backends.fused_backward_call``, from the float32 O of a
  ``float32_out`` forward for 16-bit inputs), ``magnitude`` sum_h |dO_h O_h|
  (B, T, N float32; the scale of dP - D's rounding where a row's P is 1,
  ``fa_one_hot_tolerance`` in attention_rules.h); q, k, v and d_out go to the
  plan's operand dtype and rows as ``call`` sends them.
  Kernel 90 adds dQ into float32 by atomics unless ``config.deterministic``
  (then a pass of its own), in the layout of the plan's ``dq_accumulator``
  (B, N, panels, rows, pitch); it is taken out of it and rounded to q's dtype
  here. No gradient for the bias (``fastattn_jax.attention`` takes it
  elsewhere).
  """
  _configured()
  B, T, N, H = q.shape
  p = plan(implementation, config, q.shape, k.shape, q.dtype, bias is not None,
           mask is not None, q_lens is not None, backward=True)
  dtypes = (q.dtype, k.dtype, v.dtype)
  delta, magnitude = (jnp.asarray(x, jnp.float32) for x in (delta, magnitude))
  q, k, v, d_out = _kernel_rows(p, q, k, v, d_out)
  # dQ in float32 where the dK/dV kernel adds it by atomics (variant backward 2).
  accumulator = tuple(p["dq_accumulator"])
  dq_out = (jax.ShapeDtypeStruct(accumulator, jnp.float32) if accumulator
            else jax.ShapeDtypeStruct(q.shape, dtypes[0]))
  dq, dk, dv = kernel_call(BACKWARD_TARGET, (
      dq_out, jax.ShapeDtypeStruct(k.shape, dtypes[0]), jax.ShapeDtypeStruct(v.shape, dtypes[0])),
      config, q, k, v, bias, mask, q_lens, kv_lens, d_out, lse, delta, magnitude,
      features=features, bias_dtype=jnp.float32, variant=np.int64(p["variant"]),
      fold_heads=np.int64(0))
  if accumulator:
    _, _, panels, rows, _ = accumulator
    cols = p["head_dim"] // panels  # each panel's columns, then the pitch's padding
    dq = dq[..., :cols].transpose(0, 3, 1, 2, 4).reshape(B, rows, N, panels * cols)[:, :T]
  return tuple(g[..., :H].astype(dt) for g, dt in zip((dq, dk, dv), dtypes))


# --- compiling ahead of time ---------------------------------------------------------

def parse_cc(text: str) -> int:
  """A GPU named as 'sm_90', 'sm90', '90' or '9.0' -> its compute capability, 90."""
  t = text.strip().lower().removeprefix("sm_").removeprefix("sm").replace(".", "")
  if not t.isdigit() or int(t) < 70:
    raise ValueError(f"not a CUDA arch of compute capability >= 7.0: {text!r}")
  return int(t)


def shipped_variants(cc: int, head_dims=None, dtypes=("float16", "bfloat16")) -> list[int]:
  """Keys of the variants ``python -m fastattn_jax.precompile`` builds for
  compute capability ``cc`` (90), at ``head_dims`` (default: every multiple
  of 32 up to the largest) and input ``dtypes``; ``_ffi.cuda_variant(key)``
  describes one."""
  head_dims = range(32, MAX_HEAD_DIM + 1, 32) if head_dims is None else head_dims
  return _ffi.cuda_shipped_variants(cc, list(head_dims), [DTYPE_CODES[d] for d in dtypes])


def compile_variant(key: int, cc: int) -> dict:
  """Compiles variant ``key`` for compute capability ``cc`` (90) or reads it
  from the disk cache; see ``_ffi.compile_kernel``.

  Raises:
    RuntimeError: no NVRTC can compile for ``cc``, or the variant does not
      exist there (the message says why).
  """
  _configured()
  return _ffi.compile_kernel(key, cc)
