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
beside each layer's k and v. A stacked cache (``KVCache.create(...,
stacked=True)``) holds every layer in one (L, B, S_max, K, H) array, so that
a layer index traced by ``lax.scan`` over the layers can address it; the
kernels read it in place as a paged cache (``stacked_pages``).
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


def _check_cache(name, cache_k, cache_v, stacked=False):
  layout = "(L, B, S_max, K, H)" if stacked else "(B, S_max, K, H)"
  if cache_k.ndim != 4 + stacked or cache_k.shape != cache_v.shape or \
      cache_k.dtype != cache_v.dtype:
    raise ValueError(
        f"{name}: key and value caches must both be {layout} of one dtype, got "
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


#: The largest page a stacked cache is read in (``stacked_pages``): the
#: largest the paged kernels are tested with (tests/test_paged.py).
MAX_STACKED_PAGE = 256


def stacked_len(max_len: int) -> int:
  """The positions per layer and sequence a stacked cache allocates for
  ``max_len``: rounded up to a multiple of ``shapes.MIN_PAGE_SIZE`` (16), the
  smallest page the kernels read (``stacked_pages``)."""
  return -(-int(max_len) // shapes.MIN_PAGE_SIZE) * shapes.MIN_PAGE_SIZE


def layer_index(name: str, layer, num_layers: int):
  """A stacked cache's ``layer`` argument checked: a Python int for a
  concrete one, an int32 scalar clamped into [0, num_layers) for a traced one.

  Raises:
    TypeError: ``layer`` not a scalar integer.
    ValueError: a concrete ``layer`` outside [0, num_layers).
  """
  if not hasattr(layer, "dtype"):
    layer = np.asarray(layer)
  if np.shape(layer) != () or not jnp.issubdtype(layer.dtype, jnp.integer):
    raise TypeError(f"{name}: layer must be a scalar integer, got {layer.dtype} of shape "
                    f"{np.shape(layer)}")
  if isinstance(layer, jax.core.Tracer):
    return jnp.clip(layer, 0, num_layers - 1).astype(jnp.int32)
  if not 0 <= int(layer) < num_layers:
    raise ValueError(f"{name}: layer={int(layer)} is outside [0, {num_layers}) for a cache of "
                     f"{num_layers} layers")
  return int(layer)


def stacked_scales(name: str, k_scale, v_scale, cache_k):
  """The scales of a stacked cache ``cache_k`` (L, B, S_max, K, H), checked:
  float32 of (L, B, S_max, K) for int8, (L, 1, 1, K) for float8_e4m3fn
  (``KVCache.create(..., stacked=True)`` makes them); ``(None, None)`` for
  a float cache.

  Raises:
    ValueError: scales for a float cache, none (or one) for a quantized one,
      or scales of another shape or dtype.
  """
  if not is_quantized(cache_k.dtype):
    if k_scale is not None or v_scale is not None:
      raise ValueError(f"{name}: k_scale and v_scale are for an int8 or float8_e4m3fn cache; "
                       f"this one is {cache_k.dtype}")
    return None, None
  L, B, S, K, _ = cache_k.shape
  want = (L, B, S, K) if cache_k.dtype == jnp.int8 else (L, 1, 1, K)
  for arg, x in (("k_scale", k_scale), ("v_scale", v_scale)):
    if x is None or x.shape != want or x.dtype != jnp.float32:
      got = "None" if x is None else f"{x.dtype} of shape {x.shape}"
      raise ValueError(f"{name}: a stacked {cache_k.dtype} cache {cache_k.shape} needs {arg} "
                       f"float32 of shape {want}, got {got}")
  return k_scale, v_scale


def stacked_pages(cache_k, cache_v, layer, k_scale=None, v_scale=None):
  """Layer ``layer`` of a stacked cache as a paged cache, in place: the
  arguments of ``decode_attention`` that read it without copying the layer.

  The stacked (L, B, S, K, H) array reshaped to (L * B * S / ps, ps, K, H)
  (a free reshape of a contiguous array) is a pool of pages, and position j
  of sequence b in layer l lies at row ``j % ps`` of page ``(l * B + b) * (S
  / ps) + j // ps``: a block table computed from the (traced) layer. The
  page size ps is the largest power of two <= ``MAX_STACKED_PAGE`` dividing
  S (>= 16, as ``stacked_len`` rounds S). An int8 cache's (L, B, S, K)
  scales are paged alike; a float8 cache's per-head ones are the layer's (1,
  1, K) slice. The layout after PagedAttention (Kwon et al., 2023), whose
  block table here addresses one layer of the stacked array.

  Args:
    cache_k, cache_v: (L, B, S, K, H), S a multiple of 16.
    layer: a scalar integer, concrete or traced (``layer_index``).
    k_scale, v_scale: a quantized cache's stacked scales (``stacked_scales``).

  Returns:
    ``(k_pages, v_pages, kwargs)``: pools (L * B * S / ps, ps, K, H) and the
    keyword arguments ``block_table`` (B, S / ps) int32 and, quantized,
    ``k_scale`` and ``v_scale`` for ``decode_attention``.

  Raises:
    ValueError: S not a multiple of 16, more than 2**31 - 1 pages, or
      scales that do not fit (``stacked_scales``).
  """
  _check_cache("stacked_pages", cache_k, cache_v, stacked=True)
  L, B, S, K, H = cache_k.shape
  if S % shapes.MIN_PAGE_SIZE:
    raise ValueError(f"stacked_pages: the stacked cache's S_max (cache_k {cache_k.shape}, dim 2) "
                     f"must be a multiple of {shapes.MIN_PAGE_SIZE} (stacked_len)")
  page = shapes.MIN_PAGE_SIZE
  while page < MAX_STACKED_PAGE and S % (2 * page) == 0:
    page *= 2
  per_sequence = S // page
  if L * B * per_sequence > np.iinfo(np.int32).max:
    raise ValueError(f"stacked_pages: a stacked cache {cache_k.shape} in pages of {page} has "
                     f"more pages than an int32 block table addresses")
  layer = layer_index("stacked_pages", layer, L)
  k_scale, v_scale = stacked_scales("stacked_pages", k_scale, v_scale, cache_k)
  first = (layer * B + jnp.arange(B, dtype=jnp.int32)) * per_sequence
  kwargs = {"block_table": first[:, None] + jnp.arange(per_sequence, dtype=jnp.int32)[None, :]}
  pool = lambda x: x.reshape(L * B * per_sequence, page, *x.shape[3:])
  if k_scale is not None:
    int8 = cache_k.dtype == jnp.int8
    kwargs.update({name: pool(x) if int8 else x[layer]
                   for name, x in (("k_scale", k_scale), ("v_scale", v_scale))})
  return pool(cache_k), pool(cache_v), kwargs


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
  # The record bound in the callback: an array dropped at interpreter exit,
  # after this module's globals, must still find it.
  forget = lambda _, known=_KNOWN_LENGTHS: known.pop(key, None)
  _KNOWN_LENGTHS[key] = (weakref.ref(lengths, forget), np.asarray(values, np.int32))


def _raise_if_past_end(past_end, lengths, T, S_max):
  if np.any(past_end):
    raise ValueError(
        f"KV cache overflow: writing T={T} new positions at lengths {np.asarray(lengths)} "
        f"goes past the cache's S_max={S_max}; allocate a longer cache")


def write(cache_k, cache_v, lengths, k_new, v_new, *, k_scale=None, v_scale=None, layer=None):
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

  A stacked cache (every layer in one array, ``layer`` given): one scatter
  per array at ``[layer]`` of the stacked arrays, on every platform. Beside
  the paged read of ``KVCache.attend`` XLA:CPU keeps it in place for
  float32, float16 and int8 caches (tests/test_stacked.py measures the
  step's temporary memory) and copies a bfloat16 or float8_e4m3fn stacked
  cache around it (as it does around the slice updates on the bits). On
  GPUs the scatter is also the tuple layout's write.

  Args:
    cache_k, cache_v: (B, S_max, K, H), any floating dtype, int8 or
      float8_e4m3fn; stacked: (L, B, S_max, K, H).
    lengths: (B,) integer, positions already written (before this write).
    k_new, v_new: (B, T, K, H); cast to (or quantized for) the cache's dtype.
    k_scale, v_scale: a quantized cache's scales, float32: (B, S_max, K)
      (int8) or (1, 1, K) (float8); stacked: (L, B, S_max, K) or (L, 1, 1,
      K). None for a float cache.
    layer: None, or for a stacked cache the layer written: a scalar integer,
      concrete or traced (e.g. ``lax.scan``'s index over the layers).

  Returns:
    The updated ``(cache_k, cache_v)``; with scales, ``(cache_k, cache_v,
    k_scale, v_scale)``.

  Raises:
    TypeError: ``lengths`` not of an integer dtype; ``layer`` not a scalar
      integer.
    ValueError: at trace time on shapes that do not fit or scales that do
      not match the cache (``kv_scales``, stacked: ``stacked_scales``); at
      once for a concrete ``layer`` outside [0, L) (a traced one is clamped
      into it) and when concrete ``lengths`` have ``lengths[b] + T > S_max``
      for some b. With traced lengths (under jit) the write lands on the
      last T positions (XLA clamps the start) and ``KVCache.advance`` of the
      same step reports the overflow.
  """
  stacked = layer is not None
  _check_cache("write", cache_k, cache_v, stacked)
  if stacked:
    layer = layer_index("write", layer, cache_k.shape[0])
    scales = stacked_scales("write", k_scale, v_scale, cache_k)
  else:
    scales = kv_scales(k_scale, v_scale, cache_k)
  lead = (layer,) if stacked else ()  # the index of the layer's arrays in the stacked ones
  B, S_max, K, H = cache_k.shape[-4:]
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
    return cache.at[(*lead, b, pos)].set(new, indices_are_sorted=True, unique_indices=True,
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
    if stacked:
      # The scatter everywhere: beside the paged read of the stacked arrays
      # (``stacked_pages``, a reshape) XLA:CPU copies the whole arrays around
      # the slice updates on the bits (measured: 1.5 times the cache in
      # temporaries for bf16), and keeps a scatter in place for float32,
      # float16 and int8 (not bfloat16 or float8_e4m3fn, which it copies).
      return scatter(cache, new.astype(cache.dtype))
    return jax.lax.platform_dependent(cache, new.astype(cache.dtype), cpu=per_sequence,
                                      default=scatter)

  def put_layer(cache, scale, new):
    if stacked and cache.dtype != jnp.int8:
      # float8: quantized by the layer's per-head scale, which stays as it is.
      return put_quantized(put, cache, scale[layer], new)[0], scale
    return put_quantized(put, cache, scale, new)

  if scales[0] is None:
    return put(cache_k, k_new), put(cache_v, v_new)
  cache_k, k_scale = put_layer(cache_k, scales[0], k_new)
  cache_v, v_scale = put_layer(cache_v, scales[1], v_new)
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


def initial_scales(dtype, positions, kv_heads: int, num_layers: int, sharding, *,
                   stacked: bool = False):
  """A quantized cache's per-layer scales before any write, one tuple each for
  k and v: int8 zeros of ``positions + (kv_heads,)`` ((B, S_max) or (pages,
  page_size)), float8 ones of (1, 1, kv_heads); ``stacked``: one array each
  for k and v, of those shapes with ``num_layers`` in front. Empty tuples for
  a float ``dtype``. Every array its own buffer (a donated step must not see
  one twice)."""
  if not is_quantized(dtype):
    return (), ()
  int8 = np.dtype(dtype) == np.int8
  shape = (*positions, kv_heads) if int8 else (1, 1, kv_heads)
  full = jax.jit(lambda: jnp.full((num_layers, *shape) if stacked else shape,
                                  0.0 if int8 else 1.0, jnp.float32), out_shardings=sharding)
  if stacked:
    return full(), full()
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
  out, lse = run_config(config, query, cache_k, cache_v, None, None, None, lengths, None,
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

  Two layouts, one interface: a tuple of per-layer arrays (the default), or
  every layer stacked in one array (``create`` or ``from_prefill`` with
  ``stacked=True``), whose ``attend`` takes a traced layer index: a decoder
  whose layers run under ``lax.scan`` (the cache in the carry, the index of
  the layer from the scan) updates the stacked arrays in place and the
  kernels read the layer in place (``stacked_pages``). Offloading
  (``fastattn_jax.offload``) takes the tuple layout, and so does a bfloat16
  or float8_e4m3fn cache on the CPU: XLA:CPU copies such a stacked cache
  around each layer's write (``write``; a step of 8 layers took 69 ms
  stacked, 1.6 ms as a tuple, B = 4, S_max = 2048, measured).

  Attributes:
    k, v: tuples of per-layer (B, S_max, K, H) arrays; stacked: one (L, B,
      S_max, K, H) array each.
    lengths: (B,) int32, positions of each sequence written so far (equal in
      every layer).
    k_scale, v_scale: a quantized cache's per-layer scales, float32: (B,
      S_max, K) for int8, (1, 1, K) for float8_e4m3fn (``quantize``);
      stacked, one array of (L, B, S_max, K) or (L, 1, 1, K). Empty tuples
      for a float cache.
  """

  k: tuple | jax.Array
  v: tuple | jax.Array
  lengths: jax.Array
  k_scale: tuple | jax.Array = ()
  v_scale: tuple | jax.Array = ()

  @classmethod
  def create(cls, num_layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int,
             dtype=jnp.bfloat16, lengths=None, device=None, *, stacked: bool = False) -> "KVCache":
    """A zero-filled cache; ``lengths`` (B,) defaults to zeros.

    ``dtype`` int8 or float8_e4m3fn makes a quantized cache (``quantize``):
    int8 scales start at 0, float8 scales at 1 per head (replace them with a
    calibration's: ``dataclasses.replace(cache, k_scale=..., v_scale=...)``).
    ``device``: a ``jax.Device`` or ``jax.sharding.Sharding`` the arrays are
    created on (default: the default device). ``stacked``: one (L, B, S_max,
    K, H) array each for k and v, S_max = ``max_len`` rounded up to a
    multiple of 16 (``stacked_len``; the cache holds, and ``max_len``
    reports, those positions).

    Raises:
      ValueError: for non-positive sizes.
    """
    for name, x in (("num_layers", num_layers), ("batch", batch), ("max_len", max_len),
                    ("kv_heads", kv_heads), ("head_dim", head_dim)):
      if int(x) <= 0:
        raise ValueError(f"KVCache.create: {name} must be positive, got {x}")
    if stacked:
      max_len = stacked_len(max_len)
    shape = (batch, max_len, kv_heads, head_dim)
    zeros = jax.jit(lambda: jnp.zeros((num_layers, *shape) if stacked else shape, dtype),
                    out_shardings=sharding_of(device))
    lengths = jnp.zeros((batch,), jnp.int32) if lengths is None else jnp.asarray(
        lengths, jnp.int32)
    if lengths.shape != (batch,):
      raise ValueError(f"KVCache.create: lengths must have shape ({batch},), got {lengths.shape}")
    k_scale, v_scale = initial_scales(dtype, (batch, max_len), kv_heads, num_layers,
                                      sharding_of(device), stacked=stacked)
    if stacked:
      return cls(k=zeros(), v=zeros(), lengths=lengths, k_scale=k_scale, v_scale=v_scale)
    return cls(k=tuple(zeros() for _ in range(num_layers)),
               v=tuple(zeros() for _ in range(num_layers)), lengths=lengths,
               k_scale=k_scale, v_scale=v_scale)

  @classmethod
  def from_prefill(cls, k, v, lengths, max_len: int, *, dtype=None,
                   stacked: bool = False) -> "KVCache":
    """The cache of a prefill: every layer's keys and values at positions [0, P).

    Args:
      k, v: (L, B, P, K, H), a prefill's keys (RoPE applied) and values.
      lengths: (B,) integer, each sequence's valid positions (<= P; the rest,
        e.g. a shorter prompt's padding, is overwritten by later steps).
      max_len: S_max >= P, the positions each layer holds (stacked: rounded
        up to a multiple of 16, ``stacked_len``).
      dtype: the cache's dtype, default k's; int8 quantizes per position and
        head, float8_e4m3fn with scale 1 per head (``quantize``).
      stacked: one (L, B, S_max, K, H) array each for k and v (see
        ``KVCache``), not a tuple of L.

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
    if stacked:
      max_len = stacked_len(max_len)
    where = k.sharding  # lengths replicated on k's devices (k may be split by heads)
    if isinstance(where, jax.sharding.NamedSharding):
      where = jax.sharding.NamedSharding(where.mesh, jax.sharding.PartitionSpec())
    lengths = jax.device_put(np.asarray(lengths, np.int32), where)
    # The arrays built: the whole (L, B, P, K, H) ones (stacked), or each
    # layer's, indexed, not iterated (iterating a sharded array yields
    # single-device rows). Each padded along P to max_len.
    parts = (lambda x: [x]) if stacked else (lambda x: [x[i] for i in range(x.shape[0])])
    pack = (lambda xs: xs[0]) if stacked else tuple
    lead = 2 if stacked else 1  # the dims before P
    pad = lambda x: jnp.pad(x, [(0, 0)] * lead + [(0, max_len - k.shape[2])] +
                            [(0, 0)] * (x.ndim - lead - 1))
    if dtype is None or not is_quantized(dtype):
      dtype = k.dtype if dtype is None else dtype
      return cls(k=pack([pad(x).astype(dtype) for x in parts(k)]),
                 v=pack([pad(x).astype(dtype) for x in parts(v)]), lengths=lengths)
    int8 = np.dtype(dtype) == np.int8
    # float8: scale 1 per head, (L, 1, 1, K) stacked, else (1, 1, K) per
    # layer; an array of its own for each layer and for k and v (a donated
    # step must not see one buffer twice).
    unit = lambda x: None if int8 else jnp.ones((*x.shape[:lead - 1], 1, 1, x.shape[-2]),
                                                jnp.float32)
    quantized = {name: [quantize(x, dtype, unit(x)) for x in parts(arrays)]
                 for name, arrays in (("k", k), ("v", v))}
    scales = lambda name: pack([pad(s) if int8 else s for _, s in quantized[name]])
    return cls(k=pack([pad(x) for x, _ in quantized["k"]]),
               v=pack([pad(x) for x, _ in quantized["v"]]), lengths=lengths,
               k_scale=scales("k"), v_scale=scales("v"))

  @property
  def stacked(self) -> bool:
    """Whether every layer is in one (L, B, S_max, K, H) array (else a tuple)."""
    return not isinstance(self.k, tuple)

  @property
  def num_layers(self) -> int:
    return self.k.shape[0] if self.stacked else len(self.k)

  @property
  def max_len(self) -> int:
    return self.k.shape[2] if self.stacked else self.k[0].shape[1]

  def _layer(self, name: str, layer):
    """``layer`` checked (``layer_index``): stacked, concrete or traced; the
    tuple layout takes a static one only."""
    if not self.stacked and isinstance(layer, jax.core.Tracer):
      raise TypeError(
          f"KVCache.{name}: layer is traced ({layer.aval}), and a cache of per-layer arrays "
          f"is indexed by a static Python int; for a layer index traced by lax.scan over the "
          f"layers create the cache with stacked=True")
    return layer_index(f"KVCache.{name}", layer, self.num_layers)

  def attend(self, layer, query, k_new, v_new, **kwargs):
    """Writes T new positions into ``layer`` and attends the T queries over it.

    Tuple layout: ``write`` into the layer's arrays, ``decode_attention``
    over them. Stacked: ``write(..., layer=layer)`` into the stacked arrays
    (in place where the cache is donated or a ``lax.scan`` carry; on the
    CPU for float32, float16 and int8 caches only, see ``write``), and
    ``decode_attention`` over them as pages (``stacked_pages``): no copy of
    the layer where the kernel reads pages in place (the CUDA decode kernel,
    the CPU kernel's decode path); the other paths gather the layer's pages,
    a copy of one layer, as for any paged cache.

    Args:
      layer: the layer index: a static int (tuple layout), or a scalar
        integer, concrete or traced (stacked).
      query: (B, T, N, H); k_new, v_new: (B, T, K, H).
      **kwargs: scale, local_window_size, logits_soft_cap, implementation,
        as in ``decode_attention``.

    Returns:
      ``(out, cache)``: out (B, T, N, H); the cache with that layer written
      and ``lengths`` unchanged (call ``advance(T)`` once every layer is
      done).

    Raises:
      TypeError: a traced ``layer`` for the tuple layout, or one that is not
        a scalar integer.
      ValueError: a concrete ``layer`` outside [0, L) (a traced one is
        clamped into it); as ``write`` and ``decode_attention``.
    """
    layer = self._layer("attend", layer)
    lengths = self.lengths + k_new.shape[1]
    if self.stacked:
      k, v, *scales = write(self.k, self.v, self.lengths, k_new, v_new, layer=layer,
                            **self._scales(self.k_scale, self.v_scale))
      k_pages, v_pages, paged = stacked_pages(k, v, layer, *scales)
      out = decode_attention(query, k_pages, v_pages, lengths, **paged, **kwargs)
      return out, dataclasses.replace(self, k=k, v=v, **self._scales(*scales))
    k, v, *scales = write(self.k[layer], self.v[layer], self.lengths, k_new, v_new,
                          **self.layer_scales(layer))
    out = decode_attention(query, k, v, lengths, **self._scales(*scales), **kwargs)
    return out, self.replace_layer(layer, k, v, *scales)

  @staticmethod
  def _scales(k_scale=None, v_scale=None) -> dict:
    """Scales as the keyword arguments of ``write`` and ``decode_attention``;
    empty for a float cache's (None or empty tuples)."""
    if k_scale is None or isinstance(k_scale, tuple) and not k_scale:
      return {}
    return {"k_scale": k_scale, "v_scale": v_scale}

  def layer_scales(self, layer) -> dict:
    """Layer ``layer``'s ``k_scale`` and ``v_scale`` as keyword arguments
    (of ``write`` and ``decode_attention`` over that layer's arrays); empty
    for a float cache. Stacked: the layer's slices ((B, S_max, K) or (1, 1,
    K)), copies of them. ``layer`` as in ``attend``."""
    if not self._scales(self.k_scale, self.v_scale):
      return {}
    layer = self._layer("layer_scales", layer)
    return {"k_scale": self.k_scale[layer], "v_scale": self.v_scale[layer]}

  def replace_layer(self, layer, k, v, k_scale=None, v_scale=None) -> "KVCache":
    """The cache with layer ``layer``'s arrays replaced by ``k`` and ``v``
    (and a quantized cache's scales by ``k_scale`` and ``v_scale``): one
    layer's (B, S_max, K, H) (and scales). Stacked, written into the stacked
    arrays at ``[layer]`` (``layer`` as in ``attend``)."""
    layer = self._layer("replace_layer", layer)
    if self.stacked:
      put = lambda xs, x: xs if x is None else xs.at[layer].set(x)
    else:
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
    if self.num_layers:
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
    if not self.num_layers or not check:  # no layer here (all offloaded): nothing to overflow
      return dataclasses.replace(self, lengths=lengths)
    past_end = lengths > self.max_len
    if not isinstance(past_end, jax.core.Tracer):
      _raise_if_past_end(np.asarray(past_end), self.lengths, T, self.max_len)
    elif host_cpu_device() is not None:
      io_callback(functools.partial(_raise_if_past_end, T=T, S_max=self.max_len), None,
                  past_end, self.lengths)
    return dataclasses.replace(self, lengths=lengths)
