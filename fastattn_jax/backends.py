"""Native kernels: loading the extension, FFI registration, choosing a path.

The extension ``fastattn_jax._ffi`` only hands out XLA FFI handler capsules;
this module registers them with ``jax.ffi.register_ffi_target`` and builds
the ``jax.ffi.ffi_call`` that runs a fused kernel.
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
from fastattn_jax.shapes import AttentionConfig

logger = logging.getLogger("fastattn_jax")

#: Fused paths built into this package: implementation name -> (JAX platform,
#: FFI target name).
FUSED_PATHS = {
    "cpu": ("cpu", "fastattn_attention_fwd_cpu"),
}
#: Paths that need no kernel of ours.
OTHER_PATHS = ("xla", "cudnn")

for _name, _capsule in _ffi.registrations().items():
  jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")

_logged_paths: set[str] = set()


def implementations() -> tuple[str, ...]:
  """All implementation names ``fast_attention`` accepts, on any platform."""
  return (*FUSED_PATHS, *OTHER_PATHS)


def check_name(implementation: str) -> None:
  """Raises ValueError unless ``implementation`` names a path."""
  if implementation not in implementations():
    raise ValueError(
        f"implementation must be None or one of {implementations()}, got "
        f"{implementation!r}")


def default_path(platform: str) -> str:
  """The path ``implementation=None`` takes on a JAX platform ("cpu", "cuda")."""
  for name, (path_platform, _) in FUSED_PATHS.items():
    if path_platform == platform:
      return name
  return "xla"


def resolve_implementation(implementation: str | None = None,
                           backend: str | None = None) -> str:
  """Names the path that serves ``fast_attention(..., implementation=...)``.

  Args:
    implementation: as passed to ``fast_attention`` (None: best available).
    backend: a JAX platform name ("cpu", "cuda", ...); default: the default
      backend, ``jax.default_backend()``.

  Returns:
    The path name, e.g. "cpu" or "xla" (float64 inputs always take "xla").

  Raises:
    ValueError: for an unknown name, or a fused path whose platform is not
      ``backend``.
  """
  platform = backend or jax.default_backend()
  if implementation is None:
    return default_path(platform)
  check_name(implementation)
  if implementation in FUSED_PATHS and FUSED_PATHS[implementation][0] != platform:
    raise ValueError(
        f"implementation={implementation!r} runs on platform "
        f"{FUSED_PATHS[implementation][0]!r}, but the computation targets "
        f"{platform!r}; use implementation=None to pick a path per platform")
  return implementation


def log_path_once(path: str, platform: str) -> None:
  if path not in _logged_paths:
    _logged_paths.add(path)
    logger.info("fast_attention: using the %r path on %s", path, platform)


def fused_call(path: str, config: AttentionConfig, q, k, v, bias=None,
               mask=None, q_lens=None, kv_lens=None):
  """Runs the fused kernel of ``path`` on 4-D operands; returns (out, lse).

  Absent optional operands are passed as empty arrays, which the handler reads
  as "none"; all options travel as one attribute dictionary that the handler
  decodes into a struct.
  """
  B, T, N, _ = q.shape
  empty = lambda dtype: jnp.zeros((0,), dtype)
  result_types = (jax.ShapeDtypeStruct(q.shape, q.dtype),
                  jax.ShapeDtypeStruct((B, T, N), jnp.float32))
  left, right = config.window if config.window is not None else (-1, -1)
  call = jax.ffi.ffi_call(FUSED_PATHS[path][1], result_types)
  return call(
      q, k, v,
      empty(q.dtype) if bias is None else bias,
      empty(jnp.bool_) if mask is None else mask,
      empty(jnp.int32) if q_lens is None else q_lens,
      empty(jnp.int32) if kv_lens is None else kv_lens,
      scale=np.float32(config.scale),
      softcap=np.float32(config.softcap or 0.0),
      is_causal=np.int64(config.is_causal),
      window_left=np.int64(left),
      window_right=np.int64(right),
  )
