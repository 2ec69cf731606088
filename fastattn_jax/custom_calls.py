"""The one way a fused kernel is called: ``kernel_call`` assembles the
``jax.ffi.ffi_call`` of any target (CPU, CUDA, Ascend; forward or backward).

Every target takes the same leading operands, q, k, v, then bias, mask,
query lengths and key/value lengths, each absent one as an empty array that
the handlers read as "none", then the target's own (the backward's residuals),
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


def kernel_call(target: str, results, config: AttentionConfig, q, k, v, bias=None, mask=None,
                q_lens=None, kv_lens=None, *residuals, bias_dtype=None, **attrs):
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
  return jax.ffi.ffi_call(target, results)(q, k, v, *optional, *residuals,
                                           **rule_attrs(config), **attrs)
