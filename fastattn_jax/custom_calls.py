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

  Per query row i: its id, the end of the run of equal ids that holds it,
  and [lo, hi), keys that bound those of its id and of every later row's
  (lo) or earlier row's (hi) id: lo the least first key of the ids of rows
  >= i, hi the greatest last key + 1 of rows <= i. So rows [m0, m1) see
  keys in [lo(m0), hi(m1 - 1)) only: exact where ids are sorted, a bound
  where they are not. Per key likewise, with rows for keys. The occurrences
  come from one stable sort of both sides' ids together, per sequence:
  each id's group of the sorted order gives its first and last position on
  either side, by scans (no loop, and no scatter but a permutation's).
  """
  B, T = q_ids.shape
  S = kv_ids.shape[1]

  def runs(ids):
    L = ids.shape[1]
    change = jnp.concatenate([ids[:, 1:] != ids[:, :-1], jnp.ones_like(ids[:, :1], bool)], 1)
    ends = jnp.where(change, jnp.arange(1, L + 1, dtype=jnp.int32), L)
    return jax.lax.cummin(ends, axis=1, reverse=True)

  def one_sequence(q, kv):
    # Keys at [0, S), rows at [S, S + T) of the joint order. The sort is
    # stable, so each id's group holds its keys first, then its rows, each in
    # position order: a group's first and last key and row are read at its
    # ends and at its first row, found by scans (no scatter).
    L = S + T
    joint = jnp.concatenate([kv, q])
    order = jnp.argsort(joint, stable=True).astype(jnp.int32)
    ranked = joint[order]
    index = jnp.arange(L, dtype=jnp.int32)
    starts = jnp.concatenate([jnp.ones((1,), bool), ranked[1:] != ranked[:-1]])
    ends = jnp.concatenate([starts[1:], jnp.ones((1,), bool)])
    first = jax.lax.cummax(jnp.where(starts, index, 0))  # the group's first sorted position
    last = jax.lax.cummin(jnp.where(ends, index, L), reverse=True)  # and its last
    keys_before = jnp.cumsum(order < S, dtype=jnp.int32)  # keys at sorted positions <= p
    keys = keys_before[last] - keys_before[first] + (order[first] < S)  # the group's keys
    has_keys, has_rows = keys > 0, keys < last - first + 1
    at = lambda p: order[jnp.clip(p, 0, L - 1)]
    key_lo = jnp.where(has_keys, at(first), S)
    key_hi = jnp.where(has_keys, at(first + keys - 1) + 1, 0)
    row_lo = jnp.where(has_rows, at(first + keys) - S, T)
    row_hi = jnp.where(has_rows, at(last) - S + 1, 0)
    is_key = order < S
    # Back to each position's own order (order is a permutation).
    back = lambda x: jnp.zeros((L,), jnp.int32).at[order].set(x, unique_indices=True)
    lo = back(jnp.where(is_key, row_lo, key_lo))
    hi = back(jnp.where(is_key, row_hi, key_hi))
    return (lo[S:], hi[S:]), (lo[:S], hi[:S])

  if S == 0 or T == 0:
    q_bounds = (jnp.full((B, T), S, jnp.int32), jnp.zeros((B, T), jnp.int32))
    kv_bounds = (jnp.full((B, S), T, jnp.int32), jnp.zeros((B, S), jnp.int32))
  else:
    q_bounds, kv_bounds = jax.vmap(one_sequence)(q_ids, kv_ids)
  envelope = lambda lo, hi: (jax.lax.cummin(lo, axis=1, reverse=True),
                             jax.lax.cummax(hi, axis=1))
  q_spans = jnp.stack([q_ids, runs(q_ids), *envelope(*q_bounds)], axis=-1)
  kv_spans = jnp.stack([kv_ids, runs(kv_ids), *envelope(*kv_bounds)], axis=-1)
  return q_spans, kv_spans


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
