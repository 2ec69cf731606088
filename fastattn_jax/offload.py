"""Host offload of KV caches: a placement planner and a decode-time cache that serves it.

When the KV caches of all L layers of a decoder do not fit in device memory,
the caches of L_CPU layers (the last ones) live in host memory and those of the
first L_GPU = L - L_CPU layers on the device. A decode step serves a
host-resident layer in one of two modes:

* ``"stream"``: the layer's cached keys and values (the positions written
  before decoding, its *prefix*) stay in pinned host memory (JAX memory kind
  ``"pinned_host"`` of the device) and are copied to device memory one host
  layer ahead of use, so the copy overlaps the computation of the layers before
  it (and, across steps, of the device-resident layers). The host copy is never
  written again: the positions decoded since the prefix live in a small
  device-resident *tail* per layer, and the attention over prefix and tail is
  merged by their log-sum-exp. Per token it moves the whole prefix of every
  host layer over PCIe.
* ``"host"``: the layer's cache is a pair of arrays of the host CPU device
  (``jax.devices("cpu")[0]``); the new keys and values are written there and
  its attention runs there (``decode_attention(..., implementation="cpu")``,
  the fused CPU kernel), so only the query, the new keys/values and the output
  cross PCIe (a few KiB per layer and token).

This is the CPU-GPU cooperative strategy of FastAttention (Lin et al. 2024,
"FastAttention: Extend FlashAttention2 to NPUs and Low-resource GPUs for
Efficient Inference"): for long contexts, copying a layer's KV cache to the
GPU costs far more than that layer's attention (about 10x on an H100 by public
reports), so computing the attention of the offloaded layers on the CPU where
their cache lives can win over streaming. Which mode wins depends on the
machine, so ``plan_offload`` predicts both from measured rates
(``measure_rates``) and explains its choice (``OffloadPlan.explain``).

Shapes: B batch, T new tokens per step, N query heads, K key/value heads, H
head dim; per layer the cache is (B, S_max, K, H) with S_max = context +
new_tokens (the prefix of ``context`` positions, then room for
``new_tokens`` decoded ones).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from fastattn_jax.attention import fast_attention
from fastattn_jax.decode import KVCache, decode_attention, write

MODES = ("none", "stream", "host")
GiB = float(1 << 30)


# --- measured rates -------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Rates:
  """Measured speeds the planner predicts from (``measure_rates``).

  A decode step of one layer over ``b`` bytes of KV cache is modelled as
  ``fixed_s + b / bytes_per_s`` on each side, and a host-to-device copy of
  ``b`` bytes as ``b / h2d_bytes_per_s``.

  Attributes:
    h2d_bytes_per_s: pinned host -> device copy bandwidth, bytes/s; None when
      the device has no "pinned_host" memory (no streaming).
    device_bytes_per_s, device_fixed_s: the device's decode attention (write
      of the new positions + ``decode_attention``), bytes of KV read per
      second and seconds per call.
    host_bytes_per_s, host_fixed_s: the same on the host CPU, the copies of
      q, k_new, v_new to the host and of the output back included; None when
      there is no CPU device (e.g. ``JAX_PLATFORMS=cuda``).
    device: the device measured, in words.
  """

  h2d_bytes_per_s: float | None
  device_bytes_per_s: float
  device_fixed_s: float
  host_bytes_per_s: float | None
  host_fixed_s: float | None
  device: str = ""

  def describe(self) -> str:
    """One line of the rates in GB/s (1e9 bytes/s) and microseconds."""
    parts = [f"device decode attention {self.device_bytes_per_s / 1e9:.1f} GB/s + "
             f"{self.device_fixed_s * 1e6:.0f} us per layer"]
    parts.append("host->device copy " + (
        "n/a (no pinned_host memory)" if self.h2d_bytes_per_s is None
        else f"{self.h2d_bytes_per_s / 1e9:.1f} GB/s"))
    parts.append("host CPU decode attention " + (
        "n/a (no CPU device)" if self.host_bytes_per_s is None
        else f"{self.host_bytes_per_s / 1e9:.1f} GB/s + {self.host_fixed_s * 1e6:.0f} us "
             f"per layer (q/k/v to the host and the output back included)"))
    return (f"measured on {self.device}: " if self.device else "") + "; ".join(parts)


def _sharding(device, memory_kind=None):
  return jax.sharding.SingleDeviceSharding(device, memory_kind=memory_kind)


def has_pinned_host(device) -> bool:
  """Whether ``device`` addresses a "pinned_host" memory (streaming needs one)."""
  return any(m.kind == "pinned_host" for m in device.addressable_memories())


def default_host_device():
  """``jax.devices("cpu")[0]``, or None when JAX has no CPU backend."""
  try:
    return jax.devices("cpu")[0]
  except RuntimeError:
    return None


@functools.partial(jax.jit, static_argnames=("scale", "implementation"), donate_argnums=(1, 2))
def _cache_attend(query, cache_k, cache_v, lengths, k_new, v_new, *, scale, implementation):
  """write + decode_attention on one layer's cache (donated); runs where the cache is."""
  cache_k, cache_v = write(cache_k, cache_v, lengths, k_new, v_new)
  out = decode_attention(query, cache_k, cache_v, lengths + k_new.shape[1], scale=scale,
                         implementation=implementation)
  return out, cache_k, cache_v


def _merge(out_a, lse_a, out_b, lse_b, dtype):
  """Softmax-weighted merge of two attention partials over disjoint key sets."""
  m = jnp.maximum(lse_a, lse_b)
  m = jnp.where(jnp.isneginf(m), 0.0, m)
  w_a, w_b = jnp.exp(lse_a - m)[..., None], jnp.exp(lse_b - m)[..., None]
  total = w_a + w_b
  merged = (w_a * out_a.astype(jnp.float32) + w_b * out_b.astype(jnp.float32)) / jnp.where(
      total == 0, 1.0, total)
  return merged.astype(dtype)


@functools.partial(jax.jit, static_argnames=("scale", "implementation"), donate_argnums=(3, 4))
def _stream_attend(query, prefix_k, prefix_v, tail_k, tail_v, prefix_lengths, tail_lengths,
                   k_new, v_new, *, scale, implementation):
  """Attention over a streamed prefix (all of it visible) and a device tail (causal)."""
  T = query.shape[1]
  tail_k, tail_v = write(tail_k, tail_v, tail_lengths, k_new, v_new)
  if T == 1:
    out_p, lse_p = decode_attention(query, prefix_k, prefix_v, prefix_lengths, scale=scale,
                                    return_residual=True, implementation=implementation)
  else:
    out_p, lse_p = fast_attention(query, prefix_k, prefix_v, key_value_seq_lengths=prefix_lengths,
                                  scale=scale, return_residual=True,
                                  implementation=implementation)
  out_t, lse_t = decode_attention(query, tail_k, tail_v, tail_lengths + T, scale=scale,
                                  return_residual=True, implementation=implementation)
  return _merge(out_p, lse_p, out_t, lse_t, query.dtype), tail_k, tail_v


def _median_seconds(fn, repeats):
  jax.block_until_ready(fn())  # compile and warm up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def _affine_fit(sizes, seconds):
  """(bytes_per_s, fixed_s) of t = fixed + bytes / rate through two points, kept non-negative."""
  (b1, b2), (t1, t2) = sizes, seconds
  slope = (t2 - t1) / (b2 - b1)
  if slope <= 0:  # timing noise swamped the size effect: all of t2 counts as transfer
    return b2 / t2, 0.0
  return 1.0 / slope, max(t1 - b1 * slope, 0.0)


def _layer_step_seconds(q, kv_new, S, where, device, implementation, roundtrip, repeats):
  """Median seconds of one layer's write + decode_attention over S cached positions on ``where``.

  With ``roundtrip``, q and the new keys/values are copied from ``device`` to
  ``where`` and the output back, as the host mode does.
  """
  B, _, K, H = kv_new.shape
  zeros = jax.jit(lambda: jnp.zeros((B, S, K, H), kv_new.dtype), out_shardings=_sharding(where))
  state = {"k": zeros(), "v": zeros()}
  lengths = np.full((B,), S - 1, np.int32)

  def step():
    args = (q, kv_new) if not roundtrip else tuple(jax.device_put(x, where) for x in (q, kv_new))
    out, state["k"], state["v"] = _cache_attend(
        args[0], state["k"], state["v"], lengths, args[1], args[1], scale=None,
        implementation=implementation)
    return jax.device_put(out, device) if roundtrip else out

  return _median_seconds(step, repeats)


def measure_rates(batch: int = 1, query_heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
                  dtype=jnp.bfloat16, *, device=None, host_device=None,
                  contexts: tuple[int, int] = (4096, 16384), transfer_bytes: int = 64 << 20,
                  repeats: int = 5) -> Rates:
  """Times the three operations the planner models, on this machine.

  * a copy of ``transfer_bytes`` from the device's pinned host memory to its
    device memory (``jax.device_put`` between memory kinds);
  * one layer's decode step on the device (write of one position +
    ``decode_attention``, T = 1, cache donated) at two contexts;
  * the same on ``host_device`` with the fused CPU kernel, the copies of
    q, k_new, v_new from the device and of the output back included.

  Each is the median of ``repeats`` runs after a warm-up run; the two
  contexts give the affine model ``fixed_s + bytes / bytes_per_s`` (bytes of
  KV read: 2 * B * S * K * H * itemsize), which the planner extrapolates to
  long contexts (linear in the KV bytes, as the kernels are memory-bound there).

  Args:
    batch, query_heads, kv_heads, head_dim: B, N, K, H of the model (N a
      multiple of K).
    dtype: the KV cache dtype.
    device: the accelerator (default ``jax.devices()[0]``).
    host_device: the CPU device (default ``default_host_device()``; None
      there: no host rates).
    contexts: two cache lengths S1 < S2 (tokens).
    transfer_bytes: bytes of the timed host-to-device copy.
    repeats: timed runs per measurement.

  Returns:
    ``Rates``; seconds and bytes/s.

  Raises:
    ValueError: non-positive sizes, ``contexts`` not two increasing values,
      or N not a multiple of K.
  """
  S1, S2 = contexts
  for name, value in (("batch", batch), ("query_heads", query_heads), ("kv_heads", kv_heads),
                      ("head_dim", head_dim), ("transfer_bytes", transfer_bytes),
                      ("repeats", repeats), ("contexts[0]", S1)):
    if value <= 0:
      raise ValueError(f"measure_rates: {name} must be positive, got {value}")
  if S2 <= S1:
    raise ValueError(f"measure_rates: contexts must be two increasing lengths, got {contexts}")
  if query_heads % kv_heads:
    raise ValueError(f"measure_rates: query_heads={query_heads} is not a multiple of "
                     f"kv_heads={kv_heads}")
  device = device or jax.devices()[0]
  host_device = default_host_device() if host_device is None else host_device
  on_device = _sharding(device)
  h2d = None
  if has_pinned_host(device):
    blob = jax.jit(lambda: jnp.ones((transfer_bytes,), jnp.uint8), out_shardings=on_device)()
    pinned = jax.block_until_ready(jax.device_put(blob, _sharding(device, "pinned_host")))
    del blob
    h2d = transfer_bytes / _median_seconds(
        lambda: jax.device_put(pinned, _sharding(device, "device")), repeats)

  q = jax.device_put(jnp.ones((batch, 1, query_heads, head_dim), dtype), on_device)
  kv_new = jax.device_put(jnp.ones((batch, 1, kv_heads, head_dim), dtype), on_device)
  itemsize = jnp.dtype(dtype).itemsize
  sizes = [2 * batch * S * kv_heads * head_dim * itemsize for S in contexts]

  def layer_seconds(where, implementation, roundtrip):
    return _affine_fit(sizes, [
        _layer_step_seconds(q, kv_new, S, where, device, implementation, roundtrip, repeats)
        for S in contexts])

  device_rate, device_fixed = layer_seconds(device, None, False)
  host_rate = host_fixed = None
  if host_device is not None:
    host_rate, host_fixed = layer_seconds(host_device, "cpu", True)
  return Rates(h2d, device_rate, device_fixed, host_rate, host_fixed,
               device=f"{device.device_kind} ({device.platform})")


# --- the planner (pure arithmetic) --------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Prediction:
  """Per-token time and memory of one mode at its smallest feasible L_CPU.

  Attributes:
    mode: "none", "stream" or "host".
    host_layers: L_CPU (None: the mode cannot fit the budgets).
    seconds: predicted seconds per decode step (None: infeasible or no rates).
    device_bytes, host_bytes: memory the KV cache takes on each side.
    detail: how the time or the infeasibility comes about, in words.
  """

  mode: str
  host_layers: int | None
  seconds: float | None
  device_bytes: int
  host_bytes: int
  detail: str


@dataclasses.dataclass(frozen=True)
class OffloadPlan:
  """Where each layer's KV cache lives and how host-resident layers are served.

  Made by ``plan_offload``; read by ``OffloadedKVCache``.

  Attributes:
    mode: "none" (every layer on the device), "stream" or "host".
    num_layers, batch, context, max_len, kv_heads, head_dim, dtype: L, B,
      the prefix length, S_max = context + new tokens, K, H and the dtype name.
    device_layers, host_layers: layer indices (L_GPU and L_CPU of them).
    device_budget_bytes, host_budget_bytes: the budgets planned against.
    device_kv_bytes: device-resident layers' caches (L_GPU x B x S_max x K x H
      x 2 x itemsize).
    staging_bytes: device buffers of streamed prefixes (2 host layers' worth
      in flight at most; 0 unless "stream").
    tail_bytes: device tails of streamed layers (new positions; 0 unless
      "stream").
    host_kv_bytes: host-resident caches.
    predictions: a ``Prediction`` per mode, in ``MODES`` order.
    rates: the rates predicted from (None when none were given).
    reason: why this mode, in words.
    longest_device_context: the longest context whose whole cache (with the
      same new tokens) fits the device budget, tokens.
  """

  mode: str
  num_layers: int
  batch: int
  context: int
  max_len: int
  kv_heads: int
  head_dim: int
  dtype: str
  device_layers: tuple[int, ...]
  host_layers: tuple[int, ...]
  device_budget_bytes: int
  host_budget_bytes: int
  device_kv_bytes: int
  staging_bytes: int
  tail_bytes: int
  host_kv_bytes: int
  predictions: tuple[Prediction, ...]
  rates: Rates | None
  reason: str
  longest_device_context: int

  @property
  def device_bytes(self) -> int:
    """All device memory the plan's KV takes: resident caches, staging and tails."""
    return self.device_kv_bytes + self.staging_bytes + self.tail_bytes

  def prediction(self, mode: str) -> Prediction:
    """The ``Prediction`` of ``mode`` ("none", "stream" or "host").

    Raises:
      ValueError: another mode name.
    """
    if mode not in MODES:
      raise ValueError(f"prediction: mode must be one of {MODES}, got {mode!r}")
    return self.predictions[MODES.index(mode)]

  def explain(self) -> str:
    """A human-readable account of the plan: placement, bytes, predicted times, the choice."""
    layer = _layer_bytes(self.batch, self.max_len, self.kv_heads, self.head_dim, self.dtype)
    lines = [
        f"KV cache plan: mode {self.mode!r}, L_GPU = {len(self.device_layers)} device layers, "
        f"L_CPU = {len(self.host_layers)} host layers",
        f"  KV cache: {self.num_layers} layers x (B={self.batch}, S_max={self.max_len}, "
        f"K={self.kv_heads}, H={self.head_dim}) {self.dtype} = {format_bytes(layer)} per layer, "
        f"{format_bytes(layer * self.num_layers)} in all (context {self.context} + "
        f"{self.max_len - self.context} new positions)",
        f"  device layers: {_ranges(self.device_layers)} ({format_bytes(self.device_kv_bytes)} of "
        f"device memory)",
    ]
    if self.host_layers:
      where = ("pinned host memory, streamed to the device one layer ahead"
               if self.mode == "stream" else
               "host CPU memory, attention computed on the CPU")
      lines.append(f"  host layers: {_ranges(self.host_layers)} "
                   f"({format_bytes(self.host_kv_bytes)} of {where}; the last layers, so the "
                   f"device layers run as one jitted call)")
    if self.mode == "stream":
      lines.append(f"  stream buffers: {format_bytes(self.staging_bytes)} of device memory for 2 "
                   f"layers' prefixes in flight, {format_bytes(self.tail_bytes)} for the decoded "
                   f"positions of host layers (device tails)")
    lines.append(f"  memory: device {format_bytes(self.device_bytes)} of a "
                 f"{format_bytes(self.device_budget_bytes)} budget; host "
                 f"{format_bytes(self.host_kv_bytes)} of {format_bytes(self.host_budget_bytes)}")
    lines.append(f"  all-on-device fits up to a context of {self.longest_device_context} tokens "
                 f"(with {self.max_len - self.context} new) in this device budget")
    if self.rates is not None:
      lines.append(f"  rates {self.rates.describe()}")
    lines.append("  predicted per-token time (decode step: attention and layer weights):")
    for p in self.predictions:
      time_text = "-" if p.seconds is None else f"{p.seconds * 1e3:.2f} ms"
      layers = "" if p.host_layers is None else f" L_CPU={p.host_layers}"
      lines.append(f"    {p.mode:6s} {time_text:>11s}{layers}: {p.detail}")
    lines.append(f"  chosen: {self.mode} ({self.reason})")
    return "\n".join(lines)


class OffloadError(ValueError):
  """The KV cache cannot be placed within the budgets; the message says what would fit."""


def format_bytes(nbytes) -> str:
  """Bytes as text: GiB (2**30), or MiB / KiB below one GiB / MiB."""
  for unit, size in (("GiB", GiB), ("MiB", float(1 << 20))):
    if nbytes >= size:
      return f"{nbytes / size:.2f} {unit}"
  return f"{nbytes / 1024:.2f} KiB"


def _ranges(layers) -> str:
  if not layers:
    return "none"
  parts, start = [], layers[0]
  for prev, cur in zip(layers, (*layers[1:], None)):
    if cur != prev + 1:
      parts.append(str(start) if start == prev else f"{start}-{prev}")
      start = cur
  return ", ".join(parts)


def _layer_bytes(batch, length, kv_heads, head_dim, dtype) -> int:
  return 2 * batch * length * kv_heads * head_dim * jnp.dtype(dtype).itemsize


def _memory(mode, n_host, L, full, prefix, tail):
  """(device bytes, host bytes) of ``mode`` with ``n_host`` host layers."""
  device = (L - n_host) * full
  if mode == "stream" and n_host:
    return device + 2 * prefix + n_host * tail, n_host * prefix
  return device, n_host * full


def _fits(mode, n_host, L, full, prefix, tail, device_budget, host_budget):
  device, host = _memory(mode, n_host, L, full, prefix, tail)
  return device <= device_budget and host <= host_budget


def longest_context(num_layers: int, batch: int, new_tokens: int, kv_heads: int, head_dim: int,
                    dtype, *, device_budget_bytes: int, host_budget_bytes: int = 0,
                    modes=("none",), limit: int = 1 << 24) -> int:
  """The longest context (prefix tokens) whose KV cache fits the budgets in one of ``modes``.

  Pure arithmetic (bytes as in ``plan_offload``), by bisection over the
  context, which memory grows with monotonically.

  Args:
    num_layers, batch, new_tokens, kv_heads, head_dim, dtype: L, B, the
      decoded positions, K, H and the cache dtype.
    device_budget_bytes, host_budget_bytes: bytes.
    modes: any of "none", "stream", "host"; an offload mode may put any
      number of layers on the host.
    limit: the largest context considered.

  Returns:
    The context in tokens (0 when not even an empty prefix fits).
  """
  def fits(context):
    full = _layer_bytes(batch, context + new_tokens, kv_heads, head_dim, dtype)
    prefix = _layer_bytes(batch, context, kv_heads, head_dim, dtype)
    tail = _layer_bytes(batch, new_tokens, kv_heads, head_dim, dtype)
    return any(_fits(mode, n, num_layers, full, prefix, tail, device_budget_bytes,
                     host_budget_bytes)
               for mode in modes
               for n in ((0,) if mode == "none" else range(num_layers + 1)))

  lo, hi = 0, limit
  if not fits(0):
    return 0
  while lo < hi:
    mid = (lo + hi + 1) // 2
    lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
  return lo


def plan_offload(num_layers: int, batch: int, context: int, new_tokens: int, kv_heads: int,
                 head_dim: int, dtype, *, device_budget_bytes: int, host_budget_bytes: int,
                 rates: Rates | None = None, mode: str = "auto", host_layers: int | None = None,
                 weight_bytes_per_layer: int = 0) -> OffloadPlan:
  """Places each layer's KV cache in device or host memory and picks how to serve host layers.

  Pure arithmetic (no device is touched), after FastAttention's CPU-GPU
  cooperative strategy (Lin et al. 2024). Memory, in bytes, with S_max =
  context + new_tokens and a layer of length S taking 2 * B * S * K * H *
  itemsize:

  * "none": all L layers of S_max on the device.
  * "stream" with L_CPU host layers: L_GPU layers of S_max plus 2 prefixes
    (context) in flight plus L_CPU tails (new_tokens) on the device; L_CPU
    prefixes in host memory.
  * "host": L_GPU layers of S_max on the device, L_CPU of S_max on the host.

  Each offload mode takes the smallest L_CPU that fits the device budget (the
  host layers are the last L_CPU ones, so the device layers run as one jitted
  call). Predicted per-token time, with a device layer's time t_dev =
  device_fixed_s + (KV bytes of the context + weight_bytes_per_layer) /
  device_bytes_per_s:

  * none: L * t_dev;
  * stream: max(L * t_dev, L_CPU * prefix bytes / h2d_bytes_per_s), as the
    copies overlap the computation;
  * host: L_GPU * t_dev + L_CPU * (weight_bytes_per_layer / device_bytes_per_s
    + host_fixed_s + KV bytes / host_bytes_per_s), as each host layer's
    attention sits between its projections on the device.

  "auto" takes "none" when everything fits, else the offload mode of least
  predicted time.

  Args:
    num_layers, batch, context, new_tokens, kv_heads, head_dim: L, B, the
      prefix positions (written before decoding), the decoded positions
      (capacity), K and H.
    dtype: the cache dtype (name or dtype).
    device_budget_bytes: device memory the KV cache and the stream buffers
      may take (weights and workspace already excluded).
    host_budget_bytes: host memory the host-resident caches may take.
    rates: from ``measure_rates``; needed when an offload mode must be
      predicted ("auto" with offload).
    mode: "auto", "none", "stream" or "host".
    host_layers: force L_CPU (then ``mode`` must be "stream" or "host").
    weight_bytes_per_layer: bytes of one layer's weights (read once per step
      on the device), for the predicted times.

  Returns:
    An ``OffloadPlan``.

  Raises:
    ValueError: non-positive sizes, negative budgets, an unknown mode,
      ``host_layers`` out of [0, L] or with mode "auto"/"none", or "auto"
      needing offload without ``rates``.
    OffloadError: (a ValueError) nothing fits the budgets in the requested
      mode; the message gives the device budget or host memory that would
      fit, and the longest context that fits.
  """
  for name, value in (("num_layers", num_layers), ("batch", batch), ("context", context),
                      ("new_tokens", new_tokens), ("kv_heads", kv_heads),
                      ("head_dim", head_dim)):
    if int(value) <= 0:
      raise ValueError(f"plan_offload: {name} must be positive, got {value}")
  for name, value in (("device_budget_bytes", device_budget_bytes),
                      ("host_budget_bytes", host_budget_bytes),
                      ("weight_bytes_per_layer", weight_bytes_per_layer)):
    if value < 0:
      raise ValueError(f"plan_offload: {name} must be >= 0, got {value}")
  if mode not in ("auto", *MODES):
    raise ValueError(f"plan_offload: mode must be one of {('auto', *MODES)}, got {mode!r}")
  if host_layers is not None:
    if mode not in ("stream", "host"):
      raise ValueError(f"plan_offload: host_layers={host_layers} needs mode 'stream' or "
                       f"'host', got mode={mode!r}")
    if not 0 <= host_layers <= num_layers:
      raise ValueError(f"plan_offload: host_layers must be in [0, {num_layers}], got "
                       f"{host_layers}")
  dtype = jnp.dtype(dtype).name
  L = num_layers
  max_len = context + new_tokens
  full = _layer_bytes(batch, max_len, kv_heads, head_dim, dtype)
  prefix = _layer_bytes(batch, context, kv_heads, head_dim, dtype)
  tail = _layer_bytes(batch, new_tokens, kv_heads, head_dim, dtype)
  budgets = (device_budget_bytes, host_budget_bytes)

  def smallest_host_layers(m):
    if m == "none":
      return 0 if _fits(m, 0, L, full, prefix, tail, *budgets) else None
    if host_layers is not None:
      return host_layers if _fits(m, host_layers, L, full, prefix, tail, *budgets) else None
    return next((n for n in range(L + 1) if _fits(m, n, L, full, prefix, tail, *budgets)),
                None)

  def available(m):
    if m == "stream" and rates is not None and rates.h2d_bytes_per_s is None:
      return "the device has no pinned_host memory"
    if m == "host" and rates is not None and rates.host_bytes_per_s is None:
      return "JAX has no CPU device"
    return None

  def predict(m):
    missing = available(m)
    n = None if missing else smallest_host_layers(m)
    device, host = _memory(m, n or 0, L, full, prefix, tail)
    if missing:
      return Prediction(m, None, None, device, host, f"unavailable: {missing}")
    if n is None:
      return Prediction(m, None, None, device, host, "does not fit: " + _shortfall(
          m, host_layers, L, full, prefix, tail, budgets))
    if rates is None:
      return Prediction(m, n, None, device, host, "fits; no rates measured")
    t_dev = rates.device_fixed_s + (prefix + weight_bytes_per_layer) / rates.device_bytes_per_s
    if m == "none" or n == 0:
      return Prediction(m, n, L * t_dev, device, host,
                        f"{L} device layers x {t_dev * 1e3:.3f} ms")
    if m == "stream":
      compute, copy = L * t_dev, n * prefix / rates.h2d_bytes_per_s
      bound = "copy-bound" if copy >= compute else "compute-bound"
      return Prediction(m, n, max(compute, copy), device, host,
                        f"{bound}: copies {n} x {format_bytes(prefix)} / "
                        f"{rates.h2d_bytes_per_s / 1e9:.1f} GB/s = {copy * 1e3:.2f} ms, "
                        f"overlapped with {compute * 1e3:.2f} ms of device compute")
    t_host = (weight_bytes_per_layer / rates.device_bytes_per_s + rates.host_fixed_s
              + prefix / rates.host_bytes_per_s)
    return Prediction(m, n, (L - n) * t_dev + n * t_host, device, host,
                      f"{L - n} device layers x {t_dev * 1e3:.3f} ms + {n} CPU layers x "
                      f"{t_host * 1e3:.3f} ms, in sequence")

  predictions = tuple(predict(m) for m in MODES)
  by_mode = dict(zip(MODES, predictions))
  if mode == "auto":
    if by_mode["none"].host_layers is not None:
      chosen, reason = "none", f"all {L} layers fit in the device budget"
    else:
      candidates = [p for p in predictions[1:] if p.host_layers is not None]
      if candidates and rates is None:
        raise ValueError("plan_offload: the KV cache needs offload; pass rates (measure_rates) "
                         "so that mode='auto' can choose between 'stream' and 'host'")
      if not candidates:
        raise OffloadError(_no_fit_message(L, batch, context, new_tokens, kv_heads, head_dim,
                                           dtype, (full, prefix, tail), budgets, ("stream", "host"),
                                           by_mode))
      best = min(candidates, key=lambda p: p.seconds)
      chosen = best.mode
      others = [p for p in candidates if p is not best]
      reason = (f"predicted {best.seconds * 1e3:.2f} ms per token" + "".join(
          f", {o.seconds / best.seconds:.2f}x faster than {o.mode!r} ({o.seconds * 1e3:.2f} ms)"
          for o in others) + ("" if others else ", the only offload mode that fits"))
  else:
    chosen = mode
    if by_mode[mode].host_layers is None:
      if by_mode[mode].detail.startswith("unavailable"):
        raise ValueError(f"plan_offload: mode {mode!r} is {by_mode[mode].detail}")
      raise OffloadError(_no_fit_message(L, batch, context, new_tokens, kv_heads, head_dim,
                                         dtype, (full, prefix, tail), budgets, (mode,), by_mode))
    reason = f"requested (mode={mode!r}" + (
        f", host_layers={host_layers})" if host_layers is not None else ")")
  n = by_mode[chosen].host_layers
  if chosen != "none" and n == 0:
    reason += f"; all {L} layers fit in the device budget, so nothing is offloaded"
    chosen = "none"
  device_kv = (L - n) * full
  staging, tails = ((2 * prefix, n * tail) if chosen == "stream" else (0, 0))
  return OffloadPlan(
      mode=chosen, num_layers=L, batch=batch, context=context, max_len=max_len,
      kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
      device_layers=tuple(range(L - n)), host_layers=tuple(range(L - n, L)),
      device_budget_bytes=device_budget_bytes, host_budget_bytes=host_budget_bytes,
      device_kv_bytes=device_kv, staging_bytes=staging, tail_bytes=tails,
      host_kv_bytes=_memory(chosen, n, L, full, prefix, tail)[1],
      predictions=predictions, rates=rates, reason=reason,
      longest_device_context=longest_context(L, batch, new_tokens, kv_heads, head_dim, dtype,
                                             device_budget_bytes=device_budget_bytes))


def _requirements(mode, L, full, prefix, tail, budgets):
  """What ``mode`` needs: (host bytes within the device budget, device bytes within the host one).

  Either is None when no number of host layers meets the one budget.
  """
  device_budget, host_budget = budgets
  counts = (0,) if mode == "none" else range(L + 1)
  usage = [_memory(mode, n, L, full, prefix, tail) for n in counts]
  host_needed = min((h for d, h in usage if d <= device_budget), default=None)
  device_needed = min((d for d, h in usage if h <= host_budget), default=None)
  return host_needed, device_needed


def _shortfall(mode, host_layers, L, full, prefix, tail, budgets):
  """Why ``mode`` does not fit the budgets, in words."""
  device_budget, host_budget = budgets
  if mode == "none":
    return (f"needs {format_bytes(L * full)} of device memory for all {L} layers, budget "
            f"{format_bytes(device_budget)}")
  if host_layers is not None:
    device, host = _memory(mode, host_layers, L, full, prefix, tail)
    return (f"with L_CPU={host_layers} it takes {format_bytes(device)} of device memory (budget "
            f"{format_bytes(device_budget)}) and {format_bytes(host)} of host memory (budget "
            f"{format_bytes(host_budget)})")
  host_needed, _ = _requirements(mode, L, full, prefix, tail, budgets)
  if host_needed is None:
    least = _memory(mode, L, L, full, prefix, tail)[0]
    return (f"needs {format_bytes(least)} of device memory even with all {L} layers on the "
            f"host, budget {format_bytes(device_budget)}")
  return (f"the device budget leaves {format_bytes(host_needed)} of KV for host memory, budget "
          f"{format_bytes(host_budget)}")


def _no_fit_message(L, batch, context, new_tokens, kv_heads, head_dim, dtype, sizes, budgets,
                    modes, by_mode):
  full, prefix, tail = sizes
  device_budget, host_budget = budgets
  shape = (f"{L} layers x (B={batch}, S_max={context + new_tokens}, K={kv_heads}, "
           f"H={head_dim}) {dtype}, {format_bytes(full)} per layer, {format_bytes(L * full)} in "
           f"all")
  fixes = []
  for m in modes:
    host_needed, device_needed = _requirements(m, L, full, prefix, tail, budgets)
    if m != "none" and host_needed is not None:
      fixes.append(f"{format_bytes(host_needed)} of host memory (mode {m!r})")
    if device_needed is not None:
      fixes.append(f"a device budget of {format_bytes(device_needed)} (mode {m!r})")
  longest = longest_context(L, batch, new_tokens, kv_heads, head_dim, dtype,
                            device_budget_bytes=device_budget, host_budget_bytes=host_budget,
                            modes=modes)
  fixes.append(f"a context of at most {longest} tokens (with {new_tokens} new)"
               if longest else "no context at all with these budgets")
  hint = ("; offloading to host memory (mode 'auto', 'stream' or 'host') may fit"
          if modes == ("none",) else "")
  return (f"the KV cache does not fit: {shape}; device budget {format_bytes(device_budget)}, host "
          f"budget {format_bytes(host_budget)}. " + "; ".join(
              f"mode {m!r}: {by_mode[m].detail}" for m in modes)
          + ". It would fit with " + ", or ".join(fixes) + hint + ".")


def available_host_bytes() -> int:
  """Host memory available to new allocations (``MemAvailable`` of /proc/meminfo), bytes.

  Falls back to the free physical pages (``os.sysconf``) where /proc/meminfo
  is missing.
  """
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


# --- the cache ------------------------------------------------------------------------

class OffloadedKVCache:
  """A decoder's KV cache placed by an ``OffloadPlan``: device layers, host layers, lengths.

  Device-resident layers form a ``KVCache`` (``device``; slot i holds layer
  ``plan.device_layers[i]``) that jitted steps update in place by donating it
  and storing the result back into ``device``. Host-resident layers are
  served by ``attend`` as the plan's mode says (see the module docstring);
  ``attend`` also serves device layers, one jitted call each.

  Not a pytree: the object updates itself (streaming keeps copies in flight
  across calls). One ``lengths`` (B,) for all layers, kept on the host.
  """

  def __init__(self, plan: OffloadPlan, device_cache: KVCache, host_k: dict, host_v: dict,
               tails: dict, lengths: np.ndarray, *, device, host_device):
    self.plan = plan
    self.device = device_cache
    self._host_k, self._host_v = host_k, host_v
    self._tails = tails
    self._lengths = lengths
    self._prefix_lengths = lengths.copy()
    self._accelerator = device
    self._host_device = host_device
    self._slots = {layer: i for i, layer in enumerate(plan.device_layers)}
    self._staged: dict[int, tuple] = {}
    self._last_stream_out = None

  @classmethod
  def build(cls, plan: OffloadPlan, fill: Callable[[int, int], tuple], *, device=None,
            host_device=None, progress: bool = False) -> "OffloadedKVCache":
    """Fills each layer's cache from ``fill`` and places it as ``plan`` says, one layer at a time.

    Host-resident layers come first, each copied to host memory and waited for
    before the next is made, so at most one layer's fill is in device memory
    beyond the plan's.

    Args:
      plan: from ``plan_offload``.
      fill: ``fill(layer, length) -> (k, v)``, each (B, length, K, H) of the
        plan's dtype on ``device``, ``length`` >= ``plan.context``; positions
        [0, plan.context) are the prefix, later ones are never read before
        being written.
      device: the accelerator (default ``jax.devices()[0]``).
      host_device: the CPU device for mode "host" (default
        ``default_host_device()``).
      progress: show a tqdm bar over the layers.

    Returns:
      The cache, ``lengths`` = context for every sequence.

    Raises:
      ValueError: ``fill`` returned arrays of another shape or dtype, or
        mode "host" without a CPU device.
    """
    device = device or jax.devices()[0]
    if plan.mode == "host":
      host_device = default_host_device() if host_device is None else host_device
      if host_device is None:
        raise ValueError("OffloadedKVCache.build: mode 'host' needs a CPU device, and JAX has "
                         "none (JAX_PLATFORMS excludes cpu?)")
    expected = lambda length: (plan.batch, length, plan.kv_heads, plan.head_dim)

    def get(layer, length):
      k, v = fill(layer, length)
      for name, x in (("k", k), ("v", v)):
        if x.shape != expected(length) or jnp.dtype(x.dtype).name != plan.dtype:
          raise ValueError(f"OffloadedKVCache.build: fill({layer}, {length}) gave {name} of "
                           f"{x.shape} {x.dtype}, expected {expected(length)} {plan.dtype}")
      return k, v

    host_k, host_v, tails = {}, {}, {}
    zero_tail = jax.jit(lambda: jnp.zeros(expected(plan.max_len - plan.context), plan.dtype),
                        out_shardings=_sharding(device))
    device_k, device_v = [], []
    order = (*plan.host_layers, *plan.device_layers)
    for layer in tqdm(order, desc="filling the KV cache", unit="layer", disable=not progress):
      if layer in plan.host_layers:
        if plan.mode == "stream":
          target = _sharding(device, "pinned_host")
          k, v = get(layer, plan.context)
          tails[layer] = (zero_tail(), zero_tail())
        else:
          target = host_device
          k, v = get(layer, plan.max_len)
        host_k[layer], host_v[layer] = jax.block_until_ready(
            (jax.device_put(k, target), jax.device_put(v, target)))
        del k, v
      else:
        k, v = get(layer, plan.max_len)
        device_k.append(jax.block_until_ready(k))
        device_v.append(jax.block_until_ready(v))
    lengths = np.full((plan.batch,), plan.context, np.int32)
    device_cache = KVCache(k=tuple(device_k), v=tuple(device_v),
                           lengths=jax.device_put(lengths, device))
    return cls(plan, device_cache, host_k, host_v, tails, lengths, device=device,
               host_device=host_device)

  @property
  def lengths(self) -> np.ndarray:
    """(B,) int32, positions written in every layer (a copy)."""
    return self._lengths.copy()

  def slot(self, layer: int) -> int | None:
    """The index of ``layer`` in ``device`` (None for a host-resident layer)."""
    return self._slots.get(layer)

  def check_room(self, T: int) -> None:
    """Raises ValueError unless T more positions fit (lengths + T <= plan.max_len)."""
    if np.any(self._lengths + T > self.plan.max_len):
      raise ValueError(
          f"KV cache overflow: writing T={T} new positions at lengths {self._lengths} goes "
          f"past S_max={self.plan.max_len} (context {self.plan.context} + "
          f"{self.plan.max_len - self.plan.context} new positions planned)")

  def attend(self, layer: int, query, k_new, v_new, *, scale=None, implementation=None):
    """Writes T new positions into ``layer`` and attends the T queries over its cache.

    Same result as ``KVCache.attend`` (causal among the new tokens, aligned to
    the end of each sequence); ``lengths`` unchanged (call ``advance(T)``
    once every layer is done).

    Args:
      layer: the layer index.
      query: (B, T, N, H) on the device; k_new, v_new: (B, T, K, H) there.
      scale: as in ``decode_attention``.
      implementation: for device-resident and streamed layers, as in
        ``decode_attention``; host-computed layers use "cpu".

    Returns:
      out (B, T, N, H) on the device, query's dtype.

    Raises:
      ValueError: positions past ``plan.max_len``, a layer out of range, or
        shapes that do not fit (as ``decode_attention``).
    """
    if not 0 <= layer < self.plan.num_layers:
      raise ValueError(f"attend: layer must be in [0, {self.plan.num_layers}), got {layer}")
    T = k_new.shape[1]
    self.check_room(T)
    slot = self.slot(layer)
    if slot is not None:
      out, k, v = _cache_attend(query, self.device.k[slot], self.device.v[slot],
                                self.device.lengths, k_new, v_new, scale=scale,
                                implementation=implementation)
      self.device = dataclasses.replace(
          self.device, k=self.device.k[:slot] + (k,) + self.device.k[slot + 1:],
          v=self.device.v[:slot] + (v,) + self.device.v[slot + 1:])
      return out
    if self.plan.mode == "host":
      q, kn, vn = (jax.device_put(x, self._host_device) for x in (query, k_new, v_new))
      out, self._host_k[layer], self._host_v[layer] = _cache_attend(
          q, self._host_k[layer], self._host_v[layer], self._lengths, kn, vn, scale=scale,
          implementation="cpu")
      return jax.device_put(out, self._accelerator)
    return self._attend_streamed(layer, query, k_new, v_new, scale, implementation)

  def _stage(self, layer):
    target = _sharding(self._accelerator, "device")
    return (jax.device_put(self._host_k[layer], target),
            jax.device_put(self._host_v[layer], target))

  def _attend_streamed(self, layer, query, k_new, v_new, scale, implementation):
    staged = self._staged.pop(layer, None) or self._stage(layer)
    # Bound the prefixes in device memory to two (this one and the next): the
    # previous streamed layer's buffers are freed once its attention is done.
    if self._last_stream_out is not None:
      jax.block_until_ready(self._last_stream_out)
    hosts = self.plan.host_layers
    following = hosts[(hosts.index(layer) + 1) % len(hosts)]
    if following not in self._staged:
      self._staged[following] = self._stage(following)
    tail_k, tail_v = self._tails[layer]
    out, tail_k, tail_v = _stream_attend(
        query, *staged, tail_k, tail_v, self._prefix_lengths,
        self._lengths - self._prefix_lengths, k_new, v_new, scale=scale,
        implementation=implementation)
    self._tails[layer] = (tail_k, tail_v)
    self._last_stream_out = out
    return out

  def advance(self, T: int) -> None:
    """Grows every length by T (the step's new positions), on the host and in ``device``."""
    self._lengths = self._lengths + T
    self.device = self.device.advance(T)

  def device_bytes(self) -> int:
    """Bytes of KV resident in device memory (device layers and stream tails)."""
    arrays = [*self.device.k, *self.device.v, *(x for pair in self._tails.values() for x in pair)]
    return int(sum(x.nbytes for x in arrays))

  def host_bytes(self) -> int:
    """Bytes of KV resident in host memory (pinned host or CPU device arrays)."""
    return int(sum(x.nbytes for x in (*self._host_k.values(), *self._host_v.values())))
