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
  and [lo, hi), the keys that rows >= i (lo) and rows <= i (hi) may share a
  segment with; per key likewise, with rows for keys. So rows [m0, m1) see
  keys in [lo(m0), hi(m1 - 1)) only, and the kernels skip every key tile
  outside. Per sequence, the first of these that holds:

  - ids sorted on both sides (packed documents numbered in order): lo and hi
    count the other side's ids below x and up to x (binary searches), which
    bounds x's keys exactly; the run end is hi on its own side.
  - on the CPU: the first and last positions of x on the other side (a
    stable argsort and binary searches) nondecreasing in i, as where each id
    fills one run in any order (MaxText's packing: documents 1, 2, ... then
    padding 0): those bound x's keys exactly.
  - otherwise the bounds are the whole other side: no tile is skipped.

  Where a sequence is not sorted, the run end is (CPU) x's last position + 1
  if x's positions on its own side are one run, else i + 1 (the kernels then
  test every pair of i's tiles).

  On the CPU the argsorts run only where some sequence is not sorted
  (``lax.cond``). Other platforms never run them: on the H200 the cond's
  round trip to the host alone took 0.06 ms and the argsorts about 0.04 ms
  more, against a packed call's own 0.08 ms at T = 2K.
  """
  sorted_or_whole = lambda: spans_by_rule(q_ids, kv_ids, runs=False)
  return jax.lax.platform_dependent(
      cpu=lambda: jax.lax.cond(
          jnp.all(_nondecreasing(q_ids) & _nondecreasing(kv_ids)), sorted_or_whole,
          lambda: spans_by_rule(q_ids, kv_ids, runs=True)),
      default=sorted_or_whole)


def _nondecreasing(ids):
  return jnp.all(ids[:, 1:] >= ids[:, :-1], axis=1, keepdims=True)


def spans_by_rule(q_ids, kv_ids, *, runs: bool):
  """``segment_spans`` by its first rule (sorted ids) and, with ``runs``, its
  second (runs in any order), on every platform; elsewhere whole bounds."""
  search = jax.vmap(functools.partial(jnp.searchsorted, method="scan_unrolled"),
                    in_axes=(0, 0, None))
  is_sorted = _nondecreasing(q_ids) & _nondecreasing(kv_ids)
  positions = lambda ids: jnp.arange(1, ids.shape[1] + 1, dtype=jnp.int32)[None]

  def searched(ids, other):
    count = lambda within, side: search(within, ids, side).astype(jnp.int32)
    return count(ids, "right"), count(other, "left"), count(other, "right")

  def occurrences(ids, within):
    """Per position of ids: the first and last + 1 positions of its id in
    `within`, and how many positions hold it."""
    order = jnp.argsort(within, axis=1, stable=True).astype(jnp.int32)
    ordered = jnp.take_along_axis(within, order, axis=1)
    lo, hi = (search(ordered, ids, side).astype(jnp.int32) for side in ("left", "right"))
    at = lambda k: jnp.take_along_axis(order, jnp.clip(k, 0, within.shape[1] - 1), axis=1)
    return at(lo), at(hi - 1) + 1, hi - lo

  def located(ids, other):
    """The second rule's fields, and where (per sequence) its bounds hold."""
    first, last, count = occurrences(ids, other)
    lo = jnp.where(count > 0, first, 0)
    hi = jnp.where(count > 0, last, other.shape[1])
    own_first, own_last, own_count = occurrences(ids, ids)
    run_end = jnp.where(own_last - own_first == own_count, own_last, positions(ids))
    return (run_end, lo, hi), _nondecreasing(lo) & _nondecreasing(hi)

  def spans(ids, other):
    run_end, lo, hi = positions(ids), jnp.zeros_like(ids), jnp.full_like(ids, other.shape[1])
    if runs:
      (run_end, run_lo, run_hi), exact = located(ids, other)
      lo, hi = jnp.where(exact, run_lo, lo), jnp.where(exact, run_hi, hi)
    fields = [jnp.where(is_sorted, x, y) for x, y in zip(searched(ids, other), (run_end, lo, hi))]
    return jnp.stack([ids, *fields], axis=-1)

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
