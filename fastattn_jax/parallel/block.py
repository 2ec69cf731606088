"""The tensor-parallel attention block, with FastAttention's tiling-AllReduce.

``attention_block`` computes, for x (B, T, D) replicated over a mesh axis of P
devices, ``sum over devices of attention(x Wq_d, x Wk_d, x Wv_d) Wo_d``: each
device projects its N/P query heads (and K/P key/value heads), attends with
``fast_attention`` (``decode_attention`` over a KV cache), multiplies by its
rows of the output projection and the partial sums are all-reduced
(``lax.psum``) across the axis, inside ``jax.shard_map``.

Two schedules (FastAttention, Lin et al. 2024, section 4.2, "tiling-AllReduce"):

* plain: attention of all T rows, the output projection, one all-reduce;
* tiled: the T query rows split into tiles; tile i's all-reduce is issued as
  soon as its attention and projection are done and runs (XLA's asynchronous
  collectives, on their own stream on GPUs) while tile i + 1 is computed, so
  only the last tile's all-reduce is exposed. Three data dependencies fix the
  pipeline: tile i's attention waits for tile i - 1's output projection (XLA
  would otherwise merge the tiles' products, which share W_o, into one after
  all the attention), tile i's all-reduce waits for tile i - 1's (XLA would
  otherwise combine them into one, after all the compute), and tile i + 2's
  attention waits for tile i's all-reduce (so at most two tiles' outputs are
  in flight, and the order holds on backends that run collectives
  synchronously, like the CPU). Each is an integer 0 computed from the
  earlier value (``_zero_after``) and added where it changes nothing:
  ``lax.optimization_barrier`` would say the same, but XLA:CPU drops barriers
  before it combines all-reduces.

The tile count comes from ``tiles.plan_tiles`` over rates measured on the mesh
(``tiles.measure_rates``, once per process and layout) unless given.
"""

from __future__ import annotations

import logging
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from fastattn_jax.attention import fast_attention, seq_lengths
from fastattn_jax.decode import decode_attention, write
from fastattn_jax.parallel.layout import TensorParallel
from fastattn_jax.parallel.tiles import (CANDIDATE_TILES, Rates, measured_rates, plan_tiles,
                                         tile_bounds)

logger = logging.getLogger("fastattn_jax")

#: The schedules of ``attention_block``.
SCHEDULES = ("auto", "plain", "tiled")


def _check(x, weights, tp: TensorParallel, positions, rotary, lengths, cache, schedule,
           num_tiles):
  if x.ndim != 3 or not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"attention_block: x must be a floating (B, T, D) array, got {x.shape} "
                     f"{x.dtype}")
  B, T, D = x.shape
  N, H, Kt = tp.num_heads, tp.head_dim, tp.kv_heads
  expected = {"wq": (D, N * H), "wk": (D, Kt * H), "wv": (D, Kt * H), "wo": (N * H, D)}
  for name, shape in expected.items():
    if name not in weights or weights[name].shape != shape:
      got = weights[name].shape if name in weights else "nothing"
      raise ValueError(
          f"attention_block: weights[{name!r}] must be {shape} (D={D}, N={N}, H={H}, "
          f"kv_heads={Kt} of the layout: make them with shard_attention_weights); got {got}")
  if (rotary is None) != (positions is None):
    raise ValueError("attention_block: rotary and positions go together (positions: (B, T) "
                     "integer, the token positions rotary receives)")
  if positions is not None and (positions.shape != (B, T)
                                or not jnp.issubdtype(positions.dtype, jnp.integer)):
    raise ValueError(f"attention_block: positions must be integer (B, T) = ({B}, {T}), got "
                     f"{positions.shape} {positions.dtype}")
  if cache is not None:
    if lengths is not None:
      raise ValueError("attention_block: lengths applies without a cache; a cache's own "
                       "lengths say where the new rows go")
    cache_k, cache_v, _ = cache
    if cache_k.shape != cache_v.shape or cache_k.ndim != 4 or cache_k.shape[0] != B or \
        cache_k.shape[2:] != (Kt, H) or cache_k.dtype != x.dtype:
      raise ValueError(f"attention_block: cache k and v must be {x.dtype} (B, S_max, kv_heads, "
                       f"H) = ({B}, S_max, {Kt}, {H}); got {cache_k.shape} {cache_k.dtype} and "
                       f"{cache_v.shape} {cache_v.dtype}")
  if schedule not in SCHEDULES:
    raise ValueError(f"attention_block: schedule must be one of {SCHEDULES}, got {schedule!r}")
  if num_tiles is not None and (int(num_tiles) < 1 or (schedule == "plain" and num_tiles != 1)):
    raise ValueError(f"attention_block: num_tiles={num_tiles} must be positive (and 1, or "
                     f"None, with schedule='plain')")


def _bounds(x, tp, schedule, num_tiles, rates, causal, keys_before):
  B, T, D = x.shape
  if schedule == "plain":
    return (0, T)
  if num_tiles is not None:
    return tile_bounds(T, int(num_tiles))
  if len(tile_bounds(T, CANDIDATE_TILES[-1])) == 2:  # too few rows to split (e.g. decode)
    return (0, T)
  plan = plan_tiles(T, batch=B, d_model=D, tp=tp,
                    rates=rates or measured_rates(tp, D, x.dtype.name),
                    itemsize=x.dtype.itemsize, causal=causal, keys_before=keys_before,
                    min_tiles=2 if schedule == "tiled" else 1)
  logger.info("fastattn_jax.parallel: B=%d T=%d D=%d over %d devices: %s", B, T, D, tp.size,
              plan.explain())
  return plan.bounds


def _zero_after(value):
  """Integer 0 computed from ``value``: a data dependency on it that XLA
  cannot fold away (it tracks value ranges, not bits: (x << 1) & 1 is 0),
  unlike an optimization barrier, which XLA:CPU drops before combining
  all-reduces."""
  first = value.reshape(-1)[0]
  bits = jax.lax.bitcast_convert_type(first, jnp.dtype(f"int{8 * first.dtype.itemsize}"))
  return ((bits << 1) & 1).astype(jnp.int32)


def _local_block(args, *, tp: TensorParallel, bounds, rotary, causal, scale, reduce,
                 implementation):
  """One device's share: its heads' attention and partial output, tile by tile."""
  x, w = args["x"], args["weights"]
  B, T, _ = x.shape
  H = tp.head_dim
  q = (x @ w["wq"]).reshape(B, T, tp.local_heads, H)
  k = (x @ w["wk"]).reshape(B, T, tp.local_kv_heads, H)
  v = (x @ w["wv"]).reshape(B, T, tp.local_kv_heads, H)
  if rotary is not None:
    q, k = rotary(q, args["positions"]), rotary(k, args["positions"])
  lengths = args.get("lengths")
  if "cache" in args:
    cache_k, cache_v, base = args["cache"]
    k, v = write(cache_k, cache_v, base, k, v)
  else:
    base = jnp.zeros((B,), jnp.int32)
  seen = lengths if lengths is not None else jnp.full((B,), T, jnp.int32)
  outputs, previous = [], None
  for i, (r0, r1) in enumerate(zip(bounds[:-1], bounds[1:])):
    ends = base + r1 if causal else seen
    if previous is not None:  # after tile i - 1's product: XLA cannot merge the products
      ends = ends + _zero_after(previous)
    if reduce and i >= 2:  # tile i - 2's all-reduce is done before this tile starts
      ends = ends + _zero_after(outputs[i - 2])
    if causal:  # rows [r0, r1) at positions base + r0 + t see the keys up to theirs
      attn = decode_attention(q[:, r0:r1], k, v, ends, scale=scale,
                              implementation=implementation)
    else:
      attn = fast_attention(q[:, r0:r1], k, v, key_value_seq_lengths=ends, scale=scale,
                            implementation=implementation)
    if lengths is not None:  # padding rows give 0, as fast_attention's query_seq_lengths
      valid = jnp.arange(r0, r1)[None, :] < lengths[:, None]
      attn = jnp.where(valid[:, :, None, None], attn, jnp.zeros((), attn.dtype))
    partial = previous = attn.reshape(B, r1 - r0, tp.local_heads * H) @ w["wo"]
    if reduce:
      if i >= 1:  # issued after tile i - 1's all-reduce: XLA cannot merge them
        partial = partial.at[:, 0, 0].add(_zero_after(outputs[i - 1]).astype(partial.dtype))
      partial = jax.lax.psum(partial, tp.axis)
    outputs.append(partial)
  out = outputs[0] if len(outputs) == 1 else jnp.concatenate(outputs, axis=1)
  return out, k, v


def attention_block(x, weights, tp: TensorParallel, *, positions=None,
                    rotary: Callable | None = None, is_causal: bool = False, lengths=None,
                    cache=None, scale: float | None = None, schedule: str = "auto",
                    num_tiles: int | None = None, rates: Rates | None = None,
                    reduce: bool = True, implementation=None):
  """Tensor-parallel attention and output projection, all-reduced across ``tp.axis``.

  Computes ``attention(x Wq, x Wk, x Wv) Wo`` with the heads split over the
  P devices of ``tp.axis`` (``TensorParallel``), in the plain or the tiled
  schedule (module docstring; FastAttention, Lin et al. 2024, section 4.2).
  Runs under ``jax.jit`` (with named shardings) or eagerly, on any backend
  whose devices form ``tp.mesh``.

  Args:
    x: (B, T, D) float, the block's input (after any normalization),
      replicated over the axis (resharded if not).
    weights: ``{"wq": (D, N H), "wk": (D, kv_heads H), "wv": (D, kv_heads H),
      "wo": (N H, D)}`` in ``tp``'s layout (``shard_attention_weights``); x's
      dtype.
    tp: the head layout and mesh.
    positions: (B, T) integer token positions, passed to ``rotary``.
    rotary: ``rotary(t, positions)`` applied to the queries and keys (B, T,
      heads, H) of each device, e.g. RoPE; None: none.
    is_causal: row t sees keys up to its own position (always, over a cache).
    lengths: (B,) integer valid rows of each sequence (right padding): keys
      past them are not seen and their rows give 0, as ``fast_attention`` with
      query and key/value lengths ``lengths``. Not with ``cache``.
    cache: ``(cache_k, cache_v, cache_lengths)``: decode over a KV cache of
      (B, S_max, kv_heads, H), sharded by heads on the axis, with
      ``cache_lengths`` (B,) positions already written: the T new rows are
      written at ``cache_lengths + t`` (``decode.write``) and attend as in
      ``decode_attention``.
    scale: the logits' scale (default 1/sqrt(H)).
    schedule: "plain", "tiled" (at least two tiles when T allows) or "auto"
      (whichever ``plan_tiles`` predicts faster: one tile counts as plain).
    num_tiles: the tile count (overrides the model); 1 is plain.
    rates: speeds for ``plan_tiles`` (default: measured on ``tp.mesh`` once
      per process, ``tiles.measured_rates``; logged).
    reduce: False skips the all-reduce and returns each device's partial sum
      (to time the compute alone).
    implementation: the attention path, as in ``fast_attention``.

  Returns:
    ``(out, k, v)``: out (B, T, D) in x's dtype, replicated (with ``reduce``
    False: (P B, T, D), device d's partial sums in rows [d B, (d+1) B)); k, v
    the keys (rotated) and values (B, T, kv_heads, H) or, with ``cache``, the
    updated caches, sharded by heads (``tp.heads_spec``).

  Raises:
    ValueError: shapes or dtypes that do not fit (naming the argument and
      the shapes), an unknown schedule, a bad tile count; as
      ``fast_attention`` and ``decode.write`` for their arguments.
  """
  x = jnp.asarray(x)
  _check(x, weights, tp, positions, rotary, lengths, cache, schedule, num_tiles)
  B = x.shape[0]
  args = {"x": x, "weights": {name: weights[name] for name in ("wq", "wk", "wv", "wo")}}
  specs = {"x": P(), "weights": tp.weight_specs}
  if positions is not None:
    args["positions"], specs["positions"] = jnp.asarray(positions, jnp.int32), P()
  if lengths is not None:
    args["lengths"], specs["lengths"] = seq_lengths("lengths", lengths, B), P()
  keys_before = 0
  if cache is not None:
    cache_k, cache_v, cache_lengths = cache
    args["cache"] = (cache_k, cache_v, seq_lengths("cache lengths", cache_lengths, B))
    specs["cache"] = (tp.heads_spec, tp.heads_spec, P())
    keys_before = cache_k.shape[1]
  causal = is_causal or cache is not None
  bounds = _bounds(x, tp, schedule, num_tiles, rates, causal, keys_before)
  # Placed as the specs say (explicit meshes do not reshard at shard_map's door).
  args = jax.tree.map(tp.place, args, specs, is_leaf=lambda x: isinstance(x, P))
  body = jax.shard_map(
      lambda a: _local_block(a, tp=tp, bounds=bounds, rotary=rotary, causal=causal,
                             scale=scale, reduce=reduce, implementation=implementation),
      mesh=tp.mesh, in_specs=(specs,),
      out_specs=(P() if reduce else P(tp.axis), tp.heads_spec, tp.heads_spec))
  return body(args)
