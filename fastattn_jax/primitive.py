"""The ``fast_attention`` JAX primitive and its rules.

Operands: query (B,T,N,H), key and value (B,S,K,H), then whichever of bias,
mask, query lengths and key/value lengths are present (``AttentionConfig``
says which). Results: out (B,T,N,H) and lse (B,T,N) float32.

Rules: abstract evaluation (``shapes.check_operands``); batching (extra
leading dims fold into B); lowering per platform, where a fused path lowers
through ``custom_partitioning`` so inputs sharded along batch or heads run the
kernel shard by shard with no all-gather. Differentiation is a ``custom_vjp``
one level up, in ``fastattn_jax.attention``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir
from jax.sharding import NamedSharding, PartitionSpec as P

from fastattn_jax import backends
from fastattn_jax._jax_internal import require_devices_during_lowering
from fastattn_jax.reference import attention_reference
from fastattn_jax.shapes import KERNEL_DTYPES, AttentionConfig, check_operands

fast_attention_p = Primitive("fast_attention")
fast_attention_p.multiple_results = True
require_devices_during_lowering(fast_attention_p)


def bind(config: AttentionConfig, *operands):
  """Binds the primitive; returns ``(out, lse)``."""
  return tuple(fast_attention_p.bind(*operands, config=config))


@functools.cache
def _jitted_bind(config: AttentionConfig):
  return jax.jit(functools.partial(bind, config))


@fast_attention_p.def_impl
def _impl(*operands, config):
  return _jitted_bind(config)(*operands)


@fast_attention_p.def_abstract_eval
def _abstract_eval(*operands, config):
  d = check_operands(config, operands)
  q = operands[0]
  if q.dtype not in KERNEL_DTYPES:
    raise TypeError(f"the fused paths take float32, float16 or bfloat16, got {q.dtype}")
  # From q's aval, so that under shard_map both vary over q's manual mesh axes
  # (and lse is sharded as q's first three dims).
  lse_sharding = NamedSharding(q.sharding.mesh, P(*q.sharding.spec[:3]))
  return (q.update(weak_type=False),
          q.update(shape=(d.B, d.T, d.N), dtype=jnp.dtype(jnp.float32), weak_type=False,
                   sharding=lse_sharding))


# --- batching: fold every vmapped dim into B -------------------------------

def _batch_rule(operands, batch_dims, *, config):
  size = next(x.shape[d] for x, d in zip(operands, batch_dims)
              if d is not None)
  q_dim = batch_dims[0]
  B = operands[0].shape[0 if q_dim is None or q_dim > 0 else 1]
  q, k, v, bias, mask, q_lens, kv_lens = config.split_operands(
      tuple(zip(operands, batch_dims)))

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

  folded = [fold(q), fold(k), fold(v), fold(bias, False), fold(mask, False),
            fold(q_lens), fold(kv_lens)]
  out, lse = bind(config, *(x for x in folded if x is not None))
  return ((out.reshape(size, B, *out.shape[1:]),
           lse.reshape(size, B, *lse.shape[1:])), (0, 0))


batching.primitive_batchers[fast_attention_p] = _batch_rule


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


def _shardings(config, mesh, arg_shapes):
  """Shardings the kernel runs under: q's batch and head axes, if usable.

  Heads are split only if K divides by the head shards: then shard p of the
  query heads, [p N/P, (p+1) N/P), reads exactly shard p of the key/value
  heads. Sequence and head-dim axes are gathered (the masks need global
  indices).
  """
  args = jax.tree.leaves(arg_shapes)
  q, k, v, bias, mask, q_lens, kv_lens = config.split_operands(args)
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

  arg_shardings = [named(b_axes, None, n_axes, None),
                   named(b_axes, None, n_axes, None),
                   named(b_axes, None, n_axes, None)]
  arg_shardings += [broadcast_spec(x) for x in (bias, mask) if x is not None]
  arg_shardings += [named(b_axes) for x in (q_lens, kv_lens) if x is not None]
  results = (named(b_axes, None, n_axes, None), named(b_axes, None, n_axes))
  return arg_shardings, results


def _infer_sharding(implementation, config, mesh, arg_shapes, result_shape):
  return _shardings(config, mesh, arg_shapes)[1]


def _partition(implementation, config, mesh, arg_shapes, result_shape):
  arg_shardings, results = _shardings(config, mesh, arg_shapes)

  def lower_fn(operands):
    return backends.fused_call(implementation, config, *config.split_operands(operands))

  return mesh, lower_fn, results, (tuple(arg_shardings),)


def _sharding_rule(implementation, config, mesh, operand_types, result_types):
  """Shardy rule: batch and heads pass through; T, S, H are not split."""
  q, k, v, bias, mask, q_lens, kv_lens = config.split_operands(operand_types)
  full = ("b", "n", "t", "s")
  dims = lambda t: list(mlir.ir.RankedTensorType(t).shape)
  B, T, N, _ = dims(q)
  sizes = (B, N, T, dims(k)[1])
  operands = ["b t n h", "b s k h", "b s k h"]
  for idx, x in enumerate((bias, mask)):
    if x is not None:
      operands.append(" ".join(
          f if d == size else f"{f}{idx}" for f, d, size in zip(full, dims(x), sizes)))
  operands += ["b" for x in (q_lens, kv_lens) if x is not None]
  rule = f"{', '.join(operands)} -> b t n h, b t n"
  return rule, {"need_replication_factors": ("t", "h", "s")}  # in order of first use


@functools.cache
def _partitioned(implementation: str):
  """The fused kernel of ``implementation`` wrapped for per-shard execution."""

  @functools.partial(custom_partitioning, static_argnums=(0, 1))
  def call(implementation, config, operands):
    return backends.fused_call(implementation, config, *config.split_operands(operands))

  call.def_partition(
      partition=_partition,
      infer_sharding_from_operands=_infer_sharding,
      sharding_rule=_sharding_rule,
  )
  return functools.partial(call, implementation)


# --- lowering ----------------------------------------------------------------

def _lowering(ctx, *operands, config, platform):
  requested = None if config.implementation == "auto" else config.implementation
  q_aval = ctx.avals_in[0]
  implementation = backends.resolve_implementation(
      requested, backend=platform, dtype=q_aval.dtype, head_dim=q_aval.shape[-1])
  backends.log_path_once(implementation, platform)
  if implementation in backends.FUSED_PATHS:
    if getattr(ctx.module_context.axis_context, "num_devices", None) == 1:
      fn = lambda *ops: backends.fused_call(implementation, config, *config.split_operands(ops))
    else:
      fn = lambda *ops: _partitioned(implementation)(config, ops)
  else:
    fn = lambda *ops: attention_reference(config, *config.split_operands(ops))
  return mlir.lower_fun(fn, multiple_results=True)(ctx, *operands)


for _platform in ("cpu", "cuda", "rocm", "tpu"):
  mlir.register_lowering(
      fast_attention_p, functools.partial(_lowering, platform=_platform),
      platform=_platform)
