"""Native kernels: loading the extension, FFI registration, choosing a path.

The extension ``fastattn_jax._ffi`` only hands out XLA FFI handler capsules;
this module registers them with ``jax.ffi.register_ffi_target`` and builds
the ``jax.ffi.ffi_call`` that runs a fused kernel.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np

try:
  from fastattn_jax import _ffi
except ImportError as err:
  raise ImportError(
      "fastattn_jax's native extension (fastattn_jax._ffi) is missing: install "
      "the package with `pip install .` (a source checkout on sys.path, e.g. "
      "the current directory, shadows the installed package)") from err
from fastattn_jax import cuda_kernels
from fastattn_jax.shapes import AttentionConfig

logger = logging.getLogger("fastattn_jax")

#: Fused paths built into this package: implementation name -> (JAX platform,
#: FFI target name).
FUSED_PATHS = {
    "cpu": ("cpu", "fastattn_attention_fwd_cpu"),
    **{name: ("cuda", "fastattn_attention_fwd_cuda") for name in cuda_kernels.PATHS},
}
#: FFI target of the CUDA decode kernel, which every CUDA path uses for calls
#: with few query rows per key/value head (``uses_decode_kernel``).
DECODE_TARGET = "fastattn_decode_cuda"
#: Paths that need no kernel of ours.
OTHER_PATHS = ("xla", "cudnn")
#: Largest head dim of the CUDA kernels.
CUDA_MAX_HEAD_DIM = cuda_kernels.HEAD_DIMS[-1]

for _platform, _types in _ffi.types().items():
  for _name, _registration in _types.items():
    jax.ffi.register_ffi_type(_name, _registration, platform=_platform)
for _platform, _targets in _ffi.registrations().items():
  for _name, _handler in _targets.items():
    jax.ffi.register_ffi_target(_name, _handler, platform=_platform)

_logged_paths: set[tuple[str, str]] = set()


def implementations() -> tuple[str, ...]:
  """All implementation names ``fast_attention`` accepts, on any platform."""
  return (*FUSED_PATHS, *OTHER_PATHS)


def check_name(implementation: str) -> None:
  """Raises ValueError unless ``implementation`` names a path."""
  if implementation not in implementations():
    raise ValueError(
        f"implementation must be None or one of {implementations()}, got "
        f"{implementation!r}")


def _compute_capability() -> tuple[int, int]:
  """(major, minor) of the first CUDA device."""
  major, minor = str(jax.devices("cuda")[0].compute_capability).split(".")
  return int(major), int(minor)


def _cuda_path_for(capability: tuple[int, int], head_dim: int | None) -> str:
  if cuda_kernels.runs_on(90, capability) and (
      head_dim is None or cuda_kernels.kernel_head_dim(head_dim, 90)
      == cuda_kernels.kernel_head_dim(head_dim)):
    return "cuda_sm90"
  if capability >= (8, 0):
    return "cuda_sm80"
  return "cuda_sm75" if capability >= (7, 5) else "cuda_sm70"


def default_path(platform: str, dtype=None, head_dim: int | None = None) -> str:
  """The path ``implementation=None`` takes on a JAX platform ("cpu", "cuda").

  On CUDA GPUs: the kernel path of the compute capability (7.0: "cuda_sm70",
  7.5: "cuda_sm75", 8.0 and newer: "cuda_sm80"; 9.0: "cuda_sm90" when H,
  rounded up to a multiple of 32, is one of 64, which that path needs), except
  that float32 inputs and head dims above 256 take "xla" (the kernels compute
  in 16-bit operands, see ``cuda_kernels.operand_dtype``; float32 keeps
  jax.nn's numerics).
  """
  if platform == "cpu":
    return "cpu"
  if platform == "cuda":
    if (dtype is not None and jnp.dtype(dtype) == jnp.float32) or (
        head_dim is not None and head_dim > CUDA_MAX_HEAD_DIM):
      return "xla"
    return _cuda_path_for(_compute_capability(), head_dim)
  return "xla"


def resolve_implementation(implementation: str | None = None,
                           backend: str | None = None, dtype=None,
                           head_dim: int | None = None) -> str:
  """Names the path that serves ``fast_attention(..., implementation=...)``.

  Args:
    implementation: as passed to ``fast_attention`` (None: best available).
    backend: a JAX platform name ("cpu", "cuda", ...); default: the default
      backend, ``jax.default_backend()``.
    dtype, head_dim: of the query, when known; they matter on GPUs (see
      ``default_path``).

  Returns:
    The path name, e.g. "cpu", "cuda_sm80" or "xla" (float64 inputs always
    take "xla").

  Raises:
    ValueError: for an unknown name, a fused path whose platform is not
      ``backend``, a CUDA path the GPU cannot run (``cuda_sm80`` needs compute
      capability 8.0 or newer, ``cuda_sm75`` 7.5, ``cuda_sm90`` exactly 9.0),
      or a head dim above 256 on a CUDA path.
  """
  platform = backend or jax.default_backend()
  if platform == "gpu":  # jax.default_backend()'s name for CUDA and ROCm alike
    version = jax.devices("gpu")[0].client.platform_version.lower()
    platform = "rocm" if "rocm" in version else "cuda"
  if implementation is None:
    return default_path(platform, dtype, head_dim)
  check_name(implementation)
  if implementation in FUSED_PATHS and FUSED_PATHS[implementation][0] != platform:
    raise ValueError(
        f"implementation={implementation!r} runs on platform "
        f"{FUSED_PATHS[implementation][0]!r}, but the computation targets "
        f"{platform!r}; use implementation=None to pick a path per platform")
  if implementation in cuda_kernels.PATHS:
    path = cuda_kernels.PATHS[implementation]
    if not cuda_kernels.runs_on(path, _compute_capability()):
      major, minor = divmod(path, 10)
      needed = "exactly 9.0" if path == 90 else f"{major}.{minor} or newer"
      raise ValueError(
          f"implementation={implementation!r} needs a GPU of compute capability "
          f"{needed}; this one is {'.'.join(map(str, _compute_capability()))} "
          f"(use implementation=None)")
    if head_dim is not None and head_dim > CUDA_MAX_HEAD_DIM:
      raise ValueError(
          f"implementation={implementation!r} supports head dims up to "
          f"{CUDA_MAX_HEAD_DIM}, got H={head_dim}; use implementation=None or 'xla'")
  return implementation


def log_path_once(path: str, platform: str) -> None:
  if (path, platform) not in _logged_paths:
    _logged_paths.add((path, platform))
    logger.info("fast_attention: using the %r path on %s", path, platform)


#: Split-KV on the CUDA paths: each split covers at least this many keys.
MIN_SPLIT_KEYS = 256
#: At most this many splits.
MAX_KV_SPLITS = 64
#: Rows of the largest CUDA kernel tile (Br), for counting thread blocks.
_CUDA_BLOCK_ROWS = 128


def _multiprocessor_count() -> int:
  return int(getattr(jax.devices("cuda")[0], "core_count", 0) or 0) or 108


def kv_splits(B: int, T: int, N: int, S: int, multiprocessors: int) -> int:
  """Split-KV factor of a CUDA call (flash-decoding).

  With fewer row blocks, ceil(T / 128) * N * B, than the GPU has
  multiprocessors, each row block's keys are split so that about two blocks
  run per multiprocessor, each over at least ``MIN_SPLIT_KEYS`` keys; 1 (no
  split) otherwise.
  """
  row_blocks = -(-T // _CUDA_BLOCK_ROWS) * N * B
  if row_blocks == 0 or row_blocks >= multiprocessors:
    return 1
  wanted = -(-2 * multiprocessors // row_blocks)
  return max(1, min(wanted, S // MIN_SPLIT_KEYS, MAX_KV_SPLITS))


#: Decode kernel split-KV: the workspace holds splits for up to this many
#: blocks per multiprocessor (the handler picks the count from the kernel's
#: real occupancy; more blocks than one wave pay off when B * K does not
#: divide the wave),
DECODE_MAX_BLOCKS_PER_SM = 16
#: keys each split covers at least,
MIN_DECODE_SPLIT_KEYS = 128
#: and the most splits (the kernel's limit).
MAX_DECODE_SPLITS = 128


def decode_splits(B: int, K: int, S: int, multiprocessors: int) -> int:
  """The most split-KV blocks per key/value head of a decode-kernel call,
  which sizes its workspace: enough for B * K * splits blocks to fill
  ``DECODE_MAX_BLOCKS_PER_SM`` per multiprocessor, each over at least
  ``MIN_DECODE_SPLIT_KEYS`` keys. The FFI handler picks how many of them to
  use from the kernel's occupancy (``DecodeSplits`` in
  csrc/ffi/attention_cuda_ffi.cc)."""
  if B * K == 0:
    return 1
  wanted = -(-DECODE_MAX_BLOCKS_PER_SM * multiprocessors // (B * K))
  return max(1, min(wanted, S // MIN_DECODE_SPLIT_KEYS, MAX_DECODE_SPLITS))


def uses_decode_kernel(q_shape, k_shape, has_extras: bool) -> bool:
  """Whether a CUDA call runs the decode kernel: no bias, mask or query
  lengths (``has_extras``), S > 0, and at most ``cuda_kernels.DECODE_ROWS[-1]``
  query rows (T * N / K) per key/value head."""
  _, T, N, _ = q_shape
  S, K = k_shape[1], k_shape[2]
  return not has_extras and S > 0 and K > 0 and cuda_kernels.decode_rows(T * (N // K)) > 0


def _rule_attrs(config: AttentionConfig) -> dict:
  """The FFI attributes both CUDA targets and the CPU one share: the logit
  transform and the index rules."""
  left, right = config.window if config.window is not None else (-1, -1)
  return dict(scale=np.float32(config.scale), softcap=np.float32(config.softcap or 0.0),
              is_causal=np.int64(config.is_causal), end_aligned=np.int64(config.end_aligned),
              window_left=np.int64(left), window_right=np.int64(right))


def decode_call(path: str, config: AttentionConfig, q, k, v, kv_lens=None):
  """Runs the CUDA decode kernel (csrc/kernels/cuda/attention_decode.cu); returns (out, lse).

  q (B, T, N, H), k and v (B, S, K, H) in float16 or bfloat16 as they are
  (float32 is rounded to float16), H zero-padded to a multiple of 8. With
  split-KV the kernel merges the splits itself, in a float32 workspace.
  """
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  out_dtype = q.dtype
  if q.dtype not in (jnp.float16, jnp.bfloat16):
    q, k, v = (x.astype(jnp.float16) for x in (q, k, v))
  if H % 8:
    pad = [(0, 0)] * 3 + [(0, 8 - H % 8)]
    q, k, v = (jnp.pad(x, pad) for x in (q, k, v))
  Hp = q.shape[-1]
  rows = cuda_kernels.decode_rows(T * (N // K))
  splits = decode_splits(B, K, S, _multiprocessor_count())
  words = B * K * splits * rows * (Hp + 1) if splits > 1 else 0
  call = jax.ffi.ffi_call(DECODE_TARGET, (
      jax.ShapeDtypeStruct(q.shape, out_dtype),
      jax.ShapeDtypeStruct((B, T, N), jnp.float32),
      jax.ShapeDtypeStruct((words,), jnp.float32)))
  out, lse, _ = call(
      q, k, v, jnp.zeros((0,), jnp.int32) if kv_lens is None else kv_lens,
      **_rule_attrs(config),
      kv_splits=np.int64(splits),
      kernel_path=np.int64(cuda_kernels.PATHS[path]),
  )
  return out[..., :H], lse


def combine_splits(out, lse):
  """Merges split-KV partials: out (splits, B, T, N, H), lse (splits, B, T, N).

  Each split's out is normalized over its own keys; the merge weighs split s
  by exp(lse_s - lse), lse = logsumexp over the splits. Rows no split saw
  stay 0 with lse -inf.
  """
  m = jnp.max(lse, axis=0)
  m_safe = jnp.where(jnp.isneginf(m), 0.0, m)
  w = jnp.exp(lse - m_safe)
  l = jnp.sum(w, axis=0)
  l_safe = jnp.where(l == 0, 1.0, l)
  merged = jnp.einsum("sbtn,sbtnh->btnh", w, out) / l_safe[..., None]
  return merged, jnp.where(l == 0, -jnp.inf, m_safe + jnp.log(l_safe))


def fused_call(path: str, config: AttentionConfig, q, k, v, bias=None,
               mask=None, q_lens=None, kv_lens=None):
  """Runs the fused kernel of ``path`` on 4-D operands; returns (out, lse).

  Absent optional operands are passed as empty arrays, which the handler reads
  as "none"; all options travel as one attribute dictionary that the handler
  decodes into a struct.

  On CUDA paths, calls with few query rows per key/value head (decoding) run
  the decode kernel (``decode_call``). The other kernels take 16-bit q, k, v
  with H a multiple of 32 (64 on path 90) and a float32 bias: converted and
  zero-padded here (zero columns change neither q . k nor, once sliced off,
  the output). When few row blocks would leave the GPU idle, they split the
  keys (``kv_splits``) and write float32 partials, merged here. A single
  query per sequence (T = 1, no window) with more than 8 heads per key/value
  head has those heads folded into the rows of one tile.
  """
  B, T, N, H = q.shape
  empty = lambda dtype: jnp.zeros((0,), dtype)
  out_dtype = q.dtype
  kernel_path = cuda_kernels.PATHS.get(path, 0)
  extras = bias is not None or mask is not None or q_lens is not None
  if kernel_path and uses_decode_kernel(q.shape, k.shape, extras):
    return decode_call(path, config, q, k, v, kv_lens)
  G = N // k.shape[2]
  if (kernel_path and T == 1 and G > 1 and not extras and config.window is None and
      (config.end_aligned or not config.is_causal)):
    # One query row per head, which sees every key: the G heads that read one
    # key/value head become the rows of a K-head problem.
    folded = dataclasses.replace(config, is_causal=False, end_aligned=False)
    out, lse = fused_call(path, folded, q.reshape(B, k.shape[2], G, H).transpose(0, 2, 1, 3),
                          k, v, kv_lens=kv_lens)
    return (out.transpose(0, 2, 1, 3).reshape(B, 1, N, H),
            lse.transpose(0, 2, 1).reshape(B, 1, N))
  splits = 1
  if kernel_path:
    op_dtype = cuda_kernels.operand_dtype(kernel_path, jnp.dtype(q.dtype).name)
    pad = [(0, 0)] * 3 + [(0, cuda_kernels.kernel_head_dim(H, kernel_path) - H)]
    q, k, v = (jnp.pad(x.astype(op_dtype), pad) for x in (q, k, v))
    if bias is not None:
      bias = bias.astype(jnp.float32)
    splits = kv_splits(B, T, N, k.shape[1], _multiprocessor_count())
  if splits > 1:
    result_types = (jax.ShapeDtypeStruct((splits * B, *q.shape[1:]), jnp.float32),
                    jax.ShapeDtypeStruct((splits * B, T, N), jnp.float32))
  else:
    result_types = (jax.ShapeDtypeStruct(q.shape, out_dtype),
                    jax.ShapeDtypeStruct((B, T, N), jnp.float32))
  call = jax.ffi.ffi_call(FUSED_PATHS[path][1], result_types)
  out, lse = call(
      q, k, v,
      empty(jnp.float32 if kernel_path else q.dtype) if bias is None else bias,
      empty(jnp.bool_) if mask is None else mask,
      empty(jnp.int32) if q_lens is None else q_lens,
      empty(jnp.int32) if kv_lens is None else kv_lens,
      **_rule_attrs(config),
      kernel_path=np.int64(kernel_path),
  )
  if splits > 1:
    out, lse = combine_splits(out.reshape(splits, *q.shape), lse.reshape(splits, B, T, N))
    out = out.astype(out_dtype)
  return out[..., :H], lse
