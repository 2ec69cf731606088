"""Native kernels: loading the extension, FFI registration, choosing a path, the calls.

The extension ``fastattn_jax._ffi`` hands out XLA FFI handler capsules; this
module registers them with ``jax.ffi.register_ffi_target``, picks the paths
that serve a call and its gradient (``choose_forward``, ``choose_backward``)
and runs a fused kernel: the CPU's here, the CUDA and Ascend kernels' in
``fastattn_jax.cuda`` and ``fastattn_jax.ascend``, each through
``custom_calls.kernel_call``.
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
from fastattn_jax import _util, ascend, cuda
from fastattn_jax.custom_calls import kernel_call
from fastattn_jax.reference import plain_kv
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

_logged_paths: set[tuple[str, str, str]] = set()


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


def default_path(platform: str, dtype=None, head_dim: int | None = None) -> tuple[str, str]:
  """The path ``implementation=None`` takes on a JAX platform ("cpu", "cuda"), and why.

  On CUDA GPUs: the kernel of the compute capability (``cuda.default_implementation``),
  except that float32 inputs and head dims above ``cuda.MAX_HEAD_DIM`` take
  "xla" (the kernels multiply in 16 bits, see ``cuda.operand_dtype``; float32
  keeps jax.nn's numerics).

  Returns:
    ``(path, reason)``: the path name and a phrase saying why it serves.
  """
  if platform == "cpu":
    return "cpu", "the fused CPU kernel serves every call on CPUs"
  if platform == "cuda":
    if dtype is not None and jnp.dtype(dtype) == jnp.float32:
      return "xla", ("float32 inputs take XLA on GPUs: the CUDA kernels multiply in 16 bits "
                     "(a forced cuda_sm* path rounds float32 to float16)")
    if head_dim is not None and not 1 <= head_dim <= cuda.MAX_HEAD_DIM:
      return "xla", (f"head dim H={head_dim} is outside 1 to {cuda.MAX_HEAD_DIM}, the head "
                     f"dims the CUDA kernels take")
    cc = _local_compute_capability()
    path = cuda.default_implementation(cc, head_dim)
    return path, f"the kernel for compute capability {cc // 10}.{cc % 10}" + (
        "" if head_dim is None else f" at head dim H={head_dim}")
  return "xla", f"no fused kernel runs on platform {platform!r}"


def platform_of(backend: str | None = None) -> str:
  """The JAX platform name of ``backend`` (default: ``jax.default_backend()``),
  with "gpu" told apart into "cuda" and "rocm"."""
  platform = backend or jax.default_backend()
  if platform == "gpu":  # jax.default_backend()'s name for CUDA and ROCm alike
    version = jax.devices("gpu")[0].client.platform_version.lower()
    platform = "rocm" if "rocm" in version else "cuda"
  return platform


def resolve_implementation(implementation: str | None = None,
                           backend: str | None = None, dtype=None,
                           head_dim: int | None = None) -> str:
  """Names the path that serves ``fast_attention(..., implementation=...)``.

  ``fastattn_jax.explain`` says the same of a whole call, with its reasons,
  and names the path of the call's gradient too.

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
  return choose_forward(implementation, platform_of(backend), dtype, head_dim)[0]


def choose_forward(implementation: str | None, platform: str, dtype=None,
                   head_dim: int | None = None) -> tuple[str, str]:
  """``(path, reason)`` of the forward on ``platform``; see ``resolve_implementation``."""
  if implementation is None:
    return default_path(platform, dtype, head_dim)
  check_name(implementation)
  if implementation in FUSED_PATHS and FUSED_PATHS[implementation] != platform:
    raise ValueError(
        f"implementation={implementation!r} runs on platform "
        f"{FUSED_PATHS[implementation]!r}, but the computation targets "
        f"{platform!r}; use implementation=None to pick a path per platform")
  if implementation in cuda.IMPLEMENTATIONS:
    cc = _local_compute_capability()
    if not cuda.runs_on(implementation, cc):
      kernel = cuda.IMPLEMENTATIONS[implementation]
      needed = "exactly 9.0" if kernel == 90 else f"{kernel // 10}.{kernel % 10} or newer"
      raise ValueError(
          f"implementation={implementation!r} needs a GPU of compute capability "
          f"{needed}; this one is {cc // 10}.{cc % 10} (use implementation=None)")
    if head_dim is not None and not 1 <= head_dim <= cuda.MAX_HEAD_DIM:
      raise ValueError(
          f"implementation={implementation!r} supports head dims 1 to "
          f"{cuda.MAX_HEAD_DIM}, got H={head_dim}; use implementation=None or 'xla'")
  return implementation, "requested by implementation="


def _local_compute_capability() -> int:
  """The compute capability of this process's first CUDA GPU, which the
  CUDA paths are planned for (kernel, tile, split-KV launch).

  Raises:
    ValueError: no CUDA GPU here (e.g. ``jax.export`` for "cuda" on a machine
      without one), saying what to do instead.
  """
  try:
    return cuda.compute_capability()
  except RuntimeError as err:
    raise ValueError(
        "fast_attention on platform 'cuda' needs a CUDA GPU in this process: the CUDA "
        "kernels are chosen and planned for the GPU at hand (compute capability, "
        "multiprocessor count), and this process has none. To jax.export for GPUs, export "
        "on a machine with the target GPU, or pass implementation='xla' or 'cudnn'") from err


def export_disabled_checks() -> list:
  """The ``disabled_checks`` for ``jax.export.export`` of a function that
  calls ``fast_attention`` or ``decode_attention``::

    exported = jax.export.export(
        jax.jit(model), disabled_checks=fastattn_jax.export_disabled_checks())(*args)

  JAX refuses by default to serialize custom calls it does not know to be
  stable; these are this package's FFI targets, one
  ``jax.export.DisabledSafetyCheck.custom_call`` each. The exported
  artifact calls them by name: the process that deserializes and runs it
  must ``import fastattn_jax`` (which registers them), of the same version,
  since their attributes carry no compatibility guarantee across versions.
  A CUDA artifact is planned for the exporting machine's GPU.

  Returns:
    A list of ``jax.export.DisabledSafetyCheck``.
  """
  return [jax.export.DisabledSafetyCheck.custom_call(name)
          for targets in _ffi.registrations().values() for name in targets]


#: The gradient of a fused path that has no backward kernel for a call:
#: ``reference.attention_grads``, jax.numpy over blocks of query rows.
BLOCKWISE = "blockwise"


def choose_backward(implementation: str, config: AttentionConfig, q_shape, k_shape,
                    dtype) -> tuple[str, str]:
  """``(path, reason)`` of the gradient of a call that the forward path
  ``implementation`` serves: the path itself where it has a fused backward
  for the call (always on the CPU; on the CUDA paths where the owner plans
  backward kernels for it, ``cuda.plan(..., backward=True)``: every CUDA path
  up to H = 128, the sm80 and sm90 paths up to 256), else ``BLOCKWISE``
  ("xla" included: the primitive reaches it only when chosen at lowering)."""
  if implementation == "cpu":
    return "cpu", "the fused CPU backward (FlashAttention-2, Algorithm 2)"
  if implementation in cuda.IMPLEMENTATIONS:
    try:
      cuda.plan(implementation, config, q_shape, k_shape, dtype, config.has_bias,
                config.has_mask, backward=True)
    except ValueError as err:
      return BLOCKWISE, (f"the reference math over blocks of query rows: {implementation} has "
                         f"no backward kernel for this call ({err})")
    return implementation, "the path's backward kernels (FlashAttention-2, Algorithm 2)"
  return BLOCKWISE, (f"the reference math over blocks of query rows: {implementation} has no "
                     f"backward kernel")


def log_path_once(direction: str, implementation: str, platform: str, reason: str, *,
                  warn: bool = False) -> None:
  """Logs, once per process, the path that serves a direction ("forward" or
  "backward") on a platform, with the reason: at INFO, or at WARNING with
  ``warn`` (a fused forward whose gradient falls back to the blockwise
  reference math: slower than a kernel, more memory)."""
  if (direction, implementation, platform) not in _logged_paths:
    _logged_paths.add((direction, implementation, platform))
    level = logging.WARNING if warn else logging.INFO
    logger.log(level, "fast_attention %s on %s: the %r path, %s", direction, platform,
               implementation, reason)


def fused_call(implementation: str, config: AttentionConfig, q, k, v, bias=None, mask=None,
               q_lens=None, kv_lens=None, features=None, block_table=None, k_scale=None,
               v_scale=None):
  """Runs the fused kernel of ``implementation`` on 4-D operands; returns (out,
  lse): out in q's dtype, or float32 where ``config.float32_out``. ``features``
  (a ``shapes.Features`` or None): segment ids, sinks, ALiBi slopes.

  With ``block_table``, k and v are pools of pages (``shapes.check_paged``):
  the CUDA decode kernel's paged build and the CPU kernel's decode path read
  them in place; other kernels get them gathered into one (B, S, K, H) cache
  first (``reference.gather_pages``). With ``k_scale`` and ``v_scale``, k and
  v are a quantized cache (``shapes.check_kv_scales``): the CUDA decode
  kernel's quantized builds and the CPU kernel's decode path read it in
  place; other kernels get it dequantized to q's dtype first
  (``reference.dequantize``).
  """
  if implementation in cuda.IMPLEMENTATIONS:
    return cuda.call(implementation, config, q, k, v, bias, mask, q_lens, kv_lens, block_table,
                     k_scale, v_scale, features=features)
  B, T, N, H = q.shape
  # The CPU kernel's decode path reads pages and quantized caches in place (attention_cpu.h:
  # cpu_reads_in_place); every other kernel gets them gathered and dequantized.
  if block_table is not None or k_scale is not None:
    S = k.shape[1] if block_table is None else block_table.shape[1] * k.shape[1]
    if not (implementation == "cpu" and _ffi.cpu_plan(B, T, S, N, k.shape[2], H, 1)["decode"]):
      k, v = plain_kv(k, v, block_table, k_scale, v_scale, q.dtype)
      block_table = k_scale = v_scale = None
  if implementation in ascend.IMPLEMENTATIONS:
    out, lse = ascend.call(implementation, config, q, k, v, bias, mask, q_lens, kv_lens,
                           features=features)
    return (out.astype(jnp.float32) if config.float32_out else out), lse
  out_dtype = jnp.float32 if config.float32_out else q.dtype
  absent = lambda dtype, x: jnp.zeros((0,), dtype) if x is None else x
  # The CPU target's own operands: the block table, then k_scale and v_scale (each empty where
  # absent).
  return kernel_call(CPU_TARGET, (jax.ShapeDtypeStruct(q.shape, out_dtype),
                                  jax.ShapeDtypeStruct((B, T, N), jnp.float32)),
                     config, q, k, v, bias, mask, q_lens, kv_lens,
                     absent(jnp.int32, block_table), absent(jnp.float32, k_scale),
                     absent(jnp.float32, v_scale), features=features, variant=np.int64(0),
                     fold_heads=np.int64(0))


def _rounded(x, dtype):
  """float32 ``x`` rounded to the values of ``dtype`` (float16 or bfloat16),
  kept in float32. Not ``x.astype(dtype).astype(float32)``: XLA's
  excess-precision simplification removes that round trip on GPUs. And
  reduce_precision flushes float16's subnormals to 0, so those are rounded
  on their grid (multiples of 2^-24, to nearest even) instead."""
  info = jnp.finfo(dtype)
  rounded = jax.lax.reduce_precision(x, info.nexp, info.nmant)
  if info.nexp < 8:  # float16: subnormals below float32's
    step = float(info.smallest_subnormal)
    rounded = jnp.where(jnp.abs(x) < float(info.smallest_normal), jnp.round(x / step) * step,
                        rounded)
  return rounded


def fused_backward_call(implementation: str, config: AttentionConfig, q, k, v, bias, mask,
                        q_lens, kv_lens, features, out, lse, d_out, d_lse):
  """Runs the fused backward of ``implementation`` (where ``choose_backward``
  names it): the gradients (dq, dk, dv) of the call ``fused_call`` ran, from
  its out (B, T, N, H; float32 where the forward kept it so) and lse (B, T, N)
  and their cotangents d_out and d_lse (float32).

  FlashAttention-2's D = rowsum(dO o O) - dLSE (Dao 2023, Algorithm 2, line
  4) is reduced here, by XLA, in float32, for every kernel. With sinks, lse
  holds them (the forward's), so P and dS need nothing more; their own
  gradient is ``fastattn_jax.attention``'s.
  """
  on_cuda = implementation in cuda.IMPLEMENTATIONS
  if on_cuda:
    # D from the dO the kernels multiply (rounded to their operand dtype, as
    # cuda.call_backward sends it): from another dO, D - dP would not cancel
    # where it must (a row's only key: dS = 0).
    d_out = _rounded(d_out.astype(jnp.float32), cuda.operand_dtype(implementation, q.dtype))
    # dQ = dS K and dK = dS^T Q run over pairs whose dS is 0 (hidden, or a
    # padding row): a non-finite key or query element there would give 0 *
    # NaN. The kernels get them as 0; the rows that do see such a key or
    # query still get NaN, through their forward's NaN LSE, out and D.
    # (The CPU kernel guards those products itself.)
    q, k = (jnp.where(jnp.isfinite(x), x, 0) for x in (q, k))
  products = d_out.astype(jnp.float32) * out.astype(jnp.float32)
  delta = jnp.sum(products, axis=-1) - d_lse
  if on_cuda:
    # sum_h |dO_h O_h|: where a row's P = 1 at key j, O = V_j and this is the
    # magnitude attention_rules.h's one-hot rounding measures dP - D against
    # (the CPU kernel sums |dO_h V_jh| itself).
    magnitude = jnp.sum(jnp.abs(products), axis=-1)
    return cuda.call_backward(implementation, config, q, k, v, bias, mask, q_lens, kv_lens,
                              d_out, lse, delta, magnitude, features=features)
  return kernel_call(CPU_BACKWARD_TARGET, tuple(jax.ShapeDtypeStruct(x.shape, x.dtype)
                                                for x in (q, k, v)),
                     config, q, k, v, bias, mask, q_lens, kv_lens, d_out, lse, delta,
                     features=features, variant=np.int64(0), fold_heads=np.int64(0))
