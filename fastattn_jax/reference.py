"""The "xla" path: attention in plain jax.numpy, materializing the T x S scores.

It defines the semantics every fused path must reproduce, serves platforms and
dtypes the kernels do not (float64), and is what the backward pass recomputes
(``fastattn_jax.attention``). Same math as ``jax.nn.dot_product_attention``'s
XLA path, except that a query row with no visible key gives zeros and an LSE
of -inf (jax.nn gives the mean of the values there), and masked logits are
removed by selection so a NaN in a key the row cannot see never reaches it,
and no infinity arises but that LSE.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fastattn_jax.shapes import AttentionConfig


def visible_mask(config: AttentionConfig, T: int, S: int, q_lens, kv_lens):
  """Boolean (B|1, 1, T, S) mask of the index-defined visibility, or None."""
  i = jnp.arange(T)[:, None]
  j = jnp.arange(S)[None, :]
  visible = None

  def both(a, b):
    return b if a is None else a & b

  pos = i
  if config.end_aligned and (config.is_causal or config.window is not None):
    q_len = jnp.full((1,), T) if q_lens is None else jnp.clip(q_lens, 0, T)
    kv_len = jnp.full((1,), S) if kv_lens is None else jnp.clip(kv_lens, 0, S)
    pos = i[None] + (kv_len - q_len)[:, None, None]  # (B|1, T, 1)
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


def attention_reference(config: AttentionConfig, query, key, value, bias=None,
                        mask=None, q_lens=None, kv_lens=None):
  """Attention by the definition, on 4-D inputs.

  Args:
    config: the static options (scale, causal, window, softcap).
    query: (B, T, N, H). key, value: (B, S, K, H), N a multiple of K.
    bias: additive, broadcastable to (B, N, T, S), or None.
    mask: bool, broadcastable to (B, N, T, S), True = attend, or None.
    q_lens, kv_lens: (B,) int32 valid lengths, or None.

  Returns:
    ``(out, lse)``: out (B, T, N, H) in query's dtype; lse (B, T, N) float32
    (float64 for float64 inputs), the natural-log sum of exp of the visible
    logits; rows with no visible key give out 0 and lse -inf.
  """
  B, T, N, H = query.shape
  S, K = key.shape[1], key.shape[2]
  G = N // K
  acc = jnp.promote_types(query.dtype, jnp.float32)
  # Heads as (K, G): query head n = kh * G + g reads key/value head kh.
  q = query.reshape(B, T, K, G, H)
  logits = jnp.einsum("btkgh,bskh->bkgts", q, key, preferred_element_type=acc,
                      precision=jax.lax.Precision.HIGHEST)
  logits = logits * jnp.asarray(config.scale, acc)
  if config.softcap is not None:
    c = jnp.asarray(config.softcap, acc)
    logits = c * jnp.tanh(logits / c)
  logits = logits.reshape(B, N, T, S)
  if bias is not None:
    logits = logits + bias.astype(acc)
  visible = visible_mask(config, T, S, q_lens, kv_lens)
  if mask is not None:
    visible = mask if visible is None else visible & mask
  # Hidden logits are selected away, never replaced by -inf: no infinity is
  # created (``jax.debug_infs`` stays quiet) and a NaN in a logit the row
  # cannot see never reaches its sums.
  if visible is not None:
    logits = jnp.where(visible, logits, jnp.finfo(acc).min)
  m = jax.lax.stop_gradient(
      jnp.max(logits, axis=-1, keepdims=True, initial=jnp.finfo(acc).min))  # S = 0 too
  if visible is not None:
    m = jnp.where(jnp.any(visible, axis=-1, keepdims=True), m, 0)  # rows that see nothing
    p = jnp.where(visible, jnp.exp(jnp.where(visible, logits, m) - m), 0)
  else:
    p = jnp.exp(logits - m)
  l = jnp.sum(p, axis=-1, keepdims=True)
  l_safe = jnp.where(l == 0, 1, l)  # empty rows stay NaN-free; a NaN l stays NaN
  p = p / l_safe
  if kv_lens is not None:  # keys past the length are never read, even as 0 * v
    value = jnp.where(jnp.arange(S)[None, :, None, None] < kv_lens[:, None, None, None],
                      value, 0)
  out = jnp.einsum("bkgts,bskh->btkgh", p.reshape(B, K, G, T, S),
                   value.astype(acc), precision=jax.lax.Precision.HIGHEST)
  out = out.reshape(B, T, N, H).astype(query.dtype)
  lse = (m + jnp.log(l))[..., 0]  # -inf exactly where a row sees no key
  return out, jnp.transpose(lse, (0, 2, 1)).astype(acc)

