"""Argument checking and shape rules for attention, shared by every path.

Everything here works on anything with ``.shape`` and ``.dtype`` (concrete
arrays, tracers, ``jax.core.ShapedArray``), so the rules run at trace time and
are unit-tested on abstract values. Letters follow
``jax.nn.dot_product_attention``: B batch, T query length, S key/value length,
N query heads, K key/value heads, H head dim.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fastattn_jax import _ffi

#: Element types the fused kernels compute in (float32 accumulation).
KERNEL_DTYPES = (np.dtype(np.float32), np.dtype(jnp.float16), np.dtype(jnp.bfloat16))
#: Every kernel's code of each of them, by dtype name: the one numbering the
#: extension's plan functions take and return (csrc/kernels/attention_dtypes.h).
DTYPE_CODES = _ffi.dtype_codes()
#: Element types any path accepts; float64 is served by the reference math.
SUPPORTED_DTYPES = KERNEL_DTYPES + (np.dtype(np.float64),)
#: The smallest page of a paged KV cache (page sizes are powers of two from
#: it): the CUDA decode kernel reads tiles of 16 keys from at most two pages.
MIN_PAGE_SIZE = _ffi.min_page_size
#: Element types of a quantized KV cache, read with float32 scales beside it
#: (``check_kv_scales``).
KV_QUANT_DTYPES = (np.dtype(np.int8), np.dtype(jnp.float8_e4m3fn))


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """Static (hashable) options of one attention call.

  Attributes:
    scale: multiplies ``q . k``.
    is_causal: key j is visible to query i only if j <= i (top-left aligned,
      as in ``jax.nn.dot_product_attention``).
    window: ``(left, right)``: key j visible to query i only if
      ``i - left <= j <= i + right``; None for no window.
    softcap: ``c`` in ``c * tanh(logits / c)`` or None.
    end_aligned: causal and window rules place query row i at key position
      ``i + kv_len - q_len`` (bottom-right alignment: the last valid query
      sits at the last valid key, as when T new tokens attend over a cache
      that already holds them) instead of at position i.
    has_bias, has_mask, has_q_lens, has_kv_lens, has_segment_ids, has_sinks,
      has_alibi, has_block_table, has_kv_scales: which optional operands
      follow query, key and value, in that order (``split_operands``). Segment
      ids are two operands, (B, T) and (B, S) int32 (``check_features``); sinks
      and ALiBi slopes are (B|1, N) float32. With a block table (B, max_pages) int32, key and value are
      pools of pages (pages, page_size, K, H) and S = max_pages * page_size
      (``check_paged``). With KV scales (two operands, k_scale and v_scale),
      key and value are a quantized cache (``KV_QUANT_DTYPES``) and key =
      key * k_scale[..., None] (``check_kv_scales``).
    implementation: the path to run, e.g. "cpu"; "auto" picks per platform.
    deterministic: the backward sums in a fixed order (on kernel 90's CUDA
      path, "cuda_sm90": dQ in a pass of its own rather than by atomics).
    float32_out: the forward writes out in float32 whatever the inputs'
      dtype. The VJP's forward sets it for 16-bit inputs: its float32 out is
      the residual from which the backward's D = rowsum(dO o O) is reduced
      (from the 16-bit-rounded out, D's error times the scale would dominate
      dS once the logits are not small).
    for_backward: the forward is the VJP's, whose logits the backward
      recomputes bit for bit (a row's only key keeps P = 1 at any logit
      size): on the sm70 and sm75 paths it does not take the decode kernel,
      whose build for them sums q . k on CUDA cores, the backward on tensor
      cores.
  """

  scale: float
  is_causal: bool = False
  window: tuple[int, int] | None = None
  softcap: float | None = None
  end_aligned: bool = False
  has_bias: bool = False
  has_mask: bool = False
  has_q_lens: bool = False
  has_kv_lens: bool = False
  has_segment_ids: bool = False
  has_sinks: bool = False
  has_alibi: bool = False
  has_block_table: bool = False
  has_kv_scales: bool = False
  implementation: str = "auto"
  deterministic: bool = False
  float32_out: bool = False
  for_backward: bool = False

  @property
  def window_bounds(self) -> tuple[int, int]:
    """``window`` as the kernels take it: (left, right), -1 for no bound."""
    return self.window if self.window is not None else (-1, -1)

  @property
  def has_features(self) -> bool:
    """Whether segment ids, sinks or ALiBi slopes are among the operands."""
    return self.has_segment_ids or self.has_sinks or self.has_alibi

  def split_operands(self, operands):
    """Splits ``(q, k, v, *present optionals)`` into an 11-tuple with Nones:
    q, k, v, bias, mask, q_lens, kv_lens, features (a ``Features``, or None
    when none is present), block_table, k_scale, v_scale."""
    q, k, v, *rest = operands
    rest = iter(rest)
    take = lambda present: next(rest) if present else None
    head = (q, k, v, take(self.has_bias), take(self.has_mask), take(self.has_q_lens),
            take(self.has_kv_lens))
    features = Features(take(self.has_segment_ids), take(self.has_segment_ids),
                        take(self.has_sinks), take(self.has_alibi))
    return (*head, features if self.has_features else None, take(self.has_block_table),
            take(self.has_kv_scales), take(self.has_kv_scales))


class Features(NamedTuple):
  """The operands of the training features, each None where absent.

  Attributes:
    q_segment_ids: (B, T) int32: query row i of batch b belongs to segment
      ``q_segment_ids[b, i]`` and sees key j only if ``kv_segment_ids[b, j]``
      is equal (packed sequences; any ids, in any order).
    kv_segment_ids: (B, S) int32, present with ``q_segment_ids``.
    sinks: (B|1, N) float32: a logit per query head (and batch) that joins
      every row's softmax denominator and has no value row.
    alibi_slopes: (B|1, N) float32: the logit of (i, j) gets ``-slope *
      |pos(i) - j|`` (ALiBi; pos(i) the row's key position of the causal
      rule).
  """

  q_segment_ids: Any = None
  kv_segment_ids: Any = None
  sinks: Any = None
  alibi_slopes: Any = None

  def operands(self) -> list:
    """The present ones, in the primitive's order."""
    return [x for x in self if x is not None]


@dataclasses.dataclass(frozen=True)
class Dims:
  B: int
  T: int
  S: int
  N: int
  K: int
  H: int


def _shape(x) -> tuple:
  """``x.shape`` as a tuple: ints, or ``jax.export`` symbolic dims, which the
  checks here compare but never convert."""
  return tuple(x.shape)


def check_qkv(query, key, value, *, quantized: bool = False) -> Dims:
  """Checks 4-D query (B,T,N,H), key and value (B,S,K,H); returns the dims.

  With ``quantized``, key and value are a quantized cache: both of one of
  ``KV_QUANT_DTYPES``, query of a floating dtype.

  Raises:
    ValueError: on wrong ranks, mismatched shapes, N not a multiple of K.
    TypeError: on dtypes that differ or are not floating point.
  """
  for name, x in (("query", query), ("key", key), ("value", value)):
    if x.ndim != 4:
      raise ValueError(
          f"{name} must have shape (B, T|S, N|K, H) or (T|S, N|K, H), got "
          f"shape {_shape(x)}")
  B, T, N, H = _shape(query)
  Bk, S, K, Hk = _shape(key)
  if _shape(value) != _shape(key):
    raise ValueError(
        f"value must have the shape of key (B, S, K, H) = {_shape(key)}, got "
        f"{_shape(value)}")
  if Bk != B or Hk != H:
    raise ValueError(
        f"query (B, T, N, H) = {_shape(query)} and key (B, S, K, H) = "
        f"{_shape(key)} must agree in B and H")
  if K == 0 or N % K != 0:
    raise ValueError(
        f"the number of query heads N must be a multiple of the key/value "
        f"heads K, got N={N} (query {_shape(query)}) and K={K} (key "
        f"{_shape(key)})")
  if quantized:
    if np.dtype(key.dtype) != np.dtype(value.dtype) or np.dtype(key.dtype) not in \
        KV_QUANT_DTYPES:
      raise TypeError(
          f"a quantized cache's keys and values must both be int8 or float8_e4m3fn, got "
          f"{key.dtype} and {value.dtype}")
    if np.dtype(query.dtype) not in SUPPORTED_DTYPES:
      raise TypeError(
          f"query must be float32, float16, bfloat16 or float64, got {query.dtype}")
    return Dims(B, T, S, N, K, H)
  dtypes = {np.dtype(x.dtype) for x in (query, key, value)}
  if len(dtypes) != 1:
    raise TypeError(
        f"query, key and value must have one dtype, got {query.dtype}, "
        f"{key.dtype}, {value.dtype}")
  if np.dtype(query.dtype) not in SUPPORTED_DTYPES:
    raise TypeError(
        f"query, key and value must be float32, float16, bfloat16 or float64, "
        f"got {query.dtype}")
  return Dims(B, T, S, N, K, H)


def check_paged(query, k_pages, v_pages, block_table, *, quantized: bool = False) -> Dims:
  """Checks a query (B,T,N,H) over a paged KV cache; returns the dims, S =
  max_pages * page_size.

  Args:
    query: (B, T, N, H).
    k_pages, v_pages: (pages, page_size, K, H) of query's dtype, page_size a
      power of two >= ``MIN_PAGE_SIZE``.
    block_table: (B, max_pages) int32.

  Raises:
    ValueError: on wrong ranks or shapes, naming them. TypeError: on
      dtypes, as ``check_qkv``, or a block table that is not int32.
  """
  if block_table.ndim != 2 or _shape(block_table)[0] != _shape(query)[0]:
    raise ValueError(
        f"block_table must have shape (B, max_pages) with B = {_shape(query)[0]} (query "
        f"{_shape(query)}), got {_shape(block_table)}")
  if np.dtype(block_table.dtype) != np.dtype(np.int32):
    raise TypeError(f"block_table must be int32, got {block_table.dtype}")
  for name, x in (("k_pages", k_pages), ("v_pages", v_pages)):
    if x.ndim != 4:
      raise ValueError(f"{name} must have shape (pages, page_size, K, H), got {_shape(x)}")
  page_size = _shape(k_pages)[1]
  if not isinstance(page_size, (int, np.integer)) or page_size < MIN_PAGE_SIZE or \
      page_size & (page_size - 1):
    raise ValueError(
        f"page_size (k_pages {_shape(k_pages)}, dim 1) must be a power of two >= "
        f"{MIN_PAGE_SIZE}, got {page_size}")
  B, max_pages = _shape(block_table)
  # The pages seen as one (B, S, K, H) cache, for the checks shared with it.
  view = lambda x: jax.ShapeDtypeStruct((B, max_pages * page_size, *_shape(x)[2:]), x.dtype)
  try:
    return check_qkv(query, view(k_pages), view(v_pages), quantized=quantized)
  except ValueError as err:
    raise ValueError(
        f"query {_shape(query)}, k_pages {_shape(k_pages)} and v_pages {_shape(v_pages)} do "
        f"not fit (B, T, N, H) x (pages, page_size, K, H) (both pools one shape, N a multiple "
        f"of K): {err}") from None


def check_kv_scales(key, k_scale, v_scale) -> None:
  """Checks the scales of a quantized KV cache (or pool of pages) ``key``.

  The dequantized key is ``key.astype(float32) * k_scale[..., None]`` (value
  likewise): ``k_scale`` and ``v_scale`` are float32 and broadcast to
  ``key.shape[:3]``, (B, S, K) or (pages, page_size, K): per position and
  head (int8), per head (1, 1, K) (float8), or any dims of 1 between.

  Raises:
    ValueError: a scale of another rank or a dim neither 1 nor the cache's.
    TypeError: a scale that is not float32.
  """
  full = _shape(key)[:3]
  for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
    if x.ndim != 3 or any(d != 1 and d != f for d, f in zip(_shape(x), full)):
      raise ValueError(
          f"{name} of shape {_shape(x)} does not broadcast to the cache's (B, S, K) (pages: "
          f"(pages, page_size, K)) = {full}: 3-D, each dim 1 or the cache's")
    if np.dtype(x.dtype) != np.dtype(np.float32):
      raise TypeError(f"{name} must be float32, got {x.dtype}")


def check_broadcast_operand(name: str, x, dims: Dims) -> None:
  """Checks a 4-D bias or mask broadcastable to (B, N, T, S).

  Raises:
    ValueError: on a rank other than 4 or a dim that is neither 1 nor full.
    TypeError: on a mask that is not bool, a bias that is not floating point.
  """
  full = (dims.B, dims.N, dims.T, dims.S)
  if x.ndim != 4 or any(d not in (1, f) for d, f in zip(_shape(x), full)):
    raise ValueError(
        f"{name} of shape {_shape(x)} is not broadcastable to (B, N, T, S) = "
        f"{full}: each dim must be 1 or the full size")
  if name == "mask" and np.dtype(x.dtype) != np.dtype(bool):
    raise TypeError(f"mask must be bool (True = attend), got {x.dtype}")
  if name == "bias" and np.dtype(x.dtype) not in SUPPORTED_DTYPES:
    raise TypeError(
        f"bias must be float32, float16, bfloat16 or float64, got {x.dtype}")


def check_seq_lengths(name: str, x, B: int) -> None:
  """Checks a (B,) int32 array of sequence lengths.

  Raises:
    ValueError: on a shape other than (B,). TypeError: on a non-int32 dtype.
  """
  if _shape(x) != (B,):
    raise ValueError(f"{name} must have shape (B,) = ({B},), got {_shape(x)}")
  if np.dtype(x.dtype) != np.dtype(np.int32):
    raise TypeError(f"{name} must be int32, got {x.dtype}")


def check_operands(config: AttentionConfig, operands) -> Dims:
  """Checks all operands of the primitive against ``config``; returns dims."""
  n_expected = 3 + sum((config.has_bias, config.has_mask, config.has_q_lens,
                        config.has_kv_lens, config.has_sinks, config.has_alibi,
                        config.has_block_table)) + 2 * (config.has_kv_scales +
                                                        config.has_segment_ids)
  if len(operands) != n_expected:
    raise ValueError(f"expected {n_expected} operands, got {len(operands)}")
  q, k, v, bias, mask, q_lens, kv_lens, features, block_table, k_scale, v_scale = \
      config.split_operands(operands)
  quantized = k_scale is not None
  dims = (check_qkv(q, k, v, quantized=quantized) if block_table is None else
          check_paged(q, k, v, block_table, quantized=quantized))
  if quantized:
    check_kv_scales(k, k_scale, v_scale)
  if bias is not None:
    check_broadcast_operand("bias", bias, dims)
  if mask is not None:
    check_broadcast_operand("mask", mask, dims)
  if q_lens is not None:
    check_seq_lengths("query_seq_lengths", q_lens, dims.B)
  if kv_lens is not None:
    check_seq_lengths("key_value_seq_lengths", kv_lens, dims.B)
  if features is not None:
    check_features(features, dims)
  return dims


def check_features(features: Features, dims: Dims) -> None:
  """Checks the operands of the training features as the primitive takes
  them: segment ids (B, T) and (B, S) int32; sinks and ALiBi slopes (B|1, N)
  float32.

  Raises:
    ValueError: on a shape that does not fit, naming it. TypeError: on a
      dtype that does not.
  """
  wanted = {"q_segment_ids": ((dims.B, dims.T), np.int32),
            "kv_segment_ids": ((dims.B, dims.S), np.int32),
            "sinks": ((dims.B, dims.N), np.float32),
            "alibi_slopes": ((dims.B, dims.N), np.float32)}
  for name, x in features._asdict().items():
    if x is None:
      continue
    shape, dtype = wanted[name]
    if x.ndim != 2 or _shape(x)[1] != shape[1] or _shape(x)[0] not in (1, shape[0]):
      broadcast = "" if name.endswith("segment_ids") else " (B may be 1)"
      raise ValueError(f"{name} must have shape {shape}{broadcast}, got {_shape(x)}")
    if np.dtype(x.dtype) != np.dtype(dtype):
      raise TypeError(f"{name} must be {np.dtype(dtype).name}, got {x.dtype}")
    if name.endswith("segment_ids") and _shape(x)[0] != shape[0]:
      raise ValueError(f"{name} must have shape {shape}, got {_shape(x)}")


def normalize_window(local_window_size: Any) -> tuple[int, int] | None:
  """``int w`` -> ``(w, w)``; ``(left, right)`` kept; both must be >= 0.

  Raises:
    TypeError: if not None, an int or a pair of ints (static Python values).
    ValueError: on a negative size.
  """
  if local_window_size is None:
    return None
  if isinstance(local_window_size, (int, np.integer)) and not isinstance(
      local_window_size, bool):
    window = (int(local_window_size),) * 2
  elif (isinstance(local_window_size, (tuple, list))
        and len(local_window_size) == 2
        and all(isinstance(w, (int, np.integer)) and not isinstance(w, bool)
                for w in local_window_size)):
    window = tuple(int(w) for w in local_window_size)
  else:
    raise TypeError(
        f"local_window_size must be None, an int or a (left, right) pair of "
        f"static ints, got {local_window_size!r}")
  if min(window) < 0:
    raise ValueError(f"local_window_size must be >= 0, got {local_window_size!r}")
  return window


def default_scale(H: int) -> float:
  """``1 / sqrt(H)``, the scale of ``Q K^T`` when none is given; 1 for H = 0,
  where every logit is 0 whatever the scale (1 / sqrt(0) would make it NaN)."""
  return 1.0 / math.sqrt(H) if H > 0 else 1.0


#: The largest soft cap: the kernels compute ``c * tanh(x / c)`` in float32,
#: where ``x / c`` below float32's smallest normal (1.2e-38) flushes to 0. Up
#: to this cap only logits below 2**-26 do, which exp in float32 cannot tell
#: from 0 (exp(x) rounds to 1 for |x| < 2**-25).
MAX_SOFTCAP = 2.0**100


def static_float(name: str, x: Any, *, positive: bool = False,
                 max_value: float = float(np.finfo(np.float32).max)) -> float:
  """Returns ``x`` as a Python float; it must be a static number that float32,
  in which every kernel applies it, represents: finite, and zero or of
  magnitude between float32's smallest normal and ``max_value``.

  Raises:
    TypeError: for traced or non-numeric values. ValueError: for values
    outside that range (they would become inf or 0 in the kernels), or
    values <= 0 when ``positive``.
  """
  try:
    value = float(x)
  except Exception as err:  # tracers raise ConcretizationTypeError here
    raise TypeError(
        f"{name} must be a static Python number, got {type(x).__name__}") from err
  if not math.isfinite(value) or (positive and value <= 0):
    raise ValueError(
        f"{name} must be a finite{' positive' if positive else ''} number, got {x!r}")
  smallest = float(np.finfo(np.float32).smallest_normal)
  if value != 0 and not smallest <= abs(value) <= max_value:
    raise ValueError(
        f"{name}={x!r} is outside the range the kernels apply it in, float32 ("
        f"{smallest:.3g} to {max_value:.3g} in magnitude)")
  return value


def static_bool(name: str, x: Any) -> bool:
  """Returns ``x`` as a Python bool; it must be static (a Python or NumPy bool).

  Raises:
    TypeError: for traced values or other types (pass it through
      ``static_argnames`` under ``jax.jit``).
  """
  if not isinstance(x, (bool, np.bool_)):
    raise TypeError(
        f"{name} must be a static Python bool, got {type(x).__name__} (under jax.jit, "
        f"pass it through static_argnames)")
  return bool(x)
