"""Decoding over KV caches: ``KVCache``, ``write`` and ``decode_attention``.

After prefill, each step appends the keys and values of T new tokens (T = 1
for plain decoding, a few for speculative or chunked decoding) to every
layer's cache and lets the T new queries attend over the whole cache. That is
memory-bound work over a long S with few query rows, so the fused paths split
each sequence's keys across thread blocks (CPU threads) and merge the partial
softmaxes by their log-sum-exp (split-KV, "flash-decoding"; the CUDA kernels'
partition is planned by ``csrc/cuda/variants.cc: PlanLaunch``, the CPU's by
its kernel).

Layout: per layer, k and v of (B, S_max, K, H); one ``lengths`` (B,) int32
for all layers, the number of positions of each sequence already written.
A quantized cache (int8 or float8_e4m3fn, ``quantize``) keeps float32 scales
beside each layer's k and v.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from fastattn_jax import shapes
from fastattn_jax._util import host_cpu_device, sharding_of
from fastattn_jax.attention import requested_implementation, run_config, seq_lengths
from fastattn_jax.shapes import AttentionConfig


def _check_cache(name, cache_k, cache_v):
  if cache_k.ndim != 4 or cache_k.shape != cache_v.shape or cache_k.dtype != cache_v.dtype:
    raise ValueError(
        f"{name}: key and value caches must both be (B, S_max, K, H) of one dtype, got "
        f"{cache_k.shape} {cache_k.dtype} and {cache_v.shape} {cache_v.dtype}")


def is_quantized(dtype) -> bool:
  """Whether ``dtype`` is that of a quantized KV cache (int8 or float8_e4m3fn)."""
  return np.dtype(dtype) in shapes.KV_QUANT_DTYPES


#: The largest finite float8_e4m3fn: ``quantize`` saturates to it.
FLOAT8_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)


def quantize(x, dtype, scale=None):
  """Quantizes keys or values for a quantized KV cache.

  int8: symmetric, one scale per position and head, ``max |x| / 127`` over H
  (absmax quantization, vector-wise as in Dettmers et al., "LLM.int8()",
  2022); values ``round(x / scale)``. float8_e4m3fn (Micikevicius et al.,
  "FP8 Formats for Deep Learning", 2022): one scale per head, given (a
  calibration's; vLLM's default is 1); values ``x / scale`` rounded to
  nearest and saturated to +-448. Either way ``values * scale[..., None]``
  restores x: to within ``scale / 2`` (int8) or 2**-4 relative plus
  e4m3's subnormal step ``2**-10 * scale`` (float8).

  Args:
    x: (..., K, H), floating.
    dtype: ``jnp.int8`` or ``jnp.float8_e4m3fn``.
    scale: float8 only (required): float32 broadcastable to ``x.shape[:-1]``,
      e.g. (1, 1, K) for (B, T, K, H) keys.

  Returns:
    ``(values, scale)``: values of x's shape in ``dtype``; scale float32, of
    ``x.shape[:-1]`` (int8) or as given (float8).

  Raises:
    TypeError: ``dtype`` not int8 or float8_e4m3fn.
    ValueError: a float8 scale missing, or one given for int8.
  """
  dtype = np.dtype(dtype)
  if not is_quantized(dtype):
    raise TypeError(f"quantize: dtype must be int8 or float8_e4m3fn, got {dtype}")
  x = x.astype(jnp.float32)
  if dtype == np.dtype(np.int8):
    if scale is not None:
      raise ValueError("quantize: int8 scales are computed (per position and head), not given")
    scale = jnp.max(jnp.abs(x), axis=-1) / 127.0
    safe = jnp.where(scale > 0, scale, 1.0)[..., None]
    return jnp.clip(jnp.round(x / safe), -127, 127).astype(jnp.int8), scale
  if scale is None:
    raise ValueError("quantize: a float8_e4m3fn cache needs its per-head scale")
  scale = jnp.asarray(scale, jnp.float32)
  return jnp.clip(x / scale[..., None], -FLOAT8_MAX, FLOAT8_MAX).astype(dtype), scale


def kv_scales(k_scale, v_scale, key):
  """``k_scale`` and ``v_scale`` of a quantized cache ``key`` as the kernels
  take them: float32, 3-D (leading dims of 1 added), checked against ``key``
  (``shapes.check_kv_scales``).

  Raises:
    ValueError: one scale given without the other, scales for a cache that
      is not quantized or none for one that is, or shapes that do not
      broadcast to ``key.shape[:3]``.
    TypeError: scales that are not floating point.
  """
  if (k_scale is None) != (v_scale is None):
    raise ValueError("k_scale and v_scale must be given together")
  if not is_quantized(key.dtype):
    if k_scale is not None:
      raise ValueError(f"k_scale and v_scale are for an int8 or float8_e4m3fn cache; this one "
                       f"is {key.dtype}")
    return None, None
  if k_scale is None:
    raise ValueError(f"a {key.dtype} cache needs k_scale and v_scale (see decode.quantize)")
  scales = []
  for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{name} must be floating point (float32), got {x.dtype}")
    if x.ndim > 3:
      raise ValueError(f"{name} must broadcast to the cache's (B, S, K) = {key.shape[:3]}, got "
                       f"shape {x.shape}")
    scales.append(x.astype(jnp.float32).reshape((1,) * (3 - x.ndim) + x.shape))
  shapes.check_kv_scales(key, *scales)
  return tuple(scales)


# Lengths arrays whose values the host knows without reading them back: a
# decode step records its result's lengths (``remember_lengths``), so the next
# step's ``check_room`` costs no device round trip (on an H200 that read cost
# 0.12 ms of a 1.4 ms Llama-3-8B two-layer step at batch 1). Keyed by id,
# dropped with the array.
_KNOWN_LENGTHS: dict[int, tuple[weakref.ref, np.ndarray]] = {}


def host_lengths(lengths) -> np.ndarray:
  """``lengths`` as a NumPy array: the value recorded for this very array
  (``remember_lengths``), else read back from its device."""
  entry = _KNOWN_LENGTHS.get(id(lengths))
  if entry is not None and entry[0]() is lengths:
    return entry[1]
  return np.asarray(lengths)


def remember_lengths(lengths, values) -> None:
  """Records that the (concrete) array ``lengths`` holds ``values``."""
  key = id(lengths)
  _KNOWN_LENGTHS[key] = (weakref.ref(lengths, lambda _: _KNOWN_LENGTHS.pop(key, None)),
                         np.asarray(values, np.int32))


def _raise_if_past_end(past_end, lengths, T, S_max):
  if np.any(past_end):
    raise ValueError(
        f"KV cache overflow: writing T={T} new positions at lengths {np.asarray(lengths)} "
        f"goes past the cache's S_max={S_max}; allocate a longer cache")


def write(cache_k, cache_v, lengths, k_new, v_new, *, k_scale=None, v_scale=None):
  """Writes the keys and values of T new positions into one layer's cache.

  Position ``lengths[b] + t`` of sequence b receives ``k_new[b, t]`` and
  ``v_new[b, t]``. Under ``jax.jit`` with the caches donated
  (``donate_argnums``) or inside ``lax.scan``, XLA updates them in place: no
  copy of the cache per step. On GPUs the write is one scatter per cache (its
  compile time does not grow with B); on the CPU one slice update per
  sequence (XLA:CPU copies a 16-bit cache around a scatter).

  A quantized cache (int8 or float8_e4m3fn) comes with its scales: the new
  positions are quantized (``quantize``); an int8 cache's per-position
  scales are written beside them, a float8 cache's per-head scales used.

  Args:
    cache_k, cache_v: (B, S_max, K, H), any floating dtype, int8 or
      float8_e4m3fn.
    lengths: (B,) integer, positions already written (before this write).
    k_new, v_new: (B, T, K, H); cast to (or quantized for) the cache's dtype.
    k_scale, v_scale: a quantized cache's scales, float32: (B, S_max, K)
      (int8) or (1, 1, K) (float8); None for a float cache.

  Returns:
    The updated ``(cache_k, cache_v)``; with scales, ``(cache_k, cache_v,
    k_scale, v_scale)``.

  Raises:
    TypeError: ``lengths`` not of an integer dtype.
    ValueError: at trace time on shapes that do not fit or scales that do
      not match the cache (``kv_scales``); at once when
      concrete ``lengths`` have ``lengths[b] + T > S_max`` for some b. With
      traced lengths (under jit) the write lands on the last T positions
      (XLA clamps the start) and ``KVCache.advance`` of the same step
      reports the overflow.
  """
  _check_cache("write", cache_k, cache_v)
  scales = kv_scales(k_scale, v_scale, cache_k)
  B, S_max, K, H = cache_k.shape
  if k_new.ndim != 4 or k_new.shape != v_new.shape or k_new.shape[0] != B or \
      k_new.shape[2:] != (K, H):
    raise ValueError(
        f"write: k_new and v_new must be (B, T, K, H) = ({B}, T, {K}, {H}), got "
        f"{k_new.shape} and {v_new.shape}")
  T = k_new.shape[1]
  lengths = seq_lengths("lengths", lengths, B)
  past_end = lengths + T > S_max
  if not isinstance(past_end, jax.core.Tracer):
    _raise_if_past_end(np.asarray(past_end), lengths, T, S_max)

  # Sequence b's first position, clamped as a slice update clamps it.
  start = jnp.clip(lengths, 0, max(S_max - T, 0))

  def scatter(cache, new):
    b = jnp.arange(B)[:, None]
    pos = start[:, None] + jnp.arange(T)[None, :]
    return cache.at[b, pos].set(new, indices_are_sorted=True, unique_indices=True,
                                mode="promise_in_bounds")

  def per_sequence(cache, new):
    # One slice update per sequence, on the bits: XLA:CPU would run a 16-bit
    # float update in float32, converting (and copying) the whole cache, and
    # it copies a cache around a scatter; a loop of slice updates took 4.5
    # times as long as these (B = 8, S_max = 4K, bf16).
    bits = jnp.dtype(f"uint{8 * cache.dtype.itemsize}")
    raw = jax.lax.bitcast_convert_type(cache, bits)
    new = jax.lax.bitcast_convert_type(new, bits)
    zeros = (0,) * (cache.ndim - 2)
    for b in range(B):
      raw = jax.lax.dynamic_update_slice(raw, new[b:b + 1], (b, start[b], *zeros))
    return jax.lax.bitcast_convert_type(raw, cache.dtype)

  def put(cache, new):
    return jax.lax.platform_dependent(cache, new.astype(cache.dtype), cpu=per_sequence,
                                      default=scatter)

  if scales[0] is None:
    return put(cache_k, k_new), put(cache_v, v_new)
  cache_k, k_scale = put_quantized(put, cache_k, scales[0], k_new)
  cache_v, v_scale = put_quantized(put, cache_v, scales[1], v_new)
  return cache_k, cache_v, k_scale, v_scale


def put_quantized(put, cache, scale, new):
  """Writes ``new`` positions into a quantized cache (or pool) and its scale
  with ``put(array, new_entries)``: int8 quantized per position and head,
  the new scales written beside the values; float8 by the cache's per-head
  ``scale``, which stays as it is. Returns ``(cache, scale)``."""
  if cache.dtype == jnp.int8:
    values, new_scale = quantize(new, cache.dtype)
    return put(cache, values), put(scale, new_scale)
  return put(cache, quantize(new, cache.dtype, scale)[0]), scale


def initial_scales(dtype, positions, kv_heads: int, num_layers: int, sharding):
  """A quantized cache's per-layer scales before any write, one tuple each for
  k and v: int8 zeros of ``positions + (kv_heads,)`` ((B, S_max) or (pages,
  page_size)), float8 ones of (1, 1, kv_heads); empty tuples for a float
  ``dtype``. Every array its own buffer (a donated step must not see one
  twice)."""
  if not is_quantized(dtype):
    return (), ()
  int8 = np.dtype(dtype) == np.int8
  full = jax.jit(lambda: jnp.full((*positions, kv_heads) if int8 else (1, 1, kv_heads),
                                  0.0 if int8 else 1.0, jnp.float32), out_shardings=sharding)
  return tuple(tuple(full() for _ in range(num_layers)) for _ in range(2))


def decode_attention(query, cache_k, cache_v, lengths, *, block_table=None, k_scale=None,
                     v_scale=None, scale=None, local_window_size=None, logits_soft_cap=None,
                     return_residual=False, implementation=None):
  r"""Attention of T new queries over a KV cache that already holds their keys.

  Query t of sequence b sits at position ``lengths[b] - T + t`` and sees the
  keys at positions ``j <= lengths[b] - T + t`` (causal among the new tokens,
  aligned to the end of each sequence; with a window ``(left, right)`` also
  ``j >= position - left``). Keys at positions ``>= lengths[b]`` are never
  read. Same result as ``jax.nn.dot_product_attention(query, cache_k[:, :L],
  cache_v[:, :L], is_causal=...)`` for one sequence of length L, with the
  queries the last T rows.

  The fused paths run split-KV (Flash-Decoding: the keys of each sequence split
  across thread blocks or CPU threads, partial softmaxes merged by their
  log-sum-exp) when the batch and heads alone would leave the device idle. On
  CUDA GPUs, steps with T * N / K <= 8 query rows per key/value head run a
  dedicated decode kernel: one block holds all those rows and streams its
  share of the cache head once, and the last block of each head merges the
  splits in the same launch (``csrc/kernels/cuda/attention_decode.cu``, chosen
  by the planner, ``csrc/cuda/variants.cc``: ``PlanCall``).
  Algorithm: the online softmax of FlashAttention-2 over key chunks, with
  FastAttention's (Lin et al., 2024) per-tile masks; split-KV after Dao et
  al., "Flash-Decoding for long-context inference" (2023).

  A paged cache (``block_table`` given; PagedAttention, Kwon et al., 2023):
  the caches are pools of pages shared by all sequences, and position j of
  sequence b lives at row ``j % page_size`` of page ``block_table[b, j //
  page_size]``. The CUDA decode kernel and the CPU kernel's decode path read
  the pages in place; the other kernels (more query rows than those hold)
  and the "xla" path read them gathered into one (B, max_pages * page_size,
  K, H) cache first, with the same result. Gradients flow to the pools'
  pages.

  A quantized cache (int8 or float8_e4m3fn, with ``k_scale`` and
  ``v_scale``; ``quantize`` makes them): the keys are ``cache_k *
  k_scale[..., None]``. The CUDA decode kernel (sm_80 and newer) reads the
  8-bit values and dequantizes them in registers, and the CPU kernel's decode
  path (up to 64 query rows per key/value head) tile by tile to float32, so
  a step reads half the bytes of a 16-bit cache; the other paths dequantize
  the cache to query's dtype first. Gradients flow to query and the scales,
  not to the 8-bit values.

  Args:
    query: (B, T, N, H), float16, bfloat16, float32 (or float64, reference
      math).
    cache_k, cache_v: (B, S_max, K, H), query's dtype, or int8 or
      float8_e4m3fn with scales; N a multiple of K. With ``block_table``:
      pools of pages, (pages, page_size, K, H), page_size a power of two >=
      16 (``shapes.MIN_PAGE_SIZE``).
    lengths: (B,) integer, valid positions of each sequence, including the T
      new ones (``lengths[b] >= T`` for every sequence with queries); at most
      S_max (paged: max_pages * page_size).
    block_table: None, or (B, max_pages) integer (taken as int32), the pages
      of each sequence in order. Entries for positions past ``lengths[b]``
      are never read; the others must lie in [0, pages) (out-of-range
      entries read the nearest page).
    k_scale, v_scale: a quantized cache's scales, floating (taken as
      float32), broadcastable to the cache's (B, S_max, K) (paged: (pages,
      page_size, K)): per position and head for int8, per head (K,) for
      float8 (any shape of up to 3 dims that broadcasts: ``kv_scales``).
    scale, local_window_size, logits_soft_cap, return_residual,
      implementation: as in ``fastattn_jax.fast_attention``.

  Returns:
    out (B, T, N, H) in query's dtype; with ``return_residual`` also the LSE,
    (B, T, N) float32. A query whose position is negative (``lengths[b] <
    T``) sees no key: out 0, LSE -inf.

  Raises:
    ValueError, TypeError: as ``fast_attention``, naming the argument and its
      shape, at trace time; ValueError at once for concrete ``lengths``
      outside [0, S_max] (traced ones are clamped to that range); with
      ``block_table``, ValueError for a page size that is not a power of two
      >= 16 or pools and table that do not fit, TypeError for a table that
      is not of integers; ValueError or TypeError for scales that do not
      fit the cache (``kv_scales``).
  """
  query = jnp.asarray(query)
  k_scale, v_scale = kv_scales(k_scale, v_scale, cache_k)
  quantized = k_scale is not None
  if block_table is None:
    _check_cache("decode_attention", cache_k, cache_v)
    dims = shapes.check_qkv(query, cache_k, cache_v, quantized=quantized)
  else:
    block_table = jnp.asarray(block_table)
    if not jnp.issubdtype(block_table.dtype, jnp.integer):
      raise TypeError(f"block_table must be an integer array of shape (B, max_pages), got "
                      f"{block_table.dtype}")
    block_table = block_table.astype(jnp.int32)
    dims = shapes.check_paged(query, cache_k, cache_v, block_table, quantized=quantized)
  lengths = seq_lengths("lengths", lengths, dims.B, dims.S)
  config = AttentionConfig(
      scale=(shapes.default_scale(dims.H) if scale is None
             else shapes.static_float("scale", scale)),
      is_causal=dims.T > 1,
      window=shapes.normalize_window(local_window_size),
      softcap=(None if logits_soft_cap is None else
               shapes.static_float("logits_soft_cap", logits_soft_cap, positive=True,
                                     max_value=shapes.MAX_SOFTCAP)),
      end_aligned=True, has_kv_lens=True, has_block_table=block_table is not None,
      has_kv_scales=quantized, implementation=requested_implementation(implementation, query.dtype))
  if config.implementation == "cudnn":
    raise ValueError("decode_attention: implementation='cudnn' is not supported; "
                     "use None, 'xla' or a fused path")
  out, lse = run_config(config, query, cache_k, cache_v, None, None, None, lengths,
                        block_table, k_scale, v_scale)
  return (out, lse) if return_residual else out


@functools.partial(jax.jit, static_argnames=("scale", "implementation"), donate_argnums=(1, 2))
def layer_attend(query, cache_k, cache_v, lengths, k_new, v_new, *, scale, implementation):
  """Writes T new positions into one layer's cache and attends the T queries over it, jitted.

  ``decode.write`` then ``decode_attention`` (FlashAttention-2's online
  softmax with FastAttention's tiles, Lin et al. 2024) in one jitted call
  with the caches donated, so they are updated in place wherever they live
  (device memory, or the host CPU device for mode "host").

  Args:
    query: (B, T, N, H), a floating dtype.
    cache_k, cache_v: (B, S_max, K, H) of query's dtype; donated (not to be
      used after the call).
    lengths: (B,) integer, positions written before this call.
    k_new, v_new: (B, T, K, H).
    scale, implementation: as in ``decode_attention`` (static).

  Returns:
    ``(out, cache_k, cache_v)``: out (B, T, N, H) in query's dtype, and the
    caches with the new positions written.

  Raises:
    ValueError, TypeError: as ``decode.write`` and ``decode_attention``.
  """
  cache_k, cache_v = write(cache_k, cache_v, lengths, k_new, v_new)
  out = decode_attention(query, cache_k, cache_v, lengths + k_new.shape[1], scale=scale,
                         implementation=implementation)
  return out, cache_k, cache_v


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """The key/value caches of every layer of a decoder, and the sequence lengths.

  A pytree: pass it through ``jax.jit`` (donate it for in-place updates) and
  ``lax.scan``. Each layer's arrays may live in any memory the caller chose
  (``jax.device_put`` with a sharding of ``memory_kind="pinned_host"``, see
  ``fastattn_jax.offload``).

  Attributes:
    k, v: tuples of per-layer (B, S_max, K, H) arrays.
    lengths: (B,) int32, positions of each sequence written so far (equal in
      every layer).
    k_scale, v_scale: a quantized cache's per-layer scales, float32: (B,
      S_max, K) for int8, (1, 1, K) for float8_e4m3fn (``quantize``); empty
      tuples for a float cache.
  """

  k: tuple
  v: tuple
  lengths: jax.Array
  k_scale: tuple = ()
  v_scale: tuple = ()

  @classmethod
  def create(cls, num_layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int,
             dtype=jnp.bfloat16, lengths=None, device=None) -> "KVCache":
    """A zero-filled cache; ``lengths`` (B,) defaults to zeros.

    ``dtype`` int8 or float8_e4m3fn makes a quantized cache (``quantize``):
    int8 scales start at 0, float8 scales at 1 per head (replace them with a
    calibration's: ``dataclasses.replace(cache, k_scale=..., v_scale=...)``).
    ``device``: a ``jax.Device`` or ``jax.sharding.Sharding`` the arrays are
    created on (default: the default device).

    Raises:
      ValueError: for non-positive sizes.
    """
    for name, x in (("num_layers", num_layers), ("batch", batch), ("max_len", max_len),
                    ("kv_heads", kv_heads), ("head_dim", head_dim)):
      if int(x) <= 0:
        raise ValueError(f"KVCache.create: {name} must be positive, got {x}")
    shape = (batch, max_len, kv_heads, head_dim)
    zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding_of(device))
    lengths = jnp.zeros((batch,), jnp.int32) if lengths is None else jnp.asarray(
        lengths, jnp.int32)
    if lengths.shape != (batch,):
      raise ValueError(f"KVCache.create: lengths must have shape ({batch},), got {lengths.shape}")
    k_scale, v_scale = initial_scales(dtype, (batch, max_len), kv_heads, num_layers,
                                      sharding_of(device))
    return cls(k=tuple(zeros() for _ in range(num_layers)),
               v=tuple(zeros() for _ in range(num_layers)), lengths=lengths,
               k_scale=k_scale, v_scale=v_scale)

  @classmethod
  def from_prefill(cls, k, v, lengths, max_len: int, *, dtype=None) -> "KVCache":
    """The cache of a prefill: every layer's keys and values at positions [0, P).

    Args:
      k, v: (L, B, P, K, H), a prefill's keys (RoPE applied) and values.
      lengths: (B,) integer, each sequence's valid positions (<= P; the rest,
        e.g. a shorter prompt's padding, is overwritten by later steps).
      max_len: S_max >= P, the positions each layer holds.
      dtype: the cache's dtype, default k's; int8 quantizes per position and
        head, float8_e4m3fn with scale 1 per head (``quantize``).

    Returns:
      A ``KVCache`` of L layers of (B, max_len, K, H), zero past P, its
      ``lengths`` placed where ``k`` is (as every step returns them; a cache
      whose lengths are elsewhere makes the second step compile again).

    Raises:
      ValueError: k and v of other shapes or ranks, or ``max_len`` < P.
    """
    if k.ndim != 5 or k.shape != v.shape:
      raise ValueError(f"KVCache.from_prefill: k and v must both be (L, B, P, K, H), got "
                       f"{k.shape} and {v.shape}")
    if max_len < k.shape[2]:
      raise ValueError(f"KVCache.from_prefill: max_len={max_len} < P={k.shape[2]}")
    pad = ((0, 0), (0, max_len - k.shape[2]), (0, 0), (0, 0))
    where = k.sharding  # lengths replicated on k's devices (k may be split by heads)
    if isinstance(where, jax.sharding.NamedSharding):
      where = jax.sharding.NamedSharding(where.mesh, jax.sharding.PartitionSpec())
    # Indexed, not iterated: iterating a sharded array yields single-device rows.
    layers = range(k.shape[0])
    lengths = jax.device_put(np.asarray(lengths, np.int32), where)
    if dtype is None or not is_quantized(dtype):
      dtype = k.dtype if dtype is None else dtype
      return cls(k=tuple(jnp.pad(k[i], pad).astype(dtype) for i in layers),
                 v=tuple(jnp.pad(v[i], pad).astype(dtype) for i in layers), lengths=lengths)
    int8 = np.dtype(dtype) == np.int8
    # float8: a scale array of its own per layer and for k and v (a donated
    # step must not see one buffer twice).
    unit = lambda: None if int8 else jnp.ones((1, 1, k.shape[3]), jnp.float32)
    parts = {name: [quantize(x[i], dtype, unit()) for i in layers] for name, x in (("k", k),
                                                                                 ("v", v))}
    scale_pad = pad[:3] if int8 else None
    padded = lambda scale: scale if scale_pad is None else jnp.pad(scale, scale_pad)
    return cls(k=tuple(jnp.pad(x, pad) for x, _ in parts["k"]),
               v=tuple(jnp.pad(x, pad) for x, _ in parts["v"]), lengths=lengths,
               k_scale=tuple(padded(s) for _, s in parts["k"]),
               v_scale=tuple(padded(s) for _, s in parts["v"]))

  @property
  def num_layers(self) -> int:
    return len(self.k)

  @property
  def max_len(self) -> int:
    return self.k[0].shape[1]

  def attend(self, layer: int, query, k_new, v_new, **kwargs):
    """Writes T new positions into ``layer`` and attends the T queries over it.

    Args:
      layer: the layer index (static).
      query: (B, T, N, H); k_new, v_new: (B, T, K, H).
      **kwargs: scale, local_window_size, logits_soft_cap, implementation,
        as in ``decode_attention``.

    Returns:
      ``(out, cache)``: out (B, T, N, H); the cache with that layer written
      and ``lengths`` unchanged (call ``advance(T)`` once every layer is
      done).

    Raises:
      ValueError: as ``write`` and ``decode_attention``.
    """
    scales = self.layer_scales(layer)
    k, v, *scales = write(self.k[layer], self.v[layer], self.lengths, k_new, v_new, **scales)
    out = decode_attention(query, k, v, self.lengths + k_new.shape[1],
                           **dict(zip(("k_scale", "v_scale"), scales)), **kwargs)
    return out, self.replace_layer(layer, k, v, *scales)

  def layer_scales(self, layer: int) -> dict:
    """Layer ``layer``'s ``k_scale`` and ``v_scale`` as keyword arguments
    (of ``write`` and ``decode_attention``); empty for a float cache."""
    if not self.k_scale:
      return {}
    return {"k_scale": self.k_scale[layer], "v_scale": self.v_scale[layer]}

  def replace_layer(self, layer: int, k, v, k_scale=None, v_scale=None) -> "KVCache":
    """The cache with layer ``layer``'s arrays replaced by ``k`` and ``v``
    (and a quantized cache's scales by ``k_scale`` and ``v_scale``)."""
    put = lambda xs, x: xs if x is None else xs[:layer] + (x,) + xs[layer + 1:]
    return dataclasses.replace(self, k=put(self.k, k), v=put(self.v, v),
                               k_scale=put(self.k_scale, k_scale),
                               v_scale=put(self.v_scale, v_scale))

  def check_room(self, T: int) -> bool:
    """Checks on the host, before a step, that T more positions fit.

    Reads ``lengths`` back from the device (waiting for the step that wrote
    them), unless a step recorded them (``offload.decode_step`` does):
    microseconds, where ``advance``'s check under jit runs a host callback
    inside every step (4.2-4.7 ms a step of SmolLM2-135M on an H100,
    measured).

    Returns:
      True when checked; False when ``lengths`` are traced (inside a caller's
      jit): then only ``advance`` can check.

    Raises:
      ValueError: when a length would pass ``max_len``.
    """
    if isinstance(self.lengths, jax.core.Tracer):
      return False
    if self.k:
      lengths = host_lengths(self.lengths)
      _raise_if_past_end(lengths + T > self.max_len, lengths, T, self.max_len)
    return True

  def advance(self, T: int, *, check: bool = True) -> "KVCache":
    """The cache with every length grown by T (the step's new positions).

    Args:
      T: the step's new positions.
      check: False skips the check below (the caller ran ``check_room(T)``).

    Raises:
      ValueError: when a length would pass ``max_len``: at once for concrete
        lengths; under jit when the step runs (as a JAX runtime error carrying
        the message), through a host callback, once per step. That needs a
        CPU backend: with ``JAX_PLATFORMS=cuda`` alone a traced overflow is
        not reported.
    """
    lengths = self.lengths + T
    if not self.k or not check:  # no layer here (all offloaded): nothing to overflow
      return dataclasses.replace(self, lengths=lengths)
    past_end = lengths > self.max_len
    if not isinstance(past_end, jax.core.Tracer):
      _raise_if_past_end(np.asarray(past_end), self.lengths, T, self.max_len)
    elif host_cpu_device() is not None:
      io_callback(functools.partial(_raise_if_past_end, T=T, S_max=self.max_len), None,
                  past_end, self.lengths)
    return dataclasses.replace(self, lengths=lengths)
