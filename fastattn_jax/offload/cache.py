"""A decoder's KV cache placed by an ``OffloadPlan``, and the attention of one layer over it.

``OffloadedKVCache`` holds the device-resident layers as a
``fastattn_jax.decode.KVCache`` (a plan with a page size: a
``fastattn_jax.PagedKVCache``, whose allocator serves every layer) and serves
the host-resident ones in the plan's mode: "stream" (prefix copied from
pinned host memory, merged with a device tail by log-sum-exp) or "host"
(write and attention on the host CPU; a paged layer's pools live there and
the CPU kernel reads them in place through a copy of the block table).
It follows ``KVCache``'s functional contract: ``attend`` and ``advance``
return the updated cache. The placement and the two modes are FastAttention's
CPU-GPU cooperative strategy (Lin et al. 2024); see ``fastattn_jax.offload``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Callable

import jax
import jax.numpy as jnp
import numpy as np

from fastattn_jax import decode, paged
from fastattn_jax._util import host_cpu_device, sharding_of
from fastattn_jax.attention import fast_attention
from fastattn_jax.decode import KVCache, decode_attention, write
from fastattn_jax.paged import PagedKVCache

if TYPE_CHECKING:
  from fastattn_jax.offload.planner import OffloadPlan


def _merge(out_a, lse_a, out_b, lse_b, dtype):
  """Softmax-weighted merge of two attention partials over disjoint key sets."""
  m = jnp.maximum(lse_a, lse_b)
  m = jnp.where(jnp.isneginf(m), 0.0, m)
  w_a, w_b = jnp.exp(lse_a - m)[..., None], jnp.exp(lse_b - m)[..., None]
  total = w_a + w_b
  merged = (w_a * out_a.astype(jnp.float32) + w_b * out_b.astype(jnp.float32)) / jnp.where(
      total == 0, 1.0, total)
  return merged.astype(dtype)


@functools.partial(jax.jit, static_argnames=("scale", "implementation"), donate_argnums=(3, 4))
def _stream_attend(query, prefix_k, prefix_v, tail_k, tail_v, prefix_lengths, tail_lengths,
                   k_new, v_new, *, scale, implementation):
  """Attention over a streamed prefix (all of it visible) and a device tail (causal)."""
  T = query.shape[1]
  tail_k, tail_v = write(tail_k, tail_v, tail_lengths, k_new, v_new)
  if T == 1:
    out_p, lse_p = decode_attention(query, prefix_k, prefix_v, prefix_lengths, scale=scale,
                                    return_residual=True, implementation=implementation)
  else:
    out_p, lse_p = fast_attention(query, prefix_k, prefix_v, key_value_seq_lengths=prefix_lengths,
                                  scale=scale, return_residual=True,
                                  implementation=implementation)
  out_t, lse_t = decode_attention(query, tail_k, tail_v, tail_lengths + T, scale=scale,
                                  return_residual=True, implementation=implementation)
  return _merge(out_p, lse_p, out_t, lse_t, query.dtype), tail_k, tail_v


#: ``PagedKVCache.reserve`` of the device cache, one jitted call a step.
_reserve = jax.jit(PagedKVCache.reserve, static_argnums=1, donate_argnums=0)


def _layer_attend(query, k, v, block_table, lengths, k_new, v_new, *, scale, implementation):
  """``decode.layer_attend``, or ``paged.layer_attend`` through ``block_table`` (not None)."""
  if block_table is None:
    return decode.layer_attend(query, k, v, lengths, k_new, v_new, scale=scale,
                               implementation=implementation)
  return paged.layer_attend(query, k, v, block_table, lengths, k_new, v_new, scale=scale,
                            implementation=implementation)


def _host_copy(block_table, host_device):
  """A copy of ``block_table`` on ``host_device``, never the same buffer (on a CPU
  backend the host device is the device, whose table the next step donates)."""
  return jax.device_put(block_table, host_device, may_alias=False)


def _read_only(lengths: np.ndarray) -> np.ndarray:
  lengths.setflags(write=False)
  return lengths


# Compared by identity and printed without its arrays (caches of many GiB).
@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class OffloadedKVCache:
  """A decoder's KV cache placed by an ``OffloadPlan``: device layers, host layers, lengths.

  The contract of ``fastattn_jax.decode.KVCache``: ``attend`` returns
  ``(out, cache)`` and ``advance`` the cache, each a new value; the cache
  passed in must not be used afterwards, as an argument donated to a jitted
  call (its arrays of the layer written are donated and updated in place, so
  nothing is copied; streaming state carries over to the new value). Not a
  pytree: it holds host-side state and runs its own jitted calls. Made by
  ``build``; ``offload.decode_step`` runs a decoder's step over it.

  A plan with a page size (``plan_offload(..., page_size=...)``) makes a
  paged cache: every layer a pool of ``plan.num_pages`` pages, one block
  table, one allocator (``PagedKVCache``) kept on the device with the
  device-resident layers (with none, it is the allocator alone). A step
  (``reserve``) allocates the pages of every layer there and copies the
  block table (B x max_pages int32) to the host CPU device, where each
  host-resident layer's pools are written and read in place by the CPU
  kernel (``decode_attention(..., block_table=..., implementation="cpu")``).
  ``release`` returns sequences' pages to the pool of every layer; the next
  ``reserve`` copies the table it leaves.

  Attributes:
    plan: the ``OffloadPlan`` it follows.
    device: the device-resident layers' caches, a ``KVCache`` (slot i holds
      layer ``plan.device_layers[i]``) with ``lengths`` on the device; for
      a paged plan a ``PagedKVCache`` with the block table, lengths and
      page refcounts of every layer.
    host_k, host_v: per host-resident layer, (B, context, K, H) in pinned
      host memory ("stream") or (B, S_max, K, H) on the host CPU device
      ("host"; paged: pools of (pages, page_size, K, H)), the plan's dtype.
    tails: "stream": per host-resident layer, the device-resident (k, v) of
      (B, S_max - context, K, H) for the positions decoded since the prefix.
    lengths: (B,) int32 numpy (read-only), positions written in every layer.
    accelerator: the ``jax.Device`` the device layers, queries and outputs
      are on.
    host_device: the CPU ``jax.Device`` of mode "host" (else unused).
    host_table: a paged plan's block table copied to ``host_device``, as of
      the last ``reserve`` (None without host-resident paged layers).
  """

  plan: OffloadPlan
  device: KVCache
  host_k: dict
  host_v: dict
  tails: dict
  lengths: np.ndarray
  accelerator: jax.Device
  host_device: jax.Device | None
  host_table: jax.Array | None = None
  # "stream": device copies (k, v) of the prefixes in flight, by layer, and the
  # output of the last streamed layer (waited for before the next prefix is
  # staged, so at most two prefixes take device memory).
  _staged: dict = dataclasses.field(default_factory=dict)
  _last_stream_out: jax.Array | None = None

  @classmethod
  def build(cls, plan: OffloadPlan, fill: Callable[[int, int], tuple], *, device=None,
            host_device=None, on_layer: Callable[[int], None] | None = None) -> "OffloadedKVCache":
    """Fills each layer's cache from ``fill`` and places it as ``plan`` says, one layer at a time.

    Host-resident layers come first, each copied to host memory and waited for
    before the next is made, so at most one layer's fill is in device memory
    beyond the plan's.

    Args:
      plan: from ``plan_offload``.
      fill: ``fill(layer, length) -> (k, v)``, each (B, length, K, H) of the
        plan's dtype on ``device``, ``length`` >= ``plan.context``; positions
        [0, plan.context) are the prefix, later ones are never read before
        being written. A paged plan asks for ``plan.context`` positions and
        writes them into the pages it reserves for them, the lowest-numbered
        first (``PagedKVCache.reserve``).
      device: the accelerator (default ``jax.devices()[0]``).
      host_device: the CPU device for mode "host" (default
        ``offload.host_cpu_device()``).
      on_layer: called with each layer's index once it is placed (a
        progress bar's hook).

    Returns:
      The cache, ``lengths`` = context for every sequence.

    Raises:
      ValueError: ``fill`` returned arrays of another shape or dtype, or
        mode "host" without a CPU device.
    """
    device = device or jax.devices()[0]
    if plan.mode == "host":
      host_device = host_cpu_device() if host_device is None else host_device
      if host_device is None:
        raise ValueError("OffloadedKVCache.build: mode 'host' needs a CPU device, and JAX has "
                         "none (JAX_PLATFORMS excludes cpu?)")
    B, K, H = plan.batch, plan.kv_heads, plan.head_dim
    expected = lambda length: (B, length, K, H)

    def get(layer, length):
      k, v = fill(layer, length)
      for name, x in (("k", k), ("v", v)):
        if x.shape != expected(length) or jnp.dtype(x.dtype).name != plan.dtype:
          raise ValueError(f"OffloadedKVCache.build: fill({layer}, {length}) gave {name} of "
                           f"{x.shape} {x.dtype}, expected {expected(length)} {plan.dtype}")
      return k, v

    if plan.page_size is None:
      whole_layer = lambda layer: get(layer, plan.max_len)
    else:
      # The allocator alone, with pages for the prefix; then each layer's pools.
      allocator = PagedKVCache.create(0, B, plan.num_pages, plan.page_size, K, H,
                                      max_len=plan.max_len, dtype=plan.dtype,
                                      device=device).reserve(plan.context)
      zero_pool = jax.jit(lambda: jnp.zeros((plan.num_pages, plan.page_size, K, H), plan.dtype),
                          out_shardings=sharding_of(device))

      def whole_layer(layer):
        pools = dataclasses.replace(allocator, k=(zero_pool(),), v=(zero_pool(),))
        return pools.write_layer(0, *get(layer, plan.context))

    host_k, host_v, tails = {}, {}, {}
    zero_tail = jax.jit(lambda: jnp.zeros(expected(plan.max_len - plan.context), plan.dtype),
                        out_shardings=sharding_of(device))
    device_k, device_v = [], []
    order = (*plan.host_layers, *plan.device_layers)
    for layer in order:
      if layer in plan.host_layers:
        if plan.mode == "stream":
          target = sharding_of(device, "pinned_host")
          k, v = get(layer, plan.context)
          tails[layer] = (zero_tail(), zero_tail())
        else:
          target = host_device
          k, v = whole_layer(layer)
        host_k[layer], host_v[layer] = jax.block_until_ready(
            (jax.device_put(k, target), jax.device_put(v, target)))
        del k, v
      else:
        k, v = whole_layer(layer)
        device_k.append(jax.block_until_ready(k))
        device_v.append(jax.block_until_ready(v))
      if on_layer is not None:
        on_layer(layer)
    lengths = np.full((B,), plan.context, np.int32)
    on_device = jax.device_put(lengths, device)
    decode.remember_lengths(on_device, lengths)
    if plan.page_size is None:
      device_cache, host_table = KVCache(k=tuple(device_k), v=tuple(device_v),
                                         lengths=on_device), None
    else:
      device_cache = dataclasses.replace(allocator, k=tuple(device_k), v=tuple(device_v),
                                         lengths=on_device)
      host_table = _host_copy(allocator.block_table, host_device) if plan.host_layers else None
    return cls(plan, device_cache, host_k, host_v, tails, _read_only(lengths),
               accelerator=device, host_device=host_device, host_table=host_table)

  @property
  def num_layers(self) -> int:
    """L, device- and host-resident layers together."""
    return self.plan.num_layers

  @property
  def max_len(self) -> int:
    """S_max, the positions each layer has room for."""
    return self.plan.max_len

  def slot(self, layer: int) -> int | None:
    """The index of ``layer`` in ``device`` (None for a host-resident layer)."""
    return self.plan.device_layers.index(layer) if layer in self.plan.device_layers else None

  def check_room(self, T: int) -> None:
    """Raises ValueError unless T more positions fit (lengths + T <= plan.max_len; a
    paged cache also within its free pages, ``PagedKVCache.check_room``), on the host."""
    if np.any(self.lengths + T > self.plan.max_len):
      raise ValueError(
          f"KV cache overflow: writing T={T} new positions at lengths {self.lengths} goes "
          f"past S_max={self.plan.max_len} (context {self.plan.context} + "
          f"{self.plan.max_len - self.plan.context} new positions planned)")
    if isinstance(self.device, PagedKVCache):
      self.device.check_room(T)

  def reserve(self, T: int) -> "OffloadedKVCache":
    """The cache with room for T more positions of every sequence (once per
    step, before the layers' ``attend``; ``offload.decode_step`` calls it):
    checked on the host (``check_room``); a paged cache's pages allocated
    for them in every layer (``PagedKVCache.reserve``, one jitted call on
    the device) and its block table copied to the host CPU device for the
    host-resident layers. This cache must not be used afterwards.

    Raises:
      ValueError: as ``check_room``.
    """
    self.check_room(T)
    if not isinstance(self.device, PagedKVCache):
      return self
    pages = self.device.pages_after(T)
    device = _reserve(self.device, T)
    paged.remember_pages(device, *pages)
    table = None if self.host_table is None else _host_copy(device.block_table, self.host_device)
    return dataclasses.replace(self, device=device, host_table=table)

  def attend(self, layer: int, query, k_new, v_new, *, scale=None, implementation=None):
    """Writes T new positions into ``layer`` and attends the T queries over its cache.

    Same result as ``KVCache.attend`` (causal among the new tokens, aligned to
    the end of each sequence); a device-resident layer is one jitted call, a
    host-resident one is served as the plan's mode says.

    Args:
      layer: the layer index.
      query: (B, T, N, H) on the device; k_new, v_new: (B, T, K, H) there,
        the plan's dtype.
      scale: as in ``decode_attention``.
      implementation: for device-resident and streamed layers, as in
        ``decode_attention``; host-computed layers use "cpu".

    Returns:
      ``(out, cache)``: out (B, T, N, H) on the device in query's dtype; the
      cache with that layer written and ``lengths`` unchanged (call
      ``advance(T)`` once every layer is done). This cache must not be used
      afterwards (its arrays of ``layer`` are donated).

    Raises:
      ValueError: positions past ``plan.max_len``, a paged cache's new
        positions without pages (``reserve`` first), a layer out of range,
        or shapes that do not fit (as ``decode_attention``).
    """
    if not 0 <= layer < self.plan.num_layers:
      raise ValueError(f"attend: layer must be in [0, {self.plan.num_layers}), got {layer}")
    T = k_new.shape[1]
    self.check_room(T)
    # Reserved: the pages T more positions need are held, none is missing.
    if isinstance(self.device, PagedKVCache) and \
        self.device.pages_after(T)[1] != paged.host_pages(self.device)[1]:
      raise ValueError(f"attend: the T={T} new positions have no pages yet; call reserve({T}) "
                       f"first (offload.decode_step does)")
    slot = self.slot(layer)
    if slot is not None:
      out, k, v = _layer_attend(query, self.device.k[slot], self.device.v[slot],
                                self.device.block_table if isinstance(self.device, PagedKVCache)
                                else None, self.device.lengths,
                                k_new, v_new, scale=scale, implementation=implementation)
      return out, dataclasses.replace(self, device=self.device.replace_layer(slot, k, v))
    if self.plan.mode == "host":
      q, kn, vn = (jax.device_put(x, self.host_device) for x in (query, k_new, v_new))
      out, k, v = _layer_attend(q, self.host_k[layer], self.host_v[layer], self.host_table,
                                self.lengths, kn, vn, scale=scale, implementation="cpu")
      return jax.device_put(out, self.accelerator), dataclasses.replace(
          self, host_k={**self.host_k, layer: k}, host_v={**self.host_v, layer: v})
    return self._attend_streamed(layer, query, k_new, v_new, scale, implementation)

  def _stage(self, layer):
    target = sharding_of(self.accelerator, "device")
    return (jax.device_put(self.host_k[layer], target),
            jax.device_put(self.host_v[layer], target))

  def _attend_streamed(self, layer, query, k_new, v_new, scale, implementation):
    staged = dict(self._staged)
    prefix = staged.pop(layer, None) or self._stage(layer)
    # Bound the prefixes in device memory to two (this one and the next): the
    # previous streamed layer's buffers are freed once its attention is done.
    if self._last_stream_out is not None:
      jax.block_until_ready(self._last_stream_out)
    hosts = self.plan.host_layers
    following = hosts[(hosts.index(layer) + 1) % len(hosts)]
    if following not in staged:
      staged[following] = self._stage(following)
    prefix_lengths = np.full_like(self.lengths, self.plan.context)
    out, tail_k, tail_v = _stream_attend(
        query, *prefix, *self.tails[layer], prefix_lengths, self.lengths - prefix_lengths,
        k_new, v_new, scale=scale, implementation=implementation)
    return out, dataclasses.replace(self, tails={**self.tails, layer: (tail_k, tail_v)},
                                    _staged=staged, _last_stream_out=out)

  def advance(self, T: int) -> "OffloadedKVCache":
    """The cache with every length grown by T (the step's new positions), here and in
    ``device``, checked on the host (``check_room``: no device round trip); this
    cache must not be used afterwards.

    Raises:
      ValueError: a length would pass ``plan.max_len``, or a paged cache's
        positions lack pages (``reserve`` first).
    """
    self.check_room(T)
    lengths = _read_only(self.lengths + T)
    device = self.device.advance(T, check=False)
    decode.remember_lengths(device.lengths, lengths)
    return dataclasses.replace(self, lengths=lengths, device=device)

  def release(self, sequences) -> "OffloadedKVCache":
    """A paged cache with sequences ``sequences`` emptied in every layer
    (``PagedKVCache.release``: their pages back in the pool, lengths 0),
    ready for new sequences; this cache must not be used afterwards.

    Args:
      sequences: (B,) bool, True for the sequences to release.

    Raises:
      ValueError: a cache without pages (a plan without ``page_size``), or
        ``sequences`` of another shape.
    """
    if not isinstance(self.device, PagedKVCache):
      raise ValueError("OffloadedKVCache.release: a contiguous cache has no pages to release; "
                       "plan it with page_size")
    sequences = np.asarray(sequences, bool)
    device = self.device.release(sequences)
    lengths = _read_only(np.where(sequences, 0, self.lengths).astype(np.int32))
    decode.remember_lengths(device.lengths, lengths)
    return dataclasses.replace(self, device=device, lengths=lengths)

  def device_bytes(self) -> int:
    """Bytes of KV resident in device memory (device layers and stream tails)."""
    arrays = [*self.device.k, *self.device.v, *(x for pair in self.tails.values() for x in pair)]
    return int(sum(x.nbytes for x in arrays))

  def host_bytes(self) -> int:
    """Bytes of KV resident in host memory (pinned host or CPU device arrays)."""
    return int(sum(x.nbytes for x in (*self.host_k.values(), *self.host_v.values())))
