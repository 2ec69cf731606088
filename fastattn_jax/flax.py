"""``attention_fn`` for Flax: ``fast_attention`` behind Flax's attention interface.

A drop-in for the ``attention_fn`` of ``flax.linen.MultiHeadDotProductAttention``
(and ``MultiHeadAttention``) and ``flax.nnx.MultiHeadAttention``, and for
``flax.linen.dot_product_attention`` / ``flax.nnx.dot_product_attention``
called directly::

  from fastattn_jax.flax import attention_fn

  layer = nnx.MultiHeadAttention(num_heads=8, in_features=512, decode=False,
                                 attention_fn=attention_fn, rngs=nnx.Rngs(0))
  y = layer(x, mask=nnx.make_causal_mask(tokens))  # any Flax mask: runs, gains nothing

This module imports neither Flax nor Equinox: Flax hands the function plain
arrays and Python values.

The fused fast paths
--------------------
A mask is a dense (batch..., N|1, T, S) array: the fused kernels read it
tile by tile and skip no tile, so the mask idiom costs as much as Flax's own
attention. What the kernels skip (fully masked tiles, and for key lengths the
keys beyond them) they must be told by index, without a mask:

* causal self-attention. NNX: call the layer with ``is_causal=True`` and no
  mask, ``layer(x, is_causal=True)``: NNX passes its call's ``is_causal`` to
  ``attention_fn``, ``False`` when not given, which overrides a
  ``functools.partial(attention_fn, is_causal=True)`` (in NNX such a partial
  is silently not causal). Linen passes none: build the layer with
  ``attention_fn=functools.partial(attention_fn, is_causal=True)``.
* padding. ``query_seq_lengths=lengths, key_value_seq_lengths=lengths``,
  ``lengths`` of the batch dims' shape, is Flax's ``make_attention_mask(valid,
  valid)`` for ``valid[..., i] = i < lengths``; key lengths alone are
  ``make_attention_mask(ones, valid)``. Linen: build the layer inside the
  ``@nn.compact`` call that has the lengths, with
  ``attention_fn=functools.partial(attention_fn, query_seq_lengths=lengths,
  key_value_seq_lengths=lengths)``. NNX fixes a layer's ``attention_fn`` at
  construction: call ``attention_fn`` between the layer's own projections,
  ``layer.out(attention_fn(layer.query(x), layer.key(x), layer.value(x),
  query_seq_lengths=lengths, key_value_seq_lengths=lengths))``.

Either combines with a mask (visible = the mask and the index rule).

Semantics
---------
The result is Flax's default attention's (``softmax(q k^T / sqrt(H) + bias)``
over the visible keys, times v), including a query row that sees no key
(all masked, or padding): Flax's ``jnp.where(mask, logits, finfo.min)``
makes its logits equal, so it returns the mean of all the values, and so does
this adapter (``fast_attention`` alone returns zeros there), with the
matching gradient. Only float32 accumulation and softmax differ: at least as
accurate as Flax's.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from fastattn_jax.attention import fast_attention

__all__ = ["attention_fn"]


def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                 dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                 precision=None, module=None, *, force_fp32_for_softmax=False,
                 qk_attn_weights_einsum=None, attn_weights_value_einsum=None,
                 is_causal=False, query_seq_lengths=None, key_value_seq_lengths=None,
                 segment_ids=None, sinks=None, alibi_slopes=None):
  """Flax's ``dot_product_attention`` computed by ``fast_attention``.

  The algorithm is FastAttention's (Lin et al., "FastAttention: Extend
  FlashAttention2 to NPUs and Low-resource GPUs for Efficient Inference",
  2024) on FlashAttention-2's (Dao 2023) online softmax: the T x S logits are
  never formed; ``fast_attention``'s docstring has the paths and their
  precision.

  Args:
    query: (batch..., T, N, H): any number of leading batch dims (none too),
      as in Flax; float32, float16 or bfloat16 (float64 takes the reference
      math).
    key: (batch..., S, K, H), the same batch dims; N a multiple of K
      (grouped-query attention, as ``nnx.MultiHeadAttention(num_kv_heads=K)``
      gives).
    value: key's shape.
    bias: optional additive bias broadcastable to (batch..., N, T, S).
    mask: optional mask broadcastable to (batch..., N, T, S), of any dtype:
      nonzero = attend, as Flax reads it (``make_causal_mask`` and
      ``make_attention_mask`` give float32 0/1).
    broadcast_dropout, dropout_rng: used by dropout only; see dropout_rate.
    dropout_rate: static float. Attention dropout is not implemented: a
      nonzero rate with ``deterministic=False`` raises. With rate 0 or
      ``deterministic=True`` (evaluation) there is no dropout to apply.
    deterministic: static bool (Flax: evaluation mode).
    dtype: the computation's dtype, as in Flax: query, key and value are cast
      to it (None: their promoted dtype); the output has it.
    precision: Flax's einsum precision. Met whatever its value: the paths
      ``fast_attention`` chooses multiply in the inputs' dtype with float32
      accumulation (float32 inputs on a GPU take its xla path, which runs at
      ``Precision.HIGHEST``).
    module: what Flax passes for ``sow_weights=True``, to record the attention
      weights: not supported (None is), the fused kernels never form them.
    force_fp32_for_softmax: linen's; the softmax is in float32 whatever its
      value.
    qk_attn_weights_einsum, attn_weights_value_einsum: linen's replacement
      einsums (e.g. quantized): not supported (None is), the kernels do their
      own products.
    is_causal: key j is visible to query i only if j <= i, without a mask:
      fully masked tiles are skipped (see the module docstring for how a Flax
      model passes it).
    query_seq_lengths: optional integer array of the batch dims' shape: query
      rows i >= length are padding (they give the mean of the values, as a
      Flax padding mask does).
    key_value_seq_lengths: optional integer array of the batch dims' shape:
      keys j >= length are never read.
    segment_ids: packed sequences, as ``fast_attention`` takes them, with
      the batch dims in front: an integer (batch..., T) array (T = S), or a
      pair of (batch..., T) and (batch..., S). A row whose id no key has
      gives the mean of the values, as a Flax mask hiding every key does.
    sinks: optional (N,) float array, as ``fast_attention``'s.
    alibi_slopes: optional (N,) float array, as ``fast_attention``'s.

  Returns:
    (batch..., T, N, H) in ``dtype``.

  Raises:
    NotImplementedError: attention dropout (``dropout_rate`` > 0 with
      ``deterministic=False``), ``module`` (``sow_weights=True``), or a
      replacement einsum.
    ValueError: query, key and value without the same batch dims, a mask,
      bias or lengths that does not broadcast over them, and every shape
      ``fast_attention`` refuses (each message names the argument and the
      shapes).
    TypeError: a traced ``dropout_rate`` or ``deterministic`` when dropout is
      asked for, and the dtypes ``fast_attention`` refuses.
  """
  # Without dropout these change nothing; the kernels' softmax is float32 and
  # their products at least as precise as any precision asks (see Args).
  del broadcast_dropout, dropout_rng, precision, force_fp32_for_softmax
  if module is not None:
    raise NotImplementedError(
        f"attention_fn got module={type(module).__name__} (Flax's sow_weights=True): "
        "the fused kernels never form the attention weights to record; use Flax's "
        "default attention_fn to inspect them")
  if qk_attn_weights_einsum is not None or attn_weights_value_einsum is not None:
    raise NotImplementedError(
        "attention_fn does not take qk_attn_weights_einsum / attn_weights_value_einsum "
        "(linen's qk_attn_weights_einsum_cls / attn_weights_value_einsum_cls): the "
        "fused kernels do their own products")
  if _static("dropout_rate", dropout_rate) != 0 and not _static("deterministic", deterministic):
    raise NotImplementedError(
        f"attention dropout (dropout_rate={dropout_rate} with deterministic=False) is "
        "not implemented by fast_attention: train with dropout_rate=0.0, evaluate with "
        "deterministic=True, or use Flax's default attention_fn for dropout")

  query, key, value = (jnp.asarray(x) for x in (query, key, value))
  dtype = jnp.result_type(query, key, value) if dtype is None else jnp.dtype(dtype)
  query, key, value = (x.astype(dtype) for x in (query, key, value))
  batch = _batch_dims(query, key, value)
  B = math.prod(batch)
  q, k, v = (x.reshape((B,) + x.shape[len(batch):]) for x in (query, key, value))
  if mask is not None:
    mask = jnp.asarray(mask).astype(bool)
  out, lse = fast_attention(
      q, k, v, _fold_operand("bias", bias, batch), _fold_operand("mask", mask, batch),
      is_causal=is_causal,
      query_seq_lengths=_fold_lengths("query_seq_lengths", query_seq_lengths, batch),
      key_value_seq_lengths=_fold_lengths("key_value_seq_lengths", key_value_seq_lengths,
                                          batch),
      segment_ids=_fold_segment_ids(segment_ids, batch), sinks=sinks,
      alibi_slopes=alibi_slopes, return_residual=True)
  # A row that sees no key has an LSE of -inf; Flax gives it the mean of all
  # the values (each query head reads key/value head n // (N // K)). Only a
  # mask, lengths or segment ids can hide every key from a row (causality
  # leaves key 0); with sinks its LSE is the sink's and its output 0.
  if (mask is not None or query_seq_lengths is not None or key_value_seq_lengths is not None
      or segment_ids is not None):
    N, K = q.shape[2], k.shape[2]
    mean_v = jnp.repeat(jnp.mean(v, axis=1), N // K, axis=1)
    out = jnp.where(jnp.isneginf(lse)[..., None], mean_v[:, None], out)
  return out.reshape(batch + out.shape[1:])


def _static(name, value):
  """``value``, which decides on dropout at trace time; TypeError naming ``name`` if traced."""
  if isinstance(value, jax.core.Tracer):
    raise TypeError(f"attention_fn needs a static {name} (a Python value) to decide on "
                    f"dropout, got a traced {value.aval}")
  return value


def _batch_dims(query, key, value):
  """The shared leading batch dims of (batch..., L, heads, features) arrays."""
  if (not query.ndim == key.ndim == value.ndim >= 3
      or not query.shape[:-3] == key.shape[:-3] == value.shape[:-3]):
    raise ValueError(
        "query, key and value must be [batch..., length, heads, features] with the "
        f"same batch dims, got query {query.shape}, key {key.shape}, value {value.shape}")
  return query.shape[:-3]


def _fold_operand(name, x, batch):
  """A mask or bias broadcastable to (batch..., N, T, S) as (1 or prod(batch), N|1, T|1, S|1)."""
  if x is None:
    return None
  x = jnp.asarray(x)
  rank = len(batch) + 3
  lead = ((1,) * (rank - x.ndim) + x.shape)[:len(batch)]
  if x.ndim > rank or any(d not in (1, b) for d, b in zip(lead, batch)):
    raise ValueError(f"{name} of shape {x.shape} does not broadcast to (batch..., N, T, S) "
                     f"with batch dims {batch}")
  x = x.reshape((1,) * (rank - x.ndim) + x.shape)
  tail = x.shape[len(batch):]
  if all(d == 1 for d in lead):
    return x.reshape((1,) + tail)
  return jnp.broadcast_to(x, batch + tail).reshape((math.prod(batch),) + tail)


def _fold_segment_ids(segment_ids, batch):
  """Segment ids with the batch dims in front, as ``fast_attention`` takes
  them: (prod(batch), T), or a pair of (prod(batch), T) and (prod(batch), S)."""
  if segment_ids is None:
    return None
  pair = isinstance(segment_ids, (tuple, list))
  ids = [jnp.asarray(x) for x in (segment_ids if pair else (segment_ids,))]
  for name, x in zip(("q_segment_ids", "kv_segment_ids") if pair else ("segment_ids",), ids):
    if x.shape[:-1] != batch or x.ndim != len(batch) + 1:
      raise ValueError(f"{name} must have shape (batch..., length) with batch dims {batch}, "
                       f"got {x.shape}")
  ids = [x.reshape(math.prod(batch), x.shape[-1]) for x in ids]
  return tuple(ids) if pair else ids[0]


def _fold_lengths(name, lengths, batch):
  """Per-example lengths of the batch dims' shape as (prod(batch),)."""
  if lengths is None:
    return None
  lengths = jnp.asarray(lengths)
  if lengths.shape != batch:
    raise ValueError(f"{name} must have the batch dims' shape {batch}, got {lengths.shape}")
  return lengths.reshape(-1)
