"""A paged KV cache: ``PagedKVCache``, pools of fixed-size pages shared by the
sequences of a batch and addressed through a block table (PagedAttention,
Kwon et al., "Efficient Memory Management for Large Language Model Serving
with PagedAttention", SOSP 2023, Section 4).

Sequences of different lengths share one pool without padding each to the
longest: a sequence holds ``ceil(length / page_size)`` pages, and position j
of sequence b lives at row ``j % page_size`` of page ``block_table[b, j //
page_size]``. Every layer has its own pools (pages, page_size, K, H) and
shares the block table, the lengths and the page allocator. All of it is a
pytree of arrays: the allocator (``reserve``, ``release``) runs inside jit as
array updates, and a whole step (``reserve``, every layer's ``attend``,
``advance``) compiles to one program.
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
from fastattn_jax.attention import seq_lengths
from fastattn_jax.decode import (decode_attention, host_lengths, initial_scales, put_quantized,
                                 remember_lengths)


def _raise_if_short(missing, lengths, T, max_len, pages_free):
  """The host side of the checks: positions past max_len, or too few free pages."""
  lengths = np.asarray(lengths)
  if np.any(lengths + T > max_len):
    raise ValueError(
        f"paged KV cache overflow: writing T={T} new positions at lengths {lengths} goes "
        f"past the block table's max_len={max_len}; create the cache with a larger max_len")
  if int(missing) > int(pages_free):
    raise ValueError(
        f"paged KV cache out of pages: T={T} new positions at lengths {lengths} need "
        f"{int(missing)} new pages, {int(pages_free)} are free; release finished sequences "
        f"or create the cache with more pages")


def check_page_size(caller: str, page_size: int) -> None:
  """Raises ValueError, naming ``caller``, unless ``page_size`` is a power of
  two >= ``shapes.MIN_PAGE_SIZE`` (the kernels' page sizes)."""
  if page_size < shapes.MIN_PAGE_SIZE or page_size & (page_size - 1):
    raise ValueError(f"{caller}: page_size must be a power of two >= {shapes.MIN_PAGE_SIZE}, "
                     f"got {page_size}")


def _pages_after(held, free, lengths, T, page_size, max_len):
  """(held, free) once sequences of ``lengths`` get pages for T more
  positions each (``reserve``): the entries each holds and the pages free,
  on the host; raises ValueError when the positions or the pages do not
  suffice. Held entries are a prefix of each block-table row (``_allocate``
  fills the entries a length needs, ``truncate`` drops those past it)."""
  lengths = np.asarray(lengths)
  need = -(-(lengths + T) // page_size)
  missing = int(np.maximum(need - held, 0).sum())
  _raise_if_short(missing, lengths, T, max_len, free)
  return np.maximum(held, need), free - missing


# Page counts the host knows without reading the block table back: a decode
# step (and ``create``, ``from_prefill``, an eager ``reserve``) records, for
# the block table and refs it returns, each sequence's held entries and the
# free pages, so the next ``check_room`` costs no device round trip, as
# ``decode.remember_lengths`` does for the lengths. Keyed by the id of refs,
# valid while both arrays are the recorded ones, dropped with refs.
_KNOWN_PAGES: dict[int, tuple[weakref.ref, weakref.ref, np.ndarray, int]] = {}


def host_pages(cache: "PagedKVCache") -> tuple[np.ndarray, int]:
  """``(held, free)`` of ``cache`` on the host: (B,) int32 NumPy, the
  block-table entries each sequence holds, and the number of free pages;
  the values recorded for its very block table and refs
  (``remember_pages``), else read back from the device (one round trip)."""
  entry = _KNOWN_PAGES.get(id(cache.refs))
  if entry is not None and entry[0]() is cache.refs and entry[1]() is cache.block_table:
    return entry[2], entry[3]
  held, free = jax.device_get((jnp.sum(cache.block_table >= 0, axis=1, dtype=jnp.int32),
                               jnp.sum(cache.refs == 0)))
  return np.asarray(held), int(free)


def remember_pages(cache: "PagedKVCache", held, free: int) -> None:
  """Records that the (concrete) block table and refs of ``cache`` hold
  ``held`` (B,) entries per sequence and leave ``free`` pages free."""
  key = id(cache.refs)
  # The callback holds the dict itself: it may run at interpreter exit,
  # after the module's globals are gone.
  forget = lambda _, known=_KNOWN_PAGES: known.pop(key, None)
  _KNOWN_PAGES[key] = (weakref.ref(cache.refs, forget),
                       weakref.ref(cache.block_table), np.asarray(held, np.int32), int(free))


def _page_rows(block_table, starts, T: int, page_size: int, num_pages: int):
  """(page, row), each (B, T): where position ``starts[b] + t`` of sequence b
  lives; page ``num_pages`` (out of range: a scatter drops it) where the
  position has no page or is past the table."""
  pos = starts[:, None] + jnp.arange(T)[None, :]
  entry = jnp.clip(pos // page_size, 0, block_table.shape[1] - 1)
  page = jnp.take_along_axis(block_table, entry, axis=1)
  page = jnp.where((page < 0) | (pos >= block_table.shape[1] * page_size), num_pages, page)
  return page, pos % page_size


@functools.partial(jax.jit, static_argnames=("scale", "implementation"), donate_argnums=(1, 2))
def layer_attend(query, k_pool, v_pool, block_table, lengths, k_new, v_new, *, scale,
                 implementation):
  """Writes T new positions into one layer's page pools and attends the T
  queries over them, jitted: ``decode.layer_attend`` for pages (the
  ``PagedKVCache.attend`` of one layer whose pools live apart from the
  allocator, e.g. on the host CPU device: ``offload.OffloadedKVCache``).
  The pages are read in place through the block table (PagedAttention, Kwon
  et al. 2023) by the CPU kernel and the CUDA decode kernel.

  Args:
    query: (B, T, N, H), a floating dtype.
    k_pool, v_pool: (pages, page_size, K, H) of query's dtype; donated.
    block_table: (B, max_pages) int32 with pages for the new positions
      (``PagedKVCache.reserve``).
    lengths: (B,) int32, positions written before this call.
    k_new, v_new: (B, T, K, H).
    scale, implementation: as in ``decode_attention`` (static).

  Returns:
    ``(out, k_pool, v_pool)``: out (B, T, N, H) in query's dtype, and the
    pools with the new positions written.

  Raises:
    ValueError: k_new and v_new not both (B, T, K, H) with the pools' K and
      H; ValueError, TypeError: as ``decode_attention``.
  """
  expected = (query.shape[0], query.shape[1], *k_pool.shape[2:])
  if k_new.shape != expected or v_new.shape != expected:
    raise ValueError(f"paged.layer_attend: k_new and v_new must be (B, T, K, H) = {expected} "
                     f"(query's B, T and the pools' K, H), got {k_new.shape} and {v_new.shape}")
  page, row = _page_rows(block_table, lengths, k_new.shape[1], k_pool.shape[1], k_pool.shape[0])
  k_pool = k_pool.at[page, row].set(k_new.astype(k_pool.dtype), mode="drop")
  v_pool = v_pool.at[page, row].set(v_new.astype(v_pool.dtype), mode="drop")
  out = decode_attention(query, k_pool, v_pool, lengths + k_new.shape[1], block_table=block_table,
                         scale=scale, implementation=implementation)
  return out, k_pool, v_pool


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
  """Every layer's key/value page pools, the block table, the lengths and the
  page allocator of a batch of sequences.

  A pytree: pass it through ``jax.jit`` (donate it, so the pools are updated
  in place) and ``lax.scan``.

  Attributes:
    k, v: tuples of per-layer pools, (pages, page_size, K, H).
    block_table: (B, max_pages) int32: sequence b's pages in order; -1 where
      none is allocated.
    lengths: (B,) int32, positions of each sequence written so far.
    refs: (pages,) int32, how many block-table entries hold each page (0:
      free). A page is shared where a prefix is (``share_prefix``).
    page_size: positions per page (static: part of the pytree's structure).
    k_scale, v_scale: a quantized cache's per-layer scales, float32:
      (pages, page_size, K) for int8, (1, 1, K) for float8_e4m3fn
      (``decode.quantize``); empty tuples for a float cache.
  """

  k: tuple
  v: tuple
  block_table: jax.Array
  lengths: jax.Array
  refs: jax.Array
  page_size: int = dataclasses.field(metadata=dict(static=True))
  k_scale: tuple = ()
  v_scale: tuple = ()

  @classmethod
  def create(cls, num_layers: int, batch: int, num_pages: int, page_size: int, kv_heads: int,
             head_dim: int, *, max_len: int | None = None, dtype=jnp.bfloat16,
             device=None) -> "PagedKVCache":
    """An empty cache: zero-filled pools, every page free, every length 0.

    Args:
      num_layers, batch, kv_heads, head_dim: L, B, K, H; L may be 0 (the
        allocator alone, for layers whose pools live elsewhere:
        ``offload.OffloadedKVCache``).
      num_pages: pages in each layer's pool.
      page_size: positions per page, a power of two >= 16
        (``shapes.MIN_PAGE_SIZE``).
      max_len: the most positions one sequence may hold (the block table's
        width times page_size, rounded up); default: the whole pool.
      dtype: the pools' dtype; int8 or float8_e4m3fn makes a quantized
        cache (``decode.quantize``), whose int8 scales start at 0 and float8
        scales at 1 per head.
      device: a ``jax.Device`` or ``jax.sharding.Sharding`` for the arrays.

    Raises:
      ValueError: non-positive sizes (a negative num_layers), or a page size
        that is not a power of two >= 16.
    """
    if int(num_layers) < 0:
      raise ValueError(f"PagedKVCache.create: num_layers must be >= 0, got {num_layers}")
    for name, x in (("batch", batch), ("num_pages", num_pages), ("kv_heads", kv_heads),
                    ("head_dim", head_dim)):
      if int(x) <= 0:
        raise ValueError(f"PagedKVCache.create: {name} must be positive, got {x}")
    check_page_size("PagedKVCache.create", page_size)
    max_len = num_pages * page_size if max_len is None else int(max_len)
    if max_len <= 0:
      raise ValueError(f"PagedKVCache.create: max_len must be positive, got {max_len}")
    where = sharding_of(device)
    pool = jax.jit(lambda: jnp.zeros((num_pages, page_size, kv_heads, head_dim), dtype),
                   out_shardings=where)
    small = jax.jit(lambda: (jnp.full((batch, -(-max_len // page_size)), -1, jnp.int32),
                             jnp.zeros((batch,), jnp.int32), jnp.zeros((num_pages,), jnp.int32)),
                    out_shardings=where)
    table, lengths, refs = small()
    k_scale, v_scale = initial_scales(dtype, (num_pages, page_size), kv_heads, num_layers, where)
    cache = cls(k=tuple(pool() for _ in range(num_layers)),
                v=tuple(pool() for _ in range(num_layers)), block_table=table, lengths=lengths,
                refs=refs, page_size=page_size, k_scale=k_scale, v_scale=v_scale)
    if not isinstance(lengths, jax.core.Tracer):  # created inside a caller's jit
      remember_lengths(lengths, np.zeros(batch, np.int32))
      remember_pages(cache, np.zeros(batch, np.int32), num_pages)
    return cache

  @classmethod
  def from_prefill(cls, k, v, lengths, *, num_pages: int, page_size: int,
                   max_len: int | None = None, dtype=None) -> "PagedKVCache":
    """The cache of a prefill: each sequence's first ``lengths[b]``
    positions of every layer, in pages allocated for them.

    Args:
      k, v: (L, B, P, K, H), a prefill's keys (RoPE applied) and values.
      lengths: (B,) integer, each sequence's valid positions (<= P).
      num_pages, page_size, max_len: as in ``create``.
      dtype: the pools' dtype, default k's (int8 or float8_e4m3fn: quantized,
        as ``create`` and ``write_layer`` do it).

    Raises:
      ValueError: k and v of other shapes or ranks, lengths outside [0, P],
        too few pages (as ``check_room``).
    """
    if k.ndim != 5 or k.shape != v.shape:
      raise ValueError(f"PagedKVCache.from_prefill: k and v must both be (L, B, P, K, H), "
                       f"got {k.shape} and {v.shape}")
    L, B, P, K, H = k.shape
    lengths = seq_lengths("lengths", lengths, B, P)
    cache = cls.create(L, B, num_pages, page_size, K, H, dtype=k.dtype if dtype is None else dtype,
                       max_len=max(P, 1) if max_len is None else max_len, device=k.sharding)
    known = not isinstance(lengths, jax.core.Tracer)
    if known:
      # A copy: on a CPU device np.asarray would view the array's buffer, and
      # the record would keep the array it is about alive.
      values = np.array(lengths)
      pages = cache.pages_after(values)
    cache = cache._allocate(lengths)
    if known:
      remember_pages(cache, *pages)
      remember_lengths(lengths, values)
    starts = jnp.zeros_like(cache.lengths)
    # Positions past a sequence's length have no page and are not written.
    for i in range(L):
      cache = cache.replace_layer(i, *cache.write_layer(i, k[i], v[i], starts))
    return dataclasses.replace(cache, lengths=lengths)

  @property
  def num_layers(self) -> int:
    return len(self.k)

  @property
  def num_pages(self) -> int:
    return self.refs.shape[0]

  @property
  def max_len(self) -> int:
    return self.block_table.shape[1] * self.page_size

  def _pages_needed(self, lengths):
    """(B, max_pages) bool: entries a sequence of ``lengths`` needs."""
    return jnp.arange(self.block_table.shape[1])[None, :] * self.page_size < lengths[:, None]

  def reserve(self, T: int) -> "PagedKVCache":
    """The cache with pages allocated for T more positions of every sequence
    (once per step, before the layers' ``attend``): each entry a sequence
    newly needs takes the lowest-numbered free page.

    Raises:
      ValueError: for concrete lengths (outside jit) when the positions or
        pages do not suffice (``check_room``); under jit the step checks
        that in ``advance``.
    """
    if isinstance(self.lengths, jax.core.Tracer):
      return self._allocate(self.lengths + T)
    pages = self.pages_after(T)
    cache = self._allocate(self.lengths + T)
    remember_pages(cache, *pages)
    return cache

  def _allocate(self, lengths) -> "PagedKVCache":
    """Pages for every entry sequences of ``lengths`` need and lack."""
    new = self._pages_needed(lengths) & (self.block_table < 0)
    flat = new.reshape(-1)
    rank = jnp.cumsum(flat) - 1
    free = jnp.nonzero(self.refs == 0, size=self.num_pages, fill_value=self.num_pages)[0]
    taken = jnp.where(flat, free[jnp.clip(rank, 0, self.num_pages - 1)], self.num_pages)
    table = jnp.where(new, taken.reshape(new.shape), self.block_table)
    # Short of pages, the entry stays -1 (``advance`` reports it under jit).
    table = jnp.where(table >= self.num_pages, -1, table)
    refs = self.refs.at[taken].add(1, mode="drop")
    return dataclasses.replace(self, block_table=table, refs=refs)

  def release(self, sequences) -> "PagedKVCache":
    """The cache with sequences ``sequences`` emptied: their pages returned to
    the pool (a shared page once no sequence holds it), their block-table
    rows -1 and lengths 0, ready for new sequences.

    Args:
      sequences: (B,) bool, True for the sequences to release.
    """
    sequences = jnp.asarray(sequences, bool)
    if sequences.shape != self.lengths.shape:
      raise ValueError(f"PagedKVCache.release: sequences must have shape "
                       f"{self.lengths.shape}, got {sequences.shape}")
    return self.truncate(jnp.where(sequences, 0, self.lengths))

  def truncate(self, lengths) -> "PagedKVCache":
    """The cache with each sequence cut to ``lengths[b]`` (<= its length)
    positions, the pages past them returned to the pool.

    Args:
      lengths: (B,) integer.
    """
    lengths = jnp.minimum(seq_lengths("lengths", lengths, self.lengths.shape[0]), self.lengths)
    drop = ~self._pages_needed(lengths) & (self.block_table >= 0)
    refs = self.refs.at[jnp.where(drop, self.block_table, self.num_pages)].add(-1, mode="drop")
    return dataclasses.replace(self, block_table=jnp.where(drop, -1, self.block_table),
                               lengths=lengths, refs=refs)

  def share_prefix(self, source: int, target: int, length: int) -> "PagedKVCache":
    """Sequence ``target`` (empty) starts with the first ``length`` positions
    of sequence ``source`` (a shared prompt): their whole pages are shared,
    not copied; ``length`` must be a multiple of page_size so no page is
    written by both.

    Raises:
      ValueError: ``length`` not a multiple of page_size, or past the
        source's length (concrete lengths).
    """
    if length % self.page_size:
      raise ValueError(f"PagedKVCache.share_prefix: length={length} must be a multiple of "
                       f"page_size={self.page_size}")
    if not isinstance(self.lengths, jax.core.Tracer) and length > int(self.lengths[source]):
      raise ValueError(f"PagedKVCache.share_prefix: length={length} is past sequence "
                       f"{source}'s length {int(self.lengths[source])}")
    n = length // self.page_size
    pages = self.block_table[source, :n]
    table = self.block_table.at[target, :n].set(pages)
    return dataclasses.replace(self, block_table=table,
                               lengths=self.lengths.at[target].set(length),
                               refs=self.refs.at[pages].add(1))

  def write_layer(self, layer: int, k_new, v_new, starts=None):
    """Layer ``layer``'s pools with T new positions written: position
    ``starts[b] + t`` (default: ``lengths[b] + t``) of sequence b gets
    ``k_new[b, t]`` and ``v_new[b, t]``, in the page the block table names
    (``reserve`` first). One scatter per pool (and per int8 scale pool).

    Args:
      layer: the layer index (static).
      k_new, v_new: (B, T, K, H); cast to the pools' dtype, or quantized
        (``decode.quantize``) for a quantized cache.
      starts: (B,) int32, or None for ``lengths``.

    Returns:
      ``(k_pool, v_pool)``; for a quantized cache ``(k_pool, v_pool,
      k_scale, v_scale)``.
    """
    B = self.lengths.shape[0]
    K, H = self.k[layer].shape[2:]
    if k_new.ndim != 4 or k_new.shape != v_new.shape or k_new.shape[0] != B or \
        k_new.shape[2:] != (K, H):
      raise ValueError(f"PagedKVCache: k_new and v_new must be (B, T, K, H) = ({B}, T, {K}, "
                       f"{H}), got {k_new.shape} and {v_new.shape}")
    # A position without a page (out of pages or past max_len: reported by
    # ``advance``) writes nowhere.
    page, row = _page_rows(self.block_table, self.lengths if starts is None else starts,
                           k_new.shape[1], self.page_size, self.num_pages)

    def put(pool, new):
      return pool.at[page, row].set(new.astype(pool.dtype), mode="drop")

    if not self.k_scale:
      return put(self.k[layer], k_new), put(self.v[layer], v_new)
    k, k_scale = put_quantized(put, self.k[layer], self.k_scale[layer], k_new)
    v, v_scale = put_quantized(put, self.v[layer], self.v_scale[layer], v_new)
    return k, v, k_scale, v_scale

  def replace_layer(self, layer: int, k, v, k_scale=None, v_scale=None) -> "PagedKVCache":
    """The cache with layer ``layer``'s pools replaced by ``k`` and ``v``
    (and a quantized cache's scales by ``k_scale`` and ``v_scale``)."""
    put = lambda xs, x: xs if x is None else xs[:layer] + (x,) + xs[layer + 1:]
    return dataclasses.replace(self, k=put(self.k, k), v=put(self.v, v),
                               k_scale=put(self.k_scale, k_scale),
                               v_scale=put(self.v_scale, v_scale))

  def attend(self, layer: int, query, k_new, v_new, **kwargs):
    """Writes T new positions into ``layer`` and attends the T queries over
    the sequence (``decode_attention`` with the block table; the pages
    ``reserve``d for this step).

    Args:
      layer: the layer index (static).
      query: (B, T, N, H); k_new, v_new: (B, T, K, H).
      **kwargs: scale, local_window_size, logits_soft_cap, implementation,
        as in ``decode_attention``.

    Returns:
      ``(out, cache)``: out (B, T, N, H); the cache with that layer written
      and ``lengths`` unchanged (call ``advance(T)`` once every layer is
      done).
    """
    k, v, *scales = self.write_layer(layer, k_new, v_new)
    out = decode_attention(query, k, v, self.lengths + k_new.shape[1],
                           block_table=self.block_table,
                           **dict(zip(("k_scale", "v_scale"), scales)), **kwargs)
    return out, self.replace_layer(layer, k, v, *scales)

  def pages_after(self, T) -> tuple[np.ndarray, int]:
    """On the host: ``(held, free)`` once ``reserve(T)`` has run, (B,) int32
    NumPy entries each sequence holds and the free pages (a decode step
    records them for its result, ``remember_pages``). Reads nothing from
    the device where the lengths (``decode.remember_lengths``) and pages
    (``remember_pages``) of these very arrays are recorded (a decode step,
    ``create``, ``from_prefill`` and an eager ``reserve`` record them;
    ``release``, ``truncate`` and ``share_prefix`` do not), else one round
    trip each.

    Args:
      T: new positions per sequence, an int or (B,) integer.

    Raises:
      ValueError: as ``check_room``.
    """
    held, free = host_pages(self)
    return _pages_after(held, free, host_lengths(self.lengths), T, self.page_size, self.max_len)

  def check_room(self, T: int) -> bool:
    """Checks on the host, before a step, that T more positions fit: within
    ``max_len`` and within the free pages (``reserve``), from the lengths
    and page counts recorded on the host (``pages_after``): no device round
    trip in the steady state of ``offload.decode_step``.

    Returns:
      True when checked; False when the lengths are traced (inside a
      caller's jit): then only ``advance`` can check.

    Raises:
      ValueError: when a length would pass ``max_len`` or the pool is short.
    """
    if isinstance(self.lengths, jax.core.Tracer):
      return False
    self.pages_after(T)
    return True

  def advance(self, T: int, *, check: bool = True) -> "PagedKVCache":
    """The cache with every length grown by T (the step's new positions).

    Raises:
      ValueError: as ``check_room``, at once for concrete lengths; under jit
        when the step runs, through a host callback (needs a CPU backend),
        unless ``check=False`` (the caller ran ``check_room(T)``).
    """
    lengths = self.lengths + T
    if check:
      # After ``reserve``: every needed entry of the grown lengths has a page.
      missing = jnp.sum(self._pages_needed(lengths) & (self.block_table < 0))
      if not isinstance(lengths, jax.core.Tracer):
        _raise_if_short(missing, self.lengths, T, self.max_len, 0)
      elif host_cpu_device() is not None:
        io_callback(functools.partial(_raise_if_short, T=T, max_len=self.max_len,
                                      pages_free=0), None, missing, self.lengths)
    return dataclasses.replace(self, lengths=lengths)
