"""Native kernels: loading the extension, FFI registration, choosing a path, the calls.

The extension ``fastattn_jax._ffi`` hands out XLA FFI handler capsules; this
module registers them with ``jax.ffi.register_ffi_target``, picks the path
that serves a call (``resolve_implementation``) and builds the
``jax.ffi.ffi_call`` that runs a fused kernel: the CPU's here, the CUDA
kernels' in ``fastattn_jax.cuda``.
"""

from __future__ import annotations

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
from fastattn_jax import _util, ascend, cuda, shapes
from fastattn_jax.shapes import AttentionConfig

logger = logging.getLogger("fastattn_jax")

#: The FFI targets of the fused CPU kernel and of its backward.
CPU_TARGET = "fastattn_attention_cpu"
CPU_BACKWARD_TARGET = "fastattn_attention_cpu_backward"
#: Fused paths built into this package: implementation name -> JAX platform.
FUSED_PATHS = {"cpu": "cpu", **{name: "cuda" for name in cuda.IMPLEMENTATIONS},
               **{name: "cpu" for name in ascend.IMPLEMENTATIONS}}

#: Paths that need no kernel of ours.
OTHER_PATHS = ("xla", "cudnn")

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


def build_info() -> dict:
  """Describes the loaded native extension, to tell builds apart or compare them.

  The package's extension is built by CMake (``pip install``) or by Bazel
  (``make bazel``, ``bazel/``); two builds of one checkout register the same
  FFI targets and embed the same kernel sources.

  Returns:
    ``{"built_by": "cmake" or "bazel", "extension": the module's file path,
    "ffi_targets": {platform: sorted target names}, "ffi_types": {platform:
    sorted type names}, "kernel_sources": {"cuda" and "ascend": SHA-256 hex of
    the embedded {file name: text}, file names sorted}}``.
  """
  return {
      "built_by": _ffi.built_by,
      "extension": _ffi.__file__,
      "ffi_targets": {p: sorted(t) for p, t in _ffi.registrations().items()},
      "ffi_types": {p: sorted(t) for p, t in _ffi.types().items()},
      "kernel_sources": {"cuda": _util.sources_digest(_ffi.cuda_sources()),
                         "ascend": _util.sources_digest(_ffi.ascend_sources())},
  }


def default_path(platform: str, dtype=None, head_dim: int | None = None) -> str:
  """The path ``implementation=None`` takes on a JAX platform ("cpu", "cuda").

  On CUDA GPUs: the kernel of the compute capability (``cuda.default_implementation``),
  except that float32 inputs and head dims above ``cuda.MAX_HEAD_DIM`` take
  "xla" (the kernels multiply in 16 bits, see ``cuda.operand_dtype``; float32
  keeps jax.nn's numerics).
  """
  if platform == "cpu":
    return "cpu"
  if platform == "cuda":
    if (dtype is not None and jnp.dtype(dtype) == jnp.float32) or (
        head_dim is not None and head_dim > cuda.MAX_HEAD_DIM):
      return "xla"
    return cuda.default_implementation(cuda.compute_capability(), head_dim)
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
  if implementation in FUSED_PATHS and FUSED_PATHS[implementation] != platform:
    raise ValueError(
        f"implementation={implementation!r} runs on platform "
        f"{FUSED_PATHS[implementation]!r}, but the computation targets "
        f"{platform!r}; use implementation=None to pick a path per platform")
  if implementation in cuda.IMPLEMENTATIONS:
    cc = cuda.compute_capability()
    if not cuda.runs_on(implementation, cc):
      kernel = cuda.IMPLEMENTATIONS[implementation]
      needed = "exactly 9.0" if kernel == 90 else f"{kernel // 10}.{kernel % 10} or newer"
      raise ValueError(
          f"implementation={implementation!r} needs a GPU of compute capability "
          f"{needed}; this one is {cc // 10}.{cc % 10} (use implementation=None)")
    if head_dim is not None and head_dim > cuda.MAX_HEAD_DIM:
      raise ValueError(
          f"implementation={implementation!r} supports head dims up to "
          f"{cuda.MAX_HEAD_DIM}, got H={head_dim}; use implementation=None or 'xla'")
  return implementation


def log_path_once(implementation: str, platform: str) -> None:
  if (implementation, platform) not in _logged_paths:
    _logged_paths.add((implementation, platform))
    logger.info("fast_attention: using the %r path on %s", implementation, platform)


def rule_attrs(config: AttentionConfig) -> dict:
  """The FFI attributes every target takes: the logit transform and the index
  rules (csrc/ffi/attention_attrs.h: CallAttrs)."""
  left, right = config.window if config.window is not None else (-1, -1)
  return dict(scale=np.float32(config.scale), softcap=np.float32(config.softcap or 0.0),
              is_causal=np.int64(config.is_causal), end_aligned=np.int64(config.end_aligned),
              window_left=np.int64(left), window_right=np.int64(right))


def fused_call(implementation: str, config: AttentionConfig, q, k, v, bias=None, mask=None,
               q_lens=None, kv_lens=None):
  """Runs the fused kernel of ``implementation`` on 4-D operands; returns (out, lse).

  Absent optional operands are passed as empty arrays, which the handlers
  read as "none"; all options travel as one attribute dictionary that the
  handler decodes into a struct.
  """
  attrs = rule_attrs(config)
  if implementation in cuda.IMPLEMENTATIONS:
    return cuda.call(implementation, config, attrs, q, k, v, bias, mask, q_lens, kv_lens)
  if implementation in ascend.IMPLEMENTATIONS:
    return ascend.call(implementation, config, attrs, q, k, v, bias, mask, q_lens, kv_lens)
  B, T, N, _ = q.shape
  return jax.ffi.ffi_call(CPU_TARGET, (jax.ShapeDtypeStruct(q.shape, q.dtype),
                                       jax.ShapeDtypeStruct((B, T, N), jnp.float32)))(
      *_cpu_operands(q, k, v, bias, mask, q_lens, kv_lens), **attrs, variant=np.int64(0),
      fold_heads=np.int64(0))


def fused_backward(implementation: str, config: AttentionConfig, q_shape, k_shape, dtype,
                   bias: bool = False, mask: bool = False) -> bool:
  """Whether ``implementation`` has a fused backward for a call: always on the
  CPU; on the CUDA paths where the owner plans backward kernels for it
  (``cuda.plan(..., backward=True)``: every CUDA path up to H = 128, the sm80
  and sm90 paths up to 256). Elsewhere the
  gradients come from ``reference.attention_grads``."""
  if implementation == "cpu":
    return True
  if implementation not in cuda.IMPLEMENTATIONS:
    return False
  try:
    cuda.plan(implementation, config, q_shape, k_shape, dtype, bias, mask, backward=True)
  except ValueError:
    return False
  return True


def fused_backward_call(implementation: str, config: AttentionConfig, q, k, v, bias, mask,
                        q_lens, kv_lens, out, lse, d_out, d_lse):
  """Runs the fused backward of ``implementation`` (where ``fused_backward``):
  the gradients (dq, dk, dv) of the call ``fused_call`` ran, from its out (B, T,
  N, H) and lse (B, T, N) and their cotangents d_out and d_lse (float32)."""
  if implementation in cuda.IMPLEMENTATIONS:
    return cuda.call_backward(implementation, config, rule_attrs(config), q, k, v, bias, mask,
                              q_lens, kv_lens, out, lse, d_out, d_lse)
  return jax.ffi.ffi_call(CPU_BACKWARD_TARGET, tuple(
      jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)))(
          *_cpu_operands(q, k, v, bias, mask, q_lens, kv_lens), out, lse, d_out, d_lse,
          **rule_attrs(config), variant=np.int64(0), fold_heads=np.int64(0))


def _cpu_operands(q, k, v, bias, mask, q_lens, kv_lens):
  """The CPU targets' operands: q, k, v, then the optional ones (the bias in
  its own dtype)."""
  return (q, k, v, *shapes.optional_operands(bias, mask, q_lens, kv_lens, q.dtype))
