"""How many tiles the tiling-AllReduce splits a block's query rows into: a measured model.

FastAttention's tiling-AllReduce (Lin et al. 2024, "FastAttention: Extend
FlashAttention2 to NPUs and Low-resource GPUs for Efficient Inference",
section 4.2) starts the all-reduce of a block of query rows, O_i W_o with O_i
= attention(Q_i, K, V), while the next block is computed. More tiles hide more
of the all-reduce (only the last tile's is exposed) but each tile pays fixed
costs (kernel launches, the all-reduce's latency, smaller and less efficient
products). ``plan_tiles`` predicts the block's time for each candidate count
from ``Rates`` measured on the mesh (``measure_rates``) and picks the fastest;
pure arithmetic, no device is touched. Times are seconds, sizes bytes and
floating-point operations (FLOP).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp

from fastattn_jax._util import affine_fit
from fastattn_jax.timing import median_seconds
from fastattn_jax.attention import fast_attention
from fastattn_jax.parallel.layout import TensorParallel, compiler_options

logger = logging.getLogger("fastattn_jax")

#: Query rows of a tile are a multiple of this (except the last tile's), so a
#: tile's products keep shapes the GPU's tensor cores run at full rate.
TILE_ALIGN = 64
#: Tile counts ``plan_tiles`` considers.
CANDIDATE_TILES = (1, 2, 4, 8, 16)


@dataclasses.dataclass(frozen=True)
class Rates:
  """Measured speeds of one mesh axis (``measure_rates``); affine models
  ``fixed_s + size / rate`` per operation, on one device of the axis.

  Attributes:
    reduce_bytes_per_s, reduce_fixed_s: an all-reduce across the axis of
      ``b`` bytes per device.
    matmul_flops_per_s, matmul_fixed_s: a matrix product.
    attention_flops_per_s, attention_fixed_s: causal ``fast_attention``
      (FLOP of the visible half of the scores).
    overlap: the share of an all-reduce that runs hidden behind an
      attention running at the same time (0: none, the two serialize; 1:
      all); the rest slows the computation it runs beside.
    device: what was measured, in words.
  """

  reduce_bytes_per_s: float
  reduce_fixed_s: float
  matmul_flops_per_s: float
  matmul_fixed_s: float
  attention_flops_per_s: float
  attention_fixed_s: float
  overlap: float = 1.0
  device: str = ""

  def reduce_s(self, nbytes: float) -> float:
    return self.reduce_fixed_s + nbytes / self.reduce_bytes_per_s

  def matmul_s(self, flops: float) -> float:
    return self.matmul_fixed_s + flops / self.matmul_flops_per_s

  def attention_s(self, flops: float) -> float:
    return self.attention_fixed_s + flops / self.attention_flops_per_s

  def describe(self) -> str:
    """One line: GB/s (1e9 bytes/s), TFLOP/s and microseconds."""
    return (f"{self.device}: all-reduce {self.reduce_bytes_per_s / 1e9:.1f} GB/s + "
            f"{self.reduce_fixed_s * 1e6:.0f} us; matmul {self.matmul_flops_per_s / 1e12:.1f} "
            f"TFLOP/s + {self.matmul_fixed_s * 1e6:.0f} us; attention "
            f"{self.attention_flops_per_s / 1e12:.1f} TFLOP/s + "
            f"{self.attention_fixed_s * 1e6:.0f} us; {self.overlap:.0%} of an all-reduce "
            f"hidden behind attention")


def tile_bounds(rows: int, num_tiles: int) -> tuple[int, ...]:
  """Row boundaries (0, r1, ..., rows) of at most ``num_tiles`` tiles of
  ``rows`` query rows: equal tiles rounded up to ``TILE_ALIGN`` rows, the last
  one shorter; a single tile when ``rows`` <= ``TILE_ALIGN``.

  Raises:
    ValueError: ``rows`` or ``num_tiles`` below 1.
  """
  if rows < 1 or num_tiles < 1:
    raise ValueError(f"tile_bounds: rows={rows} and num_tiles={num_tiles} must be positive")
  step = -(-rows // num_tiles)
  if num_tiles > 1:
    step = -(-step // TILE_ALIGN) * TILE_ALIGN
  return tuple(range(0, rows, step)) + (rows,)


@dataclasses.dataclass(frozen=True)
class TilePlan:
  """The tile count ``plan_tiles`` chose, and the predictions it chose from.

  Attributes:
    bounds: row boundaries of the tiles (``tile_bounds``); ``num_tiles`` of them.
    predicted_s: {tile count: predicted seconds of the block}.
    compute_s: the block's predicted compute alone (no all-reduce).
    reduce_s: one all-reduce of the whole block output (the plain schedule's).
  """

  bounds: tuple[int, ...]
  predicted_s: dict
  compute_s: float
  reduce_s: float

  @property
  def num_tiles(self) -> int:
    return len(self.bounds) - 1

  def explain(self) -> str:
    options = ", ".join(f"{n}: {s * 1e3:.3f} ms" for n, s in self.predicted_s.items())
    return (f"{self.num_tiles} tile(s); predicted {options}; compute alone "
            f"{self.compute_s * 1e3:.3f} ms, one all-reduce {self.reduce_s * 1e3:.3f} ms")


def _tile_seconds(bounds, *, batch, d_model, tp: TensorParallel, keys_before, causal, itemsize,
                  rates: Rates):
  """(prologue_s, [compute_s per tile], [all-reduce_s per tile]) on one device."""
  B, D, H = batch, d_model, tp.head_dim
  Nl, Kl = tp.local_heads, tp.local_kv_heads
  rows = bounds[-1]
  prologue = sum(rates.matmul_s(2 * B * rows * D * heads * H) for heads in (Nl, Kl, Kl))
  compute, reduce = [], []
  for r0, r1 in zip(bounds[:-1], bounds[1:]):
    m = r1 - r0
    keys = keys_before + r0 + (m + 1) / 2 if causal else keys_before + rows
    compute.append(rates.attention_s(4 * B * Nl * H * m * keys)
                   + rates.matmul_s(2 * B * m * Nl * H * D))
    reduce.append(rates.reduce_s(B * m * D * itemsize))
  return prologue, compute, reduce


def pipeline_seconds(prologue: float, compute, reduce, overlap: float = 1.0) -> float:
  """Seconds of the tiled schedule: tile i's all-reduce starts when its compute
  and the previous all-reduce are done, and tile i + 2's compute waits for
  tile i's all-reduce (``attention_block``'s dependencies); tile i's compute
  is slowed by the share ``1 - overlap`` of tile i - 1's all-reduce, which
  runs beside it (``Rates.overlap``)."""
  compute_end, reduce_end = [], []
  for i, (c, a) in enumerate(zip(compute, reduce)):
    start = max(compute_end[-1] if compute_end else prologue,
                reduce_end[i - 2] if i >= 2 else 0.0)
    compute_end.append(start + c + ((1 - overlap) * reduce[i - 1] if i else 0.0))
    reduce_end.append(max(compute_end[-1], reduce_end[-1] if reduce_end else 0.0) + a)
  return reduce_end[-1]


def plan_tiles(rows: int, *, batch: int, d_model: int, tp: TensorParallel, rates: Rates,
               itemsize: int = 2, causal: bool = True, keys_before: int = 0,
               min_tiles: int = 1) -> TilePlan:
  """The tile count that minimizes the predicted time of ``attention_block``.

  For each count n of ``CANDIDATE_TILES`` (>= ``min_tiles``) whose tiles are
  distinct (``tile_bounds``), predicts on one device: the q/k/v projections
  of all rows, then per tile its attention (causal: its rows see
  ``keys_before`` + the rows up to theirs) and output projection, and its
  all-reduce of B x rows x D elements, pipelined as ``pipeline_seconds``
  says with the measured ``rates.overlap``. With ``rows`` <= ``TILE_ALIGN`` (e.g. a decode step, T = 1) there is
  one tile.

  Args:
    rows: T, query rows of the block.
    batch, d_model: B and D.
    tp: the layout (local heads, P).
    rates: measured speeds (``measure_rates``).
    itemsize: bytes per element of the all-reduced output.
    causal: whether a query row sees only the keys up to its own.
    keys_before: positions already in a KV cache before the T rows.
    min_tiles: the smallest count considered (2: the tiled schedule proper).

  Returns:
    A ``TilePlan``.

  Raises:
    ValueError: non-positive sizes.
  """
  for name, value in (("rows", rows), ("batch", batch), ("d_model", d_model),
                      ("itemsize", itemsize), ("min_tiles", min_tiles)):
    if value < 1:
      raise ValueError(f"plan_tiles: {name} must be positive, got {value}")
  kw = dict(batch=batch, d_model=d_model, tp=tp, keys_before=keys_before, causal=causal,
            itemsize=itemsize, rates=rates)
  predicted, plans = {}, {}
  for n in CANDIDATE_TILES:
    bounds = tile_bounds(rows, n)
    count = len(bounds) - 1
    if count >= min_tiles and count not in predicted:
      predicted[count] = pipeline_seconds(*_tile_seconds(bounds, **kw), rates.overlap)
      plans[count] = bounds
  one = tile_bounds(rows, 1)
  prologue, compute, reduce = _tile_seconds(one, **kw)
  if not predicted:  # too few rows to split: one tile
    predicted[1], plans[1] = pipeline_seconds(prologue, compute, reduce), one
  best = min(predicted, key=lambda n: (predicted[n], n))
  return TilePlan(bounds=plans[best], predicted_s=predicted, compute_s=prologue + sum(compute),
                  reduce_s=sum(reduce))


def measure_rates(tp: TensorParallel, d_model: int, dtype=jnp.bfloat16, *,
                  rows: tuple[int, int] = (512, 4096), repeats: int = 5,
                  calls: int = 10) -> Rates:
  """Times the operations ``plan_tiles`` models on ``tp``'s mesh axis.

  * a ``psum`` across ``tp.axis`` of (r, ``d_model``) per device;
  * a product (r, D) x (D, N/P H) on one device of the axis;
  * causal ``fast_attention`` of one sequence of r rows and N/P heads
    (K/P key/value heads) on that device;
  * at the larger r, the all-reduce and an attention on every device in one
    program, independent of each other (compiled with ``compiler_options``):
    ``overlap`` = (t_reduce + t_attention - t_both) / min(t_reduce,
    t_attention), within [0, 1];

  each at the two row counts of ``rows`` (median of ``repeats`` samples of
  ``calls`` calls in a row after a warm-up, ``timing.median_seconds``: the
  host's dispatch of one call overlaps the device work of the one before, as
  inside one compiled block), fitted to ``fixed + size / rate``
  (``_util.affine_fit``).

  Args:
    tp: the layout and mesh.
    d_model: D.
    dtype: of the activations.
    rows: two increasing row counts.
    repeats, calls: timed samples per point, calls per sample.

  Returns:
    ``Rates``.

  Raises:
    ValueError: ``rows`` not two increasing positive counts, or ``d_model`` < 1.
  """
  r1, r2 = rows
  if not 0 < r1 < r2 or d_model < 1:
    raise ValueError(f"measure_rates: rows={rows} must be two increasing positive counts and "
                     f"d_model={d_model} positive")
  device = tp.mesh.devices.flat[0]
  H, Nl, Kl, D = tp.head_dim, tp.local_heads, tp.local_kv_heads, d_model
  spec = jax.sharding.PartitionSpec(tp.axis)

  def reduce_seconds(r):
    psum = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, tp.axis), mesh=tp.mesh,
                                 in_specs=spec, out_specs=spec))
    x = jax.device_put(jnp.ones((tp.size * r, D), dtype), tp.sharding(tp.axis))
    return median_seconds(lambda: psum(x), repeats, calls=calls)

  def on_device(shape, seed):
    return jax.device_put(jax.random.normal(jax.random.key(seed), shape, dtype), device)

  def matmul_seconds(r):
    a, b = on_device((r, D), 0), on_device((D, Nl * H), 1)
    return median_seconds(lambda: jnp.matmul(a, b), repeats, calls=calls)

  def attention_seconds(r):
    q, k = on_device((1, r, Nl, H), 2), on_device((1, r, Kl, H), 3)
    attend = jax.jit(lambda q, k: fast_attention(q, k, k, is_causal=True))
    return median_seconds(lambda: attend(q, k), repeats, calls=calls)

  def overlap_share(r):
    x = jax.device_put(jnp.ones((tp.size * r, D), dtype), tp.sharding(tp.axis))
    q = jax.device_put(jax.random.normal(jax.random.key(4), (tp.size, r, Nl, H), dtype),
                       tp.sharding(tp.axis))
    k = jax.device_put(jax.random.normal(jax.random.key(5), (tp.size, r, Kl, H), dtype),
                       tp.sharding(tp.axis))
    programs = {
        "reduce": (lambda x, q, k: jax.lax.psum(x, tp.axis), spec),
        "attention": (lambda x, q, k: fast_attention(q, k, k, is_causal=True), spec),
        "both": (lambda x, q, k: (jax.lax.psum(x, tp.axis),
                                  fast_attention(q, k, k, is_causal=True)), (spec, spec)),
    }
    seconds = {}
    for name, (body, out_specs) in programs.items():
      compiled = jax.jit(jax.shard_map(body, mesh=tp.mesh, in_specs=(spec, spec, spec),
                                       out_specs=out_specs)).lower(x, q, k).compile(
          compiler_options=compiler_options(device.platform))
      seconds[name] = median_seconds(lambda: compiled(x, q, k), repeats, calls=calls)
    hidden = seconds["reduce"] + seconds["attention"] - seconds["both"]
    return min(max(hidden / min(seconds["reduce"], seconds["attention"]), 0.0), 1.0)

  itemsize = jnp.dtype(dtype).itemsize
  reduce = affine_fit([r * D * itemsize for r in rows], [reduce_seconds(r) for r in rows])
  matmul = affine_fit([2 * r * D * Nl * H for r in rows], [matmul_seconds(r) for r in rows])
  attention = affine_fit([2 * r * r * Nl * H for r in rows], [attention_seconds(r) for r in rows])
  rates = Rates(*reduce, *matmul, *attention, overlap_share(r2),
                device=f"{tp.size} x {device.device_kind} ({device.platform}), axis {tp.axis!r}")
  logger.info("fastattn_jax.parallel: measured %s", rates.describe())
  return rates


@functools.cache
def measured_rates(tp: TensorParallel, d_model: int, dtype_name: str) -> Rates:
  """``measure_rates`` once per layout, width and dtype in this process.

  Runs in a thread of its own: called while a jitted function is traced (the
  block asks at trace time), the measurement must run outside that trace,
  which is per thread.
  """
  with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
    return pool.submit(measure_rates, tp, d_model, jnp.dtype(dtype_name)).result()
