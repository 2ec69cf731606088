"""One decode step of a decoder over a KV cache whose layers may be offloaded: the scheduler.

A decoder layer computes its attention inputs (projections, position
encoding) from the residual stream, attends over its cache, then computes the
rest (output projection, feed-forward, residuals). ``decode_step`` runs the
layers of any model described by a ``Decoder`` over a
``KVCache`` or ``PagedKVCache`` (all layers in one jitted call) or an
``OffloadedKVCache``: there, each run of consecutive device-resident layers is
one jitted call with their caches donated, and each host-resident layer runs
its projections on the device and its attention through
``OffloadedKVCache.attend`` (streamed to the device, or computed on the host
CPU, as the plan's mode says), after FastAttention's CPU-GPU cooperative
strategy (Lin et al. 2024).

Shapes: B batch, T new tokens, D model width, N query heads, K key/value
heads, H head dim, V vocabulary, L layers.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from fastattn_jax import decode, paged
from fastattn_jax.decode import KVCache
from fastattn_jax.offload.cache import OffloadedKVCache
from fastattn_jax.paged import PagedKVCache


@dataclasses.dataclass(frozen=True)
class Decoder:
  """A decoder model's functions, as ``decode_step`` calls them (traced under ``jax.jit``).

  A static argument of the jitted calls: make one per model shape and reuse
  it (the fields compare by identity), or every step compiles again.

  Attributes:
    embed: ``embed(top, tokens) -> x``: tokens (B, T) integer to the
      residual stream (B, T, D).
    attention_inputs: ``attention_inputs(layer_params, x, positions) -> (q,
      k, v)``: q (B, T, N, H), k and v (B, T, K, H) of the cache's dtype, for
      the new tokens at cache positions ``positions`` (B, T) int32.
    attention_output: ``attention_output(layer_params, x, attn) -> x``: the
      rest of the layer, from the attention output (B, T, N, H) and the
      layer's input x (B, T, D).
    head: ``head(top, x) -> logits`` (B, T, V).
    layer: None, or ``layer(layer_params, x, cache_k, cache_v, lengths,
      positions, implementation) -> (x, cache_k, cache_v)``: a whole layer
      over its device-resident cache (B, S_max, K', H) with ``lengths``
      written so far, in place of the three functions above (e.g. a
      tensor-parallel layer, whose projections, attention and all-reduce are
      one block, ``fastattn_jax.parallel.attention_block``). Such a decoder
      runs over a ``KVCache`` only.
  """

  embed: Callable
  attention_inputs: Callable | None
  attention_output: Callable | None
  head: Callable
  layer: Callable | None = None

  def run_layer(self, p, x, cache: KVCache | PagedKVCache, slot: int, positions,
                implementation):
    """One layer over slot ``slot`` of ``cache``: ``(x, cache)``, lengths unchanged."""
    if self.layer is None:
      q, k, v = self.attention_inputs(p, x, positions)
      attn, cache = cache.attend(slot, q, k, v, implementation=implementation)
      return self.attention_output(p, x, attn), cache
    x, k, v = self.layer(p, x, cache.k[slot], cache.v[slot], cache.lengths, positions,
                         implementation)
    return x, cache.replace_layer(slot, k, v)


def _positions(lengths, T):
  return jnp.asarray(lengths, jnp.int32)[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]


@functools.partial(jax.jit, static_argnames=("decoder", "slots", "embed", "head", "advance",
                                             "checked", "implementation"),
                   donate_argnames=("cache",))
def _device_layers(layer_params, top, x, cache: KVCache | PagedKVCache, *, decoder, slots, embed,
                   head, advance, checked, implementation):
  """Consecutive layers whose caches are in ``cache`` (slot i of ``cache`` per layer), jitted.

  ``x`` is tokens (B, T) when ``embed``, else the residual stream (B, T, D);
  returns logits (B, T, V) when ``head``, else the residual stream, and the
  updated cache (lengths grown by T when ``advance``: the whole step, which
  over a ``PagedKVCache`` gets its pages first, ``reserve``; ``checked``: the
  room was checked before the step, so ``advance`` needs no host callback).
  An ``OffloadedKVCache`` reserves the step's pages itself
  (``OffloadedKVCache.reserve``), before its first layer.
  """
  if advance and isinstance(cache, PagedKVCache):
    cache = cache.reserve(x.shape[1])
  if embed:
    x = decoder.embed(top, x)
  positions = _positions(cache.lengths, x.shape[1])
  for p, slot in zip(layer_params, slots):
    x, cache = decoder.run_layer(p, x, cache, slot, positions, implementation)
  if advance:
    cache = cache.advance(x.shape[1], check=not checked)
  return (decoder.head(top, x) if head else x), cache


@functools.partial(jax.jit, static_argnames=("decoder", "embed"))
def _host_layer_inputs(p, top, x, lengths, *, decoder, embed):
  if embed:
    x = decoder.embed(top, x)
  q, k, v = decoder.attention_inputs(p, x, _positions(lengths, x.shape[1]))
  return x, q, k, v


@functools.partial(jax.jit, static_argnames=("decoder", "head"))
def _host_layer_outputs(p, top, x, attn, *, decoder, head):
  x = decoder.attention_output(p, x, attn)
  return decoder.head(top, x) if head else x


def decode_step(decoder: Decoder, layer_params: Sequence[Any], top: Any,
                cache: KVCache | PagedKVCache | OffloadedKVCache, tokens, *,
                implementation=None):
  """One decode step: the T new tokens through every layer, their keys and values cached.

  Writes the keys and values of the new tokens of every layer at positions
  ``cache.lengths[b] + t`` and attends with ``decode_attention`` (causal
  among the new tokens). Over a ``KVCache`` or ``PagedKVCache`` all layers
  run as one jitted call; over an ``OffloadedKVCache`` each run of consecutive device-resident
  layers is one jitted call and each host-resident layer is served through
  ``OffloadedKVCache.attend`` (see the module docstring). Either cache is
  donated: the passed ``cache`` must not be used afterwards.

  Args:
    decoder: the model's functions.
    layer_params: L per-layer parameter pytrees, on the device.
    top: the parameters ``decoder.embed`` and ``decoder.head`` read.
    cache: a ``KVCache`` or an ``OffloadedKVCache`` of L layers.
    tokens: (B, T) integer, the new tokens (T = 1 for plain decoding).
    implementation: passed to ``decode_attention`` for device-resident and
      streamed layers (host-computed layers use the fused "cpu" kernel).

  Returns:
    ``(logits, cache)``: logits (B, T, V) as ``decoder.head`` gives them, on
    the device; the cache with the new positions written and ``lengths``
    grown by T.

  Raises:
    ValueError: a cache of another number of layers than ``layer_params``,
      or positions past the cache's ``max_len`` (checked on the host before
      the step, ``check_room``; for a ``KVCache`` whose lengths are traced,
      inside a caller's jit, as ``KVCache.advance`` reports it).
  """
  L = len(layer_params)
  if cache.num_layers != L:
    raise ValueError(f"decode_step: a KV cache of {cache.num_layers} layers for {L} layers of "
                     f"parameters")
  T = tokens.shape[1]
  if decoder.layer is not None and (isinstance(cache, PagedKVCache) or (
      isinstance(cache, KVCache) and (cache.stacked or len(cache.k_scale) > 0))):
    raise ValueError("decode_step: a decoder of whole layers (Decoder.layer) runs over a "
                     "KVCache of floats in per-layer arrays, not a PagedKVCache, a quantized "
                     "or a stacked cache")
  if isinstance(cache, (KVCache, PagedKVCache)):
    checked = cache.check_room(T)
    if checked:
      known = decode.host_lengths(cache.lengths)
      pages = cache.pages_after(T) if isinstance(cache, PagedKVCache) else None
    logits, cache = _device_layers(tuple(layer_params), top, tokens, cache, decoder=decoder,
                                   slots=tuple(range(L)), embed=True, head=True, advance=True,
                                   checked=checked, implementation=implementation)
    if checked:  # the next step's check_room needs no device round trip
      decode.remember_lengths(cache.lengths, known + T)
      if pages is not None:
        paged.remember_pages(cache, *pages)
    return logits, cache
  if decoder.layer is not None:
    raise ValueError("decode_step: a decoder of whole layers (Decoder.layer) runs over a "
                     "KVCache, not an OffloadedKVCache")
  cache = cache.reserve(T)
  x, layer = tokens, 0
  while layer < L:
    if cache.slot(layer) is None:
      x, q, k, v = _host_layer_inputs(layer_params[layer], top, x, cache.lengths,
                                      decoder=decoder, embed=layer == 0)
      attn, cache = cache.attend(layer, q, k, v, implementation=implementation)
      x = _host_layer_outputs(layer_params[layer], top, x, attn, decoder=decoder,
                              head=layer == L - 1)
      layer += 1
    else:
      end = layer + 1
      while end < L and cache.slot(end) is not None:
        end += 1
      x, device = _device_layers(
          tuple(layer_params[layer:end]), top, x, cache.device, decoder=decoder,
          slots=tuple(cache.slot(i) for i in range(layer, end)), embed=layer == 0,
          head=end == L, advance=False, checked=True, implementation=implementation)
      cache = dataclasses.replace(cache, device=device)
      layer = end
  return x, cache.advance(T)
