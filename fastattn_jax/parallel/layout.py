"""Which heads and weight slices each device of a tensor-parallel mesh axis holds.

Megatron-style tensor parallelism (Shoeybi et al. 2019, "Megatron-LM", section
3): the query, key and value projections are split by columns (heads), the
output projection by rows, so each device computes the attention of its own
heads and a partial sum of the block's output.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class TensorParallel:
  """Attention heads split across the devices of one mesh axis.

  Query heads are split evenly: device d holds heads [d N/P, (d+1) N/P).
  Key/value heads (grouped-query attention, N a multiple of K) are split the
  same way when P divides K; when K < P (K dividing P) each key/value head is
  replicated on the P/K devices whose query heads read it, so every device
  holds one. The key/value weights and caches of this layout therefore have
  ``kv_heads = max(K, P)`` heads (``shard_attention_weights``), and each device
  ``local_kv_heads`` of them.

  Attributes:
    mesh: the device mesh.
    axis: the name of the mesh axis the heads are split over (P devices).
    num_heads, num_kv_heads, head_dim: N, K and H of the attention.

  Raises:
    ValueError: an axis the mesh does not have, N not a multiple of K or of
      P, or K and P of which neither divides the other.
  """

  mesh: jax.sharding.Mesh
  axis: str
  num_heads: int
  num_kv_heads: int
  head_dim: int

  def __post_init__(self):
    if self.axis not in self.mesh.axis_names:
      raise ValueError(f"TensorParallel: axis {self.axis!r} is not an axis of the mesh "
                       f"{dict(self.mesh.shape)}")
    N, K, P_ = self.num_heads, self.num_kv_heads, self.size
    if min(N, K, self.head_dim) <= 0 or N % K:
      raise ValueError(f"TensorParallel: num_heads={N} must be a positive multiple of "
                       f"num_kv_heads={K}, head_dim={self.head_dim} positive")
    if N % P_:
      raise ValueError(f"TensorParallel: num_heads={N} does not split over the {P_} devices "
                       f"of axis {self.axis!r}")
    if K % P_ and P_ % K:
      raise ValueError(f"TensorParallel: num_kv_heads={K} and the {P_} devices of axis "
                       f"{self.axis!r}: one must divide the other (K heads split, or each "
                       f"replicated on P/K devices)")

  @property
  def size(self) -> int:
    """P, the devices along ``axis``."""
    return self.mesh.shape[self.axis]

  @property
  def local_heads(self) -> int:
    """N / P query heads per device."""
    return self.num_heads // self.size

  @property
  def kv_heads(self) -> int:
    """Key/value heads of this layout's weights and caches: max(K, P)."""
    return max(self.num_kv_heads, self.size)

  @property
  def local_kv_heads(self) -> int:
    """Key/value heads per device: K / P, or 1 when K < P."""
    return self.kv_heads // self.size

  def kv_head_sources(self) -> np.ndarray:
    """(kv_heads,) int: which of the K key/value heads each head of this layout is."""
    return np.repeat(np.arange(self.num_kv_heads), self.kv_heads // self.num_kv_heads)

  def sharding(self, *spec) -> NamedSharding:
    """A ``NamedSharding`` of this mesh; ``spec`` names ``axis`` or None per dimension."""
    return NamedSharding(self.mesh, P(*spec))

  def place(self, x, spec: P):
    """``x`` laid out as ``spec`` on this mesh: ``jax.sharding.reshard`` where
    the axis is Explicit (``jax.make_mesh``'s default), a sharding constraint
    where it is Auto (``jax.sharding.Mesh``'s) or Manual."""
    types = dict(zip(self.mesh.axis_names, self.mesh.axis_types))
    if types[self.axis] == jax.sharding.AxisType.Explicit:
      return jax.sharding.reshard(x, NamedSharding(self.mesh, spec))
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

  @property
  def heads_spec(self) -> P:
    """Spec of (B, T|S, heads, H) arrays split by heads: queries, keys, values, caches."""
    return P(None, None, self.axis, None)

  @property
  def weight_specs(self) -> dict[str, P]:
    """Specs of the block's weights: wq, wk, wv (D, heads x H) by columns, wo (N H, D) by rows."""
    columns = P(None, self.axis)
    return {"wq": columns, "wk": columns, "wv": columns, "wo": P(self.axis, None)}


def shard_attention_weights(tp: TensorParallel, wq, wk, wv, wo) -> dict[str, jax.Array]:
  """The attention weights in ``tp``'s layout, placed on its mesh.

  Args:
    tp: the layout.
    wq: (D, N H); wk, wv: (D, K H); wo: (N H, D); heads major in the columns
      (rows of wo), as ``x @ wq`` reshaped to (..., N, H).

  Returns:
    ``{"wq", "wk", "wv", "wo"}``: wq and wo as given, wk and wv of (D,
    ``tp.kv_heads`` H) (each head repeated P/K times when K < P), each placed
    with ``tp.weight_specs`` (a sharding constraint under ``jit``).

  Raises:
    ValueError: shapes that do not match ``tp``.
  """
  N, K, H = tp.num_heads, tp.num_kv_heads, tp.head_dim
  D = wq.shape[0]
  expected = {"wq": (D, N * H), "wk": (D, K * H), "wv": (D, K * H), "wo": (N * H, D)}
  given = {"wq": wq, "wk": wk, "wv": wv, "wo": wo}
  for name, shape in expected.items():
    if given[name].shape != shape:
      raise ValueError(f"shard_attention_weights: {name} must be {shape} for N={N}, K={K}, "
                       f"H={H}, D={D}; got {given[name].shape}")
  if tp.kv_heads != K:
    for name in ("wk", "wv"):
      w = given[name].reshape(D, K, H)
      given[name] = w[:, tp.kv_head_sources()].reshape(D, tp.kv_heads * H)
  return {name: jax.device_put(w, NamedSharding(tp.mesh, tp.weight_specs[name]))
          for name, w in given.items()}


def compiler_options(platform: str) -> dict:
  """XLA compiler options under which the tiled schedule overlaps on ``platform``.

  On GPUs XLA runs an all-reduce asynchronously, but places its start and
  end around other work only when its latency-hiding scheduler is on (off by
  default; JAX's GPU performance guide recommends it). Pass these to
  ``jax.jit(...).lower(...).compile(compiler_options=...)``, or set
  ``--xla_gpu_enable_latency_hiding_scheduler=true`` in ``XLA_FLAGS``.
  """
  return {"xla_gpu_enable_latency_hiding_scheduler": True} if platform in ("gpu", "cuda",
                                                                             "rocm") else {}
