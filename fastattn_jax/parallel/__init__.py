"""Tensor-parallel attention with FastAttention's tiling-AllReduce.

In tensor-parallel inference each of P devices holds N/P heads; the output
projection is split by rows, so every device ends the block with a partial sum
that must be all-reduced before the next layer, on the critical path.
FastAttention's tiling-AllReduce (Lin et al. 2024, "FastAttention: Extend
FlashAttention2 to NPUs and Low-resource GPUs for Efficient Inference",
section 4.2) splits the query rows into tiles and overlaps each tile's
all-reduce with the next tile's attention and projection.

By concern:

* ``layout``: ``TensorParallel`` (which heads each device of a mesh axis
  holds; grouped-query key/value heads split or replicated),
  ``shard_attention_weights`` and ``compiler_options`` (what XLA needs to
  overlap collectives on GPUs);
* ``block``: ``attention_block``, the block in the plain or tiled schedule,
  for prefill and for decode over a head-sharded KV cache;
* ``tiles``: the tile count: ``Rates`` and ``measure_rates`` (speeds of the
  mesh), ``plan_tiles`` (a pipeline model over them), ``tile_bounds``.

Shapes: B batch, T query rows, D model width, N query heads, K key/value
heads, H head dim, P devices on the axis.
"""

from fastattn_jax.parallel.block import SCHEDULES, attention_block
from fastattn_jax.parallel.layout import TensorParallel, compiler_options, shard_attention_weights
from fastattn_jax.parallel.tiles import (Rates, TilePlan, measure_rates, pipeline_seconds,
                                         plan_tiles, tile_bounds)

__all__ = ["Rates", "SCHEDULES", "TensorParallel", "TilePlan", "attention_block",
           "compiler_options",
           "measure_rates", "pipeline_seconds", "plan_tiles", "shard_attention_weights",
           "tile_bounds"]
