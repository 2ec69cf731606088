"""The one way a fused kernel is called: ``kernel_call`` assembles the
``jax.ffi.ffi_call`` of any target (CPU, CUDA, Ascend; forward or backward).

Every target takes the same leading operands, q, k, v, then bias, mask,
query lengths and key/value lengths, then the training features as the
kernels read them (``feature_operands``), each absent one as an empty array
that the handlers read as "none", then the target's own (the backward's
residuals),
and the same rule attributes (``csrc/ffi/attention_attrs.h``: CallAttrs, the
logit transform and the index rules) plus the target's own attributes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from fastattn_jax.shapes import AttentionConfig


def rule_attrs(config: AttentionConfig) -> dict:
  """The FFI attributes every target takes: the logit transform and the index
  rules (csrc/ffi/attention_attrs.h: CallAttrs)."""
  left, right = config.window_bounds
  return dict(scale=np.float32(config.scale), softcap=np.float32(config.softcap or 0.0),
              is_causal=np.int64(config.is_causal), end_aligned=np.int64(config.end_aligned),
              window_left=np.int64(left), window_right=np.int64(right))


def segment_spans(q_ids, kv_ids):
  """The kernels' view of segment ids (``FaFeatures`` in
  csrc/kernels/attention_rules.h): (B, T, 4) and (B, S, 4) int32.

  Per query row i: its id x, the end of the run of equal ids that holds it,
  and [lo, hi), the keys it may share a segment with; per key likewise,
  with rows for keys. Where a sequence's ids are sorted on both sides
  (packed documents), lo and hi count the other side's ids below x and up
  to x (binary searches), which bounds x's keys exactly, and are
  nondecreasing in i, so rows [m0, m1) see keys in [lo(m0), hi(m1 - 1))
  only; the run end is hi on its own side. Elsewhere the bounds are the
  whole other side and each run is one position: the kernels test every
  pair, skipping no tile. A few XLA kernels (no sort, scan or loop): on a
  GPU their launches, not their work, are the cost, and a packed call's
  own time at T = 2K is about 0.1 ms.
  """
  search = jax.vmap(functools.partial(jnp.searchsorted, method="scan_unrolled"),
                    in_axes=(0, 0, None))
  nondecreasing = lambda ids: jnp.all(ids[:, 1:] >= ids[:, :-1], axis=1, keepdims=True)
  is_sorted = nondecreasing(q_ids) & nondecreasing(kv_ids)

  def spans(ids, other):
    count = lambda within, side: search(within, ids, side).astype(jnp.int32)
    whole = lambda value: jnp.broadcast_to(jnp.asarray(value, jnp.int32), ids.shape)
    run_end = jnp.arange(1, ids.shape[1] + 1, dtype=jnp.int32)[None]
    return jnp.stack([ids,
                      jnp.where(is_sorted, count(ids, "right"), run_end),
                      jnp.where(is_sorted, count(other, "left"), whole(0)),
                      jnp.where(is_sorted, count(other, "right"), whole(other.shape[1]))],
                     axis=-1)

  return spans(q_ids, kv_ids), spans(kv_ids, q_ids)


def feature_operands(features) -> list:
  """The four operands every target takes for ``features`` (a
  ``shapes.Features`` or None): the query's and keys' segment spans
  (``segment_spans``), sinks and ALiBi slopes (B|1, N) float32, each empty
  where absent."""
  empty = lambda dtype: jnp.zeros((0,), dtype)
  if features is None:
    return [empty(jnp.int32), empty(jnp.int32), empty(jnp.float32), empty(jnp.float32)]
  spans = ([empty(jnp.int32)] * 2 if features.q_segment_ids is None else
           list(segment_spans(features.q_segment_ids, features.kv_segment_ids)))
  return spans + [empty(jnp.float32) if x is None else x
                  for x in (features.sinks, features.alibi_slopes)]


def kernel_call(target: str, results, config: AttentionConfig, q, k, v, bias=None, mask=None,
                q_lens=None, kv_lens=None, *residuals, features=None, bias_dtype=None,
                **attrs):
  """Calls FFI target ``target`` on a checked call's operands.

  Args:
    target: the registered FFI target's name.
    results: the results' ``jax.ShapeDtypeStruct`` (a tuple).
    config: the call's options; their rule attributes (``rule_attrs``) go
      with ``attrs``.
    q, k, v: (B, T, N, H), (B, S, K, H), as the target takes them.
    bias, mask, q_lens, kv_lens: the optional operands or None (an empty
      array in its place); the bias in its own dtype, or cast to
      ``bias_dtype`` where given; an absent one is empty, of ``bias_dtype``
      or q's.
    *residuals: the target's further operands, after these.
    features: the training features (``shapes.Features``) or None; they go
      as ``feature_operands`` after the lengths.
    **attrs: the target's own attributes (e.g. ``variant``).

  Returns:
    The call's results.
  """
  empty = lambda dtype: jnp.zeros((0,), dtype)
  if bias is None:
    bias = empty(q.dtype if bias_dtype is None else bias_dtype)
  elif bias_dtype is not None:
    bias = bias.astype(bias_dtype)
  optional = (bias,
              empty(jnp.bool_) if mask is None else mask,
              empty(jnp.int32) if q_lens is None else q_lens,
              empty(jnp.int32) if kv_lens is None else kv_lens)
  return jax.ffi.ffi_call(target, results)(q, k, v, *optional, *feature_operands(features),
                                           *residuals, **rule_attrs(config), **attrs)
