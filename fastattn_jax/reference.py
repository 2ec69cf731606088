"""The "xla" path: attention in plain jax.numpy, materializing the T x S scores.

It defines the semantics every fused path must reproduce, serves platforms and
dtypes the kernels do not (float64), and gives the gradients of fused paths
that have no fused backward (``attention_grads``: the backward over blocks of
query rows, in bounded memory). Same math as ``jax.nn.dot_product_attention``'s
XLA path, except that a query row with no visible key gives zeros and an LSE
of -inf (jax.nn gives the mean of the values there), and masked logits are
removed by selection so a NaN in a key the row cannot see never reaches it,
and no infinity arises but that LSE.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fastattn_jax.shapes import AttentionConfig


def gather_pages(pages, block_table):
  """A paged cache as one contiguous cache: (pages, page_size, K, H) through
  a (B, max_pages) block table -> (B, max_pages * page_size, K, H), position
  j of sequence b from row j % page_size of page block_table[b, j //
  page_size]. Entries outside [0, pages) are clamped, as the kernels clamp
  them (only positions past a sequence's length should hold such entries)."""
  B, max_pages = block_table.shape
  rows = jnp.take(pages, block_table, axis=0, mode="clip")
  return rows.reshape(B, max_pages * pages.shape[1], *pages.shape[2:])


def dequantize(x, scale, dtype):
  """A quantized cache's values: ``x.astype(float32) * scale[..., None]``
  (``shapes.check_kv_scales``), rounded once to ``dtype``."""
  return (x.astype(jnp.float32) * scale[..., None]).astype(dtype)


def plain_kv(k, v, block_table, k_scale, v_scale, dtype):
  """The (B, S, K, H) key and value a call reads, in ``dtype``, from a cache
  that may be paged (``block_table``) and quantized (``k_scale`` and
  ``v_scale``): the form of the cache every path but the in-place readers
  takes."""
  if k_scale is not None:
    k, v = dequantize(k, k_scale, dtype), dequantize(v, v_scale, dtype)
  if block_table is not None:
    k, v = gather_pages(k, block_table), gather_pages(v, block_table)
  return k, v


def row_positions(config: AttentionConfig, T: int, S: int, q_lens, kv_lens, rows=None):
  """The key position pos(i) of each query row (attention_rules.h): (1, R, 1)
  or, end aligned, (B|1, R, 1); R = T, or the rows of ``rows``."""
  i = (jnp.arange(T) if rows is None else rows)[None, :, None]
  if not config.end_aligned:
    return i
  q_len = jnp.full((1,), T) if q_lens is None else jnp.clip(q_lens, 0, T)
  kv_len = jnp.full((1,), S) if kv_lens is None else jnp.clip(kv_lens, 0, S)
  return i + (kv_len - q_len)[:, None, None]


def feature_terms(config: AttentionConfig, T: int, S: int, q_lens, kv_lens, features,
                  rows=None):
  """``(visible, bias)`` that the training features add, each None where
  none does: the segment ids' mask (B, 1, R, S), and ALiBi's bias
  ``-slope |pos(i) - j|`` (B|1, N, R, S) float32; R = T or ``rows``."""
  if features is None:
    return None, None
  visible = bias = None
  if features.q_segment_ids is not None:
    q_ids = features.q_segment_ids
    if rows is not None:
      q_ids = jnp.take(q_ids, rows, axis=1, mode="clip")
    visible = (q_ids[:, :, None] == features.kv_segment_ids[:, None, :])[:, None]
  if features.alibi_slopes is not None:
    pos = row_positions(config, T, S, q_lens, kv_lens, rows)
    distance = jnp.abs(pos - jnp.arange(S)[None, None, :]).astype(jnp.float32)
    bias = -features.alibi_slopes[:, :, None, None] * distance[:, None]
  return visible, bias


def visible_mask(config: AttentionConfig, T: int, S: int, q_lens, kv_lens, rows=None):
  """Boolean (B|1, 1, T, S) mask of the index-defined visibility, or None;
  with ``rows`` (R,) query row indices, that of those rows only: (B|1, 1, R, S)."""
  i = (jnp.arange(T) if rows is None else rows)[:, None]
  j = jnp.arange(S)[None, :]
  visible = None

  def both(a, b):
    return b if a is None else a & b

  pos = i
  if config.end_aligned and (config.is_causal or config.window is not None):
    pos = row_positions(config, T, S, q_lens, kv_lens, rows)  # (B|1, T, 1)
  if config.is_causal:
    visible = both(visible, j <= pos)
  if config.window is not None:
    left, right = config.window
    visible = both(visible, (j >= pos - left) & (j <= pos + right))
  if visible is not None:
    visible = visible[:, None] if visible.ndim == 3 else visible[None, None]
  if q_lens is not None:
    visible = both(visible, (i < q_lens[:, None, None])[:, None])
  if kv_lens is not None:
    visible = both(visible, (j < kv_lens[:, None, None])[:, None])
  return visible


def finite_keys(key):
  """``(key_safe, finite)``: key (B, S, K, H) with its non-finite elements
  replaced by 0, and (B, K, 1, 1, S) whether each key is wholly finite.

  The logits are taken from ``key_safe`` and set to NaN where a key is not
  finite: the rows that see such a key get NaN, as the arithmetic would give
  them, while the products that also run over the rows that do not see it
  (dQ = dS K) meet 0, not 0 * NaN.
  """
  finite = jnp.isfinite(key)
  key_safe = jnp.where(finite, key, 0)
  finite = jnp.all(finite, axis=-1)  # (B, S, K)
  return key_safe, jnp.transpose(finite, (0, 2, 1))[:, :, None, None, :]


def _probabilities(config: AttentionConfig, q, key, bias, visible, sinks=None):
  """The softmax of query rows q (B, R, K, G, H) over key (B, S, K, H), heads
  as (K, G): query head n = kh * G + g reads key/value head kh.

  Returns ``(p, m, l, t)``: p (B, N, R, S) the probabilities (0 where
  ``visible``, (B|1, N|1, R, S) or None, is False), m and l (B, N, R, 1) the
  row maxima (0 for rows that see nothing) and sums, and t the soft cap's
  tanh (B, K, G, R, S) or None. With ``sinks`` (B|1, N), each row's sink
  logit joins m and l (it has no value row, so p sums to less than 1).
  """
  B, R, K, G, _ = q.shape
  S = key.shape[1]
  acc = jnp.promote_types(q.dtype, jnp.float32)
  key, finite = finite_keys(key)
  logits = jnp.einsum("btkgh,bskh->bkgts", q, key, preferred_element_type=acc,
                      precision=jax.lax.Precision.HIGHEST)
  logits = jnp.where(finite, logits, jnp.nan) * jnp.asarray(config.scale, acc)
  t = None
  if config.softcap is not None:
    c = jnp.asarray(config.softcap, acc)
    t = jnp.tanh(logits / c)
    logits = c * t
  logits = logits.reshape(B, K * G, R, S)
  if bias is not None:
    logits = logits + bias.astype(acc)
  # Hidden logits are selected away, never replaced by -inf: no infinity is
  # created (``jax.debug_infs`` stays quiet) and a NaN in a logit the row
  # cannot see never reaches its sums.
  if visible is not None:
    logits = jnp.where(visible, logits, jnp.finfo(acc).min)
  m = jax.lax.stop_gradient(
      jnp.max(logits, axis=-1, keepdims=True, initial=jnp.finfo(acc).min))  # S = 0 too
  if visible is not None:
    m = jnp.where(jnp.any(visible, axis=-1, keepdims=True), m, 0)  # rows that see nothing
  if sinks is not None:
    sink = sinks.astype(acc)[:, :, None, None]
    m = jnp.maximum(m, jax.lax.stop_gradient(sink))
  if visible is not None:
    p = jnp.where(visible, jnp.exp(jnp.where(visible, logits, m) - m), 0)
  else:
    p = jnp.exp(logits - m)
  l = jnp.sum(p, axis=-1, keepdims=True)
  if sinks is not None:
    l = l + jnp.exp(sink - m)
  l_safe = jnp.where(l == 0, 1, l)  # empty rows stay NaN-free; a NaN l stays NaN
  return p / l_safe, m, l, t


def _with_features(config, T, S, q_lens, kv_lens, features, bias, visible, rows=None):
  """``bias`` and ``visible`` with the training features' terms added."""
  seg_visible, alibi = feature_terms(config, T, S, q_lens, kv_lens, features, rows)
  if seg_visible is not None:
    visible = seg_visible if visible is None else visible & seg_visible
  if alibi is not None:
    bias = alibi if bias is None else bias.astype(jnp.float32) + alibi
  return bias, visible


def attention_reference(config: AttentionConfig, query, key, value, bias=None,
                        mask=None, q_lens=None, kv_lens=None, features=None):
  """Attention by the definition, on 4-D inputs.

  Args:
    config: the static options (scale, causal, window, softcap).
    query: (B, T, N, H). key, value: (B, S, K, H), N a multiple of K.
    bias: additive, broadcastable to (B, N, T, S), or None.
    mask: bool, broadcastable to (B, N, T, S), True = attend, or None.
    q_lens, kv_lens: (B,) int32 valid lengths, or None.
    features: a ``shapes.Features`` (segment ids, sinks, ALiBi slopes) or
      None.

  Returns:
    ``(out, lse)``: out (B, T, N, H) in query's dtype; lse (B, T, N) float32
    (float64 for float64 inputs), the natural-log sum of exp of the visible
    logits; rows with no visible key give out 0 and lse -inf.
  """
  B, T, N, H = query.shape
  S, K = key.shape[1], key.shape[2]
  G = N // K
  acc = jnp.promote_types(query.dtype, jnp.float32)
  visible = visible_mask(config, T, S, q_lens, kv_lens)
  if mask is not None:
    visible = mask if visible is None else visible & mask
  bias, visible = _with_features(config, T, S, q_lens, kv_lens, features, bias, visible)
  sinks = None if features is None else features.sinks
  # Heads as (K, G): query head n = kh * G + g reads key/value head kh.
  p, m, l, _ = _probabilities(config, query.reshape(B, T, K, G, H), key, bias, visible, sinks)
  if kv_lens is not None:  # keys past the length are never read, even as 0 * v
    value = jnp.where(jnp.arange(S)[None, :, None, None] < kv_lens[:, None, None, None],
                      value, 0)
  out = jnp.einsum("bkgts,bskh->btkgh", p.reshape(B, K, G, T, S),
                   value.astype(acc), precision=jax.lax.Precision.HIGHEST)
  out = out.reshape(B, T, N, H).astype(query.dtype)
  # -inf exactly where a row sees no key; log of l_safe keeps the gradient of
  # such rows 0 (not 0 * inf), which jax.debug_nans would report.
  lse = jnp.where(l == 0, -jnp.inf, m + jnp.log(jnp.where(l == 0, 1, l)))[..., 0]
  return out, jnp.transpose(lse, (0, 2, 1)).astype(acc)


def attention_grads(config: AttentionConfig, query, key, value, bias, mask, q_lens, kv_lens,
                    d_out, d_lse, *, features=None, block_elems: int = 1 << 25):
  """(dq, dk, dv) of ``attention_reference``, in bounded memory.

  The backward of FlashAttention-2 (Dao 2023, Algorithm 2) in jax.numpy over
  blocks of whole query rows: per block, the logits against every key, P =
  softmax (its LSE recomputed: a block holds whole rows, so it is exact in the
  inputs' precision, whatever a kernel's forward rounded them to), dP = dO
  V^T, D = rowsum(P o dP) - dLSE (= rowsum(dO o O) - dLSE), dS = P (dP - D)
  (through the soft cap's tanh), dQ = scale dS K, and dK += scale dS^T Q,
  dV += P^T dO summed over the blocks (and over each GQA group). Each block
  holds B * N * rows * S logits, rows chosen so that is at most
  ``block_elems`` (at least one row; per sequence where B is symbolic, as
  in ``jax.export``): the T x S logits exist one block at a time, where
  jax.vjp of ``attention_reference`` holds all of them at once.

  Args:
    config, query, key, value, bias, mask, q_lens, kv_lens, features: as
      ``attention_reference``.
    d_out: (B, T, N, H), d_lse: (B, T, N): the cotangents of its out and lse.
    block_elems: the most logits one block holds.

  Returns:
    dq, dk, dv in query's, key's and value's shapes and dtypes; rows that see
    no key get dq = 0, keys no row sees dk = dv = 0. No gradient for the
    bias, the sinks or the ALiBi slopes.
  """
  B, T, N, H = query.shape
  S, K = key.shape[1], key.shape[2]
  G = N // K
  acc = jnp.promote_types(query.dtype, jnp.float32)
  dot = lambda spec, a, b: jnp.einsum(spec, a.astype(acc), b.astype(acc),
                                      precision=jax.lax.Precision.HIGHEST)
  # A symbolic batch (jax.export) sizes the blocks per sequence.
  per_block = (B if isinstance(B, int) else 1) * N * S
  rows = max(1, min(T, block_elems // max(1, per_block)))
  blocks = -(-T // rows)
  pad = blocks * rows - T
  if kv_lens is not None:  # keys past the length are never read, even as 0 * k
    live = jnp.arange(S)[None, :, None, None] < kv_lens[:, None, None, None]
    key, value = jnp.where(live, key, 0), jnp.where(live, value, 0)

  def padded(x, axis):
    """x padded to blocks * rows along its T-long axis (a broadcast axis of 1 stays)."""
    if x is None or x.shape[axis] == 1:
      return x
    return jnp.pad(x, [(0, pad if a == axis else 0) for a in range(x.ndim)])

  q_pad, do_pad, dlse_pad, bias_pad, mask_pad = (padded(x, axis) for x, axis in (
      (query, 1), (d_out, 1), (d_lse, 1), (bias, 2), (mask, 2)))

  def rows_of(x, i0, axis):
    """Rows [i0, i0 + rows) of a padded T axis (a broadcast axis of 1 stays)."""
    if x is None or x.shape[axis] == 1:
      return x
    return jax.lax.dynamic_slice_in_dim(x, i0, rows, axis)

  def block(carry, index):
    dk, dv = carry
    i0 = index * rows
    qb = rows_of(q_pad, i0, 1).reshape(B, rows, K, G, H)
    dob = rows_of(do_pad, i0, 1).reshape(B, rows, K, G, H)
    visible = visible_mask(config, T, S, q_lens, kv_lens, rows=i0 + jnp.arange(rows))
    if mask is not None:
      block_mask = rows_of(mask_pad, i0, 2)
      visible = block_mask if visible is None else visible & block_mask
    bias_b, visible = _with_features(config, T, S, q_lens, kv_lens, features,
                                     rows_of(bias_pad, i0, 2), visible,
                                     rows=i0 + jnp.arange(rows))
    p, _, _, t = _probabilities(config, qb, key, bias_b, visible,
                                None if features is None else features.sinks)
    dp = dot("btkgh,bskh->bkgts", dob, value).reshape(B, N, rows, S)
    d_lse_b = jnp.transpose(rows_of(dlse_pad, i0, 1), (0, 2, 1))[..., None].astype(acc)
    ds = p * (dp - (jnp.sum(p * dp, axis=-1, keepdims=True) - d_lse_b))
    if visible is not None:
      ds = jnp.where(visible, ds, 0)
    ds = ds.reshape(B, K, G, rows, S)
    if t is not None:
      ds = ds * (1 - t * t)
    p = p.reshape(B, K, G, rows, S)
    scale = jnp.asarray(config.scale, acc)
    dq = scale * dot("bkgts,bskh->btkgh", ds, key_safe)
    dk = dk + scale * dot("bkgts,btkgh->bskh", ds, qb)
    dv = dv + dot("bkgts,btkgh->bskh", p, dob)
    return (dk, dv), dq.reshape(B, rows, N, H)

  key_safe, _ = finite_keys(key)
  # zeros_like: under shard_map the carry varies over the manual axes as the keys do.
  zeros = jnp.zeros_like(key, acc)
  (dk, dv), dq = jax.lax.scan(block, (zeros, zeros), jnp.arange(blocks))
  dq = jnp.moveaxis(dq, 0, 1).reshape(B, blocks * rows, N, H)[:, :T]
  return dq.astype(query.dtype), dk.astype(key.dtype), dv.astype(value.dtype)
