"""The ``fast_attention`` JAX primitives, forward and backward, and their rules.

``fast_attention``: operands query (B,T,N,H), key and value (B,S,K,H), then
whichever of bias, mask, query lengths and key/value lengths are present
(``AttentionConfig`` says which). Results: out (B,T,N,H) and lse (B,T,N)
float32.

``fast_attention_bwd``: the forward's operands, then its results out and lse
and their cotangents d_out (B,T,N,H) and d_lse (B,T,N) float32. Results: dq,
dk, dv, shaped as query, key and value (FlashAttention-2's backward, Dao 2023,
Algorithm 2; dBias is not among them, see ``fastattn_jax.attention``).

Rules, shared by both: abstract evaluation (``shapes.check_operands``);
batching (extra leading dims fold into B); lowering per platform, where a
fused path lowers through ``custom_partitioning`` so inputs sharded along
batch or heads run the kernel shard by shard with no all-gather. The backward
lowers to the path's fused backward where it has one
(``backends.fused_backward``), else to ``reference.attention_grads`` (the
backward in jax.numpy over blocks of query rows, in bounded memory).
Differentiation is a ``custom_vjp`` one level up, in
``fastattn_jax.attention``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir
from jax.sharding import NamedSharding, PartitionSpec as P

from fastattn_jax import backends, shapes
from fastattn_jax._jax_internal import require_devices_during_lowering
from fastattn_jax.reference import attention_grads, attention_reference, plain_kv
from fastattn_jax.shapes import KERNEL_DTYPES, AttentionConfig, check_operands

fast_attention_p = Primitive("fast_attention")
fast_attention_bwd_p = Primitive("fast_attention_bwd")
#: Operands the backward takes after the forward's: out, lse, d_out, d_lse.
_RESIDUALS = 4
for _p in (fast_attention_p, fast_attention_bwd_p):
  _p.multiple_results = True
  require_devices_during_lowering(_p)


def bind(config: AttentionConfig, *operands):
  """Binds the forward; returns ``(out, lse)``."""
  return tuple(fast_attention_p.bind(*operands, config=config))


def bind_backward(config: AttentionConfig, *operands):
  """Binds the backward on the forward's operands + (out, lse, d_out, d_lse);
  returns ``(dq, dk, dv)``."""
  return tuple(fast_attention_bwd_p.bind(*operands, config=config))


@functools.cache
def _jitted_bind(prim, config: AttentionConfig):
  return jax.jit(lambda *operands: tuple(prim.bind(*operands, config=config)))


def _impl(*operands, config, prim):
  """Eager execution: the primitive compiled on its own. Under
  ``jax.disable_jit()`` jit is turned back on for this one call (the kernel
  runs only as a compiled custom call; jit would otherwise call back here),
  and ``jax.debug_nans``/``debug_infs`` are off inside it: their eager re-run
  of a jit that produced a NaN or inf would call back here too. Its results
  are checked where they are used, as any primitive's."""
  with jax.disable_jit(False), jax.debug_nans(False), jax.debug_infs(False):
    return _jitted_bind(prim, config)(*operands)


def _abstract_eval(*operands, config):
  d = check_operands(config, operands)
  q = operands[0]
  if q.dtype not in KERNEL_DTYPES:
    raise TypeError(f"the fused paths take float32, float16 or bfloat16, got {q.dtype}")
  # From q's aval, so that under shard_map both vary over q's manual mesh axes
  # (and lse is sharded as q's first three dims).
  lse_sharding = NamedSharding(q.sharding.mesh, P(*q.sharding.spec[:3]))
  out_dtype = jnp.dtype(jnp.float32) if config.float32_out else q.dtype
  return (q.update(dtype=out_dtype, weak_type=False),
          q.update(shape=(d.B, d.T, d.N), dtype=jnp.dtype(jnp.float32), weak_type=False,
                   sharding=lse_sharding))


def _bwd_abstract_eval(*operands, config):
  out, lse = _abstract_eval(*operands[:-_RESIDUALS], config=config)
  for name, x, like in zip(("out", "lse", "d_out", "d_lse"), operands[-_RESIDUALS:],
                           (out, lse, out, lse)):
    if x.shape != like.shape:
      raise ValueError(f"{name} must have shape {like.shape}, got {x.shape}")
  return tuple(x.update(weak_type=False) for x in operands[:3])


for _p, _rule in ((fast_attention_p, _abstract_eval), (fast_attention_bwd_p, _bwd_abstract_eval)):
  _p.def_impl(functools.partial(_impl, prim=_p))
  _p.def_abstract_eval(_rule)


# --- batching: fold every vmapped dim into B -------------------------------

def _batch_rule(operands, batch_dims, *, config, prim):
  size = next(x.shape[d] for x, d in zip(operands, batch_dims)
              if d is not None)
  q_dim = batch_dims[0]
  B = operands[0].shape[0 if q_dim is None or q_dim > 0 else 1]
  pairs = tuple(zip(operands, batch_dims))
  n_forward = len(pairs) - (_RESIDUALS if prim is fast_attention_bwd_p else 0)
  q, k, v, bias, mask, q_lens, kv_lens, features, table, k_scale, v_scale = \
      config.split_operands(pairs[:n_forward])
  features = features or shapes.Features()

  def fold(x_d, full_b=True):
    """(B, ...) or vmapped (V, B, ...) -> (V * B, ...).

    With ``full_b=False`` (bias, mask), an unmapped operand whose B dim is 1
    stays as it is: it broadcasts over the folded batch too.
    """
    if x_d is None:
      return None
    x, d = x_d
    if d is None:
      if not full_b and x.shape[0] == 1:
        return x
      x = jnp.broadcast_to(x[None], (size, *x.shape))
    else:
      x = jnp.moveaxis(x, d, 0)
    if x.shape[1] != B:  # a broadcast B dim of 1 under vmap
      x = jnp.broadcast_to(x, (size, B, *x.shape[2:]))
    return x.reshape(size * B, *x.shape[2:])

  def fold_pages():
    """Paged k, v (and their scales) and the block table: vmapped pools (V,
    P, ...) become one pool (V * P, ...), and map v's table entries move up
    by v * P."""
    pools_d = [k, v] + [x for x in (k_scale, v_scale) if x is not None]
    if all(d is None for _, d in pools_d):
      return (k[0], v[0], fold(table), *(x for x, _ in pools_d[2:]))
    pools = [x if d is None else jnp.moveaxis(x, d, 0) for x, d in pools_d]
    pools = [x if d is not None else jnp.broadcast_to(x[None], (size, *x.shape))
             for x, (_, d) in zip(pools, pools_d)]
    P = pools[0].shape[1]
    # A scale's dim of 1 broadcasts over the pages of every map index.
    pools = [x if x.shape[1] == P else jnp.broadcast_to(x, (size, P, *x.shape[2:]))
             for x in pools]
    entries = table[0] if table[1] is None else jnp.moveaxis(table[0], table[1], 0)
    entries = jnp.broadcast_to(entries, (size, B, entries.shape[-1]))
    entries = entries + (jnp.arange(size, dtype=entries.dtype) * P)[:, None, None]
    folded = [x.reshape(size * P, *x.shape[2:]) for x in pools]
    return (*folded[:2], entries.reshape(size * B, entries.shape[-1]), *folded[2:])

  if table is None:
    k_v = (fold(k), fold(v), None, fold(k_scale, False), fold(v_scale, False))
  else:
    k_v = fold_pages()
  # Segment ids are per sequence; sinks and slopes (B|1, N) broadcast as a bias does.
  folded = [fold(q), *k_v[:2], fold(bias, False), fold(mask, False),
            fold(q_lens), fold(kv_lens), fold(features.q_segment_ids),
            fold(features.kv_segment_ids), fold(features.sinks, False),
            fold(features.alibi_slopes, False), *k_v[2:],
            *(fold(r) for r in pairs[n_forward:])]
  results = prim.bind(*(x for x in folded if x is not None), config=config)
  return tuple(r.reshape(size, B, *r.shape[1:]) for r in results), (0,) * len(results)


for _p in (fast_attention_p, fast_attention_bwd_p):
  batching.primitive_batchers[_p] = functools.partial(_batch_rule, prim=_p)


# --- sharding: the kernel runs per shard of batch and heads -----------------

def _spec_of(sharding, ndim):
  spec = tuple(getattr(sharding, "spec", ()) or ())
  return spec + (None,) * (ndim - len(spec))


def _axes_size(mesh, axes) -> int:
  if axes is None:
    return 1
  axes = axes if isinstance(axes, tuple) else (axes,)
  size = 1
  for a in axes:
    size *= mesh.shape[a]
  return size


def _shardings(config, mesh, arg_shapes, backward):
  """Shardings the kernel runs under: q's batch and head axes, if usable.

  Heads are split only if K divides by the head shards: then shard p of the
  query heads, [p N/P, (p+1) N/P), reads exactly shard p of the key/value
  heads. Sequence and head-dim axes are gathered (the masks need global
  indices). The backward's out and d_out are sharded as q, lse and d_lse as
  its first three dims, its results as q, k and v.
  """
  args = jax.tree.leaves(arg_shapes)
  if backward:
    args = args[:-_RESIDUALS]
  q, k, v, bias, mask, q_lens, kv_lens, features, table, k_scale, v_scale = \
      config.split_operands(args)
  B, T, N, H = q.shape
  K = k.shape[2]
  b_axes, _, n_axes, _ = _spec_of(q.sharding, 4)
  if B % _axes_size(mesh, b_axes):
    b_axes = None
  if K % _axes_size(mesh, n_axes):
    n_axes = None
  named = lambda *spec: NamedSharding(mesh, P(*spec))

  def broadcast_spec(x):
    return named(b_axes if x.shape[0] == B else None,
                 n_axes if x.shape[1] == N else None, None, None)

  rows = named(b_axes, None, n_axes, None)
  lse = named(b_axes, None, n_axes)
  # A paged cache's pools hold every sequence's pages: split by heads only.
  keys = rows if table is None else named(None, None, n_axes, None)
  arg_shardings = [rows, keys, keys]
  arg_shardings += [broadcast_spec(x) for x in (bias, mask) if x is not None]
  arg_shardings += [named(b_axes) for x in (q_lens, kv_lens) if x is not None]
  if features is not None:
    arg_shardings += [named(b_axes, None) for x in features[:2] if x is not None]
    arg_shardings += [named(b_axes if x.shape[0] == B else None, n_axes)
                      for x in features[2:] if x is not None]
  if table is not None:
    arg_shardings.append(named(b_axes, None))
  for x in (k_scale, v_scale):
    if x is not None:  # (B|pages|1, S|page_size|1, K|1): as the keys, less H
      spec = keys.spec
      arg_shardings.append(named(*(a if d == f else None
                                   for a, d, f in zip(spec, x.shape, k.shape))))
  if backward:
    arg_shardings += [rows, lse, rows, lse]
    return arg_shardings, (rows, rows, rows)
  return arg_shardings, (rows, lse)


def _unpaged(config, operands):
  """The backward's forward operands, the 8 of a contiguous cache (features
  last): under differentiation ``fastattn_jax.attention`` gathers a paged
  cache's pages and dequantizes a quantized one first, so no backward has a
  block table or scales."""
  return config.split_operands(operands)[:8]


def _call(implementation, backward, config, operands):
  """The fused kernel (or its backward) of ``implementation`` on 4-D operands."""
  if backward:
    return backends.fused_backward_call(
        implementation, config, *_unpaged(config, operands[:-_RESIDUALS]),
        *operands[-_RESIDUALS:])
  return backends.fused_call(implementation, config, *config.split_operands(operands))


def _infer_sharding(implementation, backward, config, mesh, arg_shapes, result_shape):
  return _shardings(config, mesh, arg_shapes, backward)[1]


def _partition(implementation, backward, config, mesh, arg_shapes, result_shape):
  arg_shardings, results = _shardings(config, mesh, arg_shapes, backward)

  def lower_fn(operands):
    return _call(implementation, backward, config, operands)

  return mesh, lower_fn, results, (tuple(arg_shardings),)


def _sharding_rule(implementation, backward, config, mesh, operand_types, result_types):
  """Shardy rule: batch and heads pass through; T, S, H are not split."""
  if backward:
    operand_types = operand_types[:-_RESIDUALS]
  q, k, v, bias, mask, q_lens, kv_lens, features, table, k_scale, v_scale = \
      config.split_operands(operand_types)
  full = ("b", "n", "t", "s")
  dims = lambda t: list(mlir.ir.RankedTensorType(t).shape)
  B, T, N, _ = dims(q)
  sizes = (B, N, T, dims(k)[1])
  keys = "b s k h" if table is None else "pages page k h"
  operands = ["b t n h", keys, keys]
  for idx, x in enumerate((bias, mask)):
    if x is not None:
      operands.append(" ".join(
          f if d == size else f"{f}{idx}" for f, d, size in zip(full, dims(x), sizes)))
  operands += ["b" for x in (q_lens, kv_lens) if x is not None]
  if features is not None:
    operands += [ids for x, ids in zip(features[:2], ("b t", "b s")) if x is not None]
    operands += [f"{'b' if dims(x)[0] == B else f'b_{name}'} n"
                 for x, name in zip(features[2:], ("sinks", "alibi")) if x is not None]
  if table is not None:
    operands.append("b table")
  key_factors = keys.split()[:3]
  for idx, x in enumerate((k_scale, v_scale)):
    if x is not None:  # the keys' factors, a broadcast dim of 1 its own
      operands.append(" ".join(
          f if d == size else f"{f}_scale{idx}"
          for f, d, size in zip(key_factors, dims(x), dims(k)[:3])))
  if backward:
    operands += ["b t n h", "b t n", "b t n h", "b t n"]
    results = "b t n h, b s k h, b s k h"
  else:
    results = "b t n h, b t n"
  rule = f"{', '.join(operands)} -> {results}"
  replicated = ("t", "h", "s") if table is None else ("t", "h", "pages", "page", "table")
  return rule, {"need_replication_factors": replicated}  # in order of first use


@functools.cache
def _partitioned(implementation: str, backward: bool):
  """The fused kernel (or backward) of ``implementation`` wrapped for per-shard execution."""

  @functools.partial(custom_partitioning, static_argnums=(0, 1, 2))
  def call(implementation, backward, config, operands):
    return _call(implementation, backward, config, operands)

  call.def_partition(
      partition=_partition,
      infer_sharding_from_operands=_infer_sharding,
      sharding_rule=_sharding_rule,
  )
  return functools.partial(call, implementation, backward)


# --- lowering ----------------------------------------------------------------

def _lowering(ctx, *operands, config, platform, backward):
  requested = None if config.implementation == "auto" else config.implementation
  q_aval, k_aval = ctx.avals_in[:2]
  implementation, reason = backends.choose_forward(
      requested, platform, dtype=q_aval.dtype, head_dim=q_aval.shape[-1])
  fused = implementation in backends.FUSED_PATHS
  if backward:
    path, reason = backends.choose_backward(implementation, config, q_aval.shape, k_aval.shape,
                                            q_aval.dtype)
    backends.log_path_once("backward", path, platform, reason,
                           warn=fused and path == backends.BLOCKWISE)
    fused = path == implementation
  else:
    backends.log_path_once("forward", implementation, platform, reason)
  if fused:
    if getattr(ctx.module_context.axis_context, "num_devices", None) == 1:
      fn = lambda *ops: _call(implementation, backward, config, ops)
    else:
      fn = lambda *ops: _partitioned(implementation, backward)(config, ops)
  elif backward:
    def fn(*ops):
      *args, features = _unpaged(config, ops[:-_RESIDUALS])
      return attention_grads(config, *args, *ops[-2:], features=features)  # d_out, d_lse
  else:
    def fn(*ops):
      q, k, v, *optional, table, k_scale, v_scale = config.split_operands(ops)
      k, v = plain_kv(k, v, table, k_scale, v_scale, q.dtype)
      out, lse = attention_reference(config, q, k, v, *optional)
      return (out.astype(jnp.float32) if config.float32_out else out), lse
  return mlir.lower_fun(fn, multiple_results=True)(ctx, *operands)


for _platform in ("cpu", "cuda", "rocm", "tpu"):
  for _p, _backward in ((fast_attention_p, False), (fast_attention_bwd_p, True)):
    mlir.register_lowering(
        _p, functools.partial(_lowering, platform=_platform, backward=_backward),
        platform=_platform)
