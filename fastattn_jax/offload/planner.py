"""Where each layer's KV cache lives and how host-resident layers are served: the planner.

``plan_offload`` is pure arithmetic over the cache's bytes and measured
``Rates`` (no device is touched), after the CPU-GPU cooperative strategy of
FastAttention (Lin et al. 2024); see ``fastattn_jax.offload`` for the modes.
Sizes are bytes, times seconds.
"""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp

from fastattn_jax._util import format_bytes
from fastattn_jax.decode import is_quantized
from fastattn_jax.offload.rates import Rates
from fastattn_jax.paged import check_page_size

MODES = ("none", "stream", "host")
#: Bytes in a GiB (2**30), the unit of memory budgets on command lines.
GiB = float(1 << 30)


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
    page_size: None for contiguous caches (B, S_max, K, H); else each
      layer's cache is a pool of ``num_pages`` pages of page_size positions
      (``PagedKVCache``), served on the device or in mode "host".
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
  page_size: int | None

  @property
  def num_pages(self) -> int:
    """Pages of each layer's pool: every sequence's room for S_max positions.

    Raises:
      ValueError: a plan of contiguous caches (``page_size`` None).
    """
    if self.page_size is None:
      raise ValueError("OffloadPlan.num_pages: a plan of contiguous caches has no pages")
    return self.batch * -(-self.max_len // self.page_size)

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
    layer = _layer_bytes(self.batch, _room(self.max_len, self.page_size), self.kv_heads,
                         self.head_dim, self.dtype)
    pages = ("" if self.page_size is None else
             f" in {self.num_pages} pages of {self.page_size} positions")
    lines = [
        f"KV cache plan: mode {self.mode!r}, L_GPU = {len(self.device_layers)} device layers, "
        f"L_CPU = {len(self.host_layers)} host layers",
        f"  KV cache: {self.num_layers} layers x (B={self.batch}, S_max={self.max_len}, "
        f"K={self.kv_heads}, H={self.head_dim}) {self.dtype}{pages} = {format_bytes(layer)} per "
        f"layer, "
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


def _room(max_len, page_size) -> int:
  """Positions a sequence's cache takes for ``max_len``: whole pages of a paged cache."""
  return max_len if page_size is None else -(-max_len // page_size) * page_size


def _memory(mode, n_host, L, full, prefix, tail):
  """(device bytes, host bytes) of ``mode`` with ``n_host`` host layers."""
  device = (L - n_host) * full
  if mode == "stream" and n_host:
    return device + 2 * prefix + n_host * tail, n_host * prefix
  return device, n_host * full


def _check_positive(caller, **sizes):
  for name, value in sizes.items():
    if int(value) <= 0:
      raise ValueError(f"{caller}: {name} must be positive, got {value}")


def _fits(mode, n_host, L, full, prefix, tail, device_budget, host_budget):
  device, host = _memory(mode, n_host, L, full, prefix, tail)
  return device <= device_budget and host <= host_budget


def longest_context(num_layers: int, batch: int, new_tokens: int, kv_heads: int, head_dim: int,
                    dtype, *, device_budget_bytes: int, host_budget_bytes: int = 0,
                    modes=("none",), page_size: int | None = None) -> int:
  """The longest context (prefix tokens) whose KV cache fits the budgets in one of ``modes``.

  Pure arithmetic (bytes as in ``plan_offload``), by bisection over the
  context, which memory grows with monotonically, below the context whose
  prefixes alone (every mode keeps each layer's prefix in one of the two
  memories) take more than both budgets together.

  Args:
    num_layers, batch, new_tokens, kv_heads, head_dim, dtype: L, B, the
      decoded positions, K, H and the cache dtype.
    device_budget_bytes, host_budget_bytes: bytes.
    modes: any of "none", "stream", "host"; an offload mode may put any
      number of layers on the host.
    page_size: as in ``plan_offload`` (each sequence's cache in whole
      pages; "stream" is not counted for a paged cache).

  Returns:
    The context in tokens (0 when not even an empty prefix fits).

  Raises:
    ValueError: non-positive sizes, a page size that is not a power of two
      >= 16.
  """
  _check_positive("longest_context", num_layers=num_layers, batch=batch, new_tokens=new_tokens,
                  kv_heads=kv_heads, head_dim=head_dim)
  if page_size is not None:
    check_page_size("longest_context", page_size)
    modes = tuple(m for m in modes if m != "stream")

  def fits(context):
    full = _layer_bytes(batch, _room(context + new_tokens, page_size), kv_heads, head_dim, dtype)
    prefix = _layer_bytes(batch, context, kv_heads, head_dim, dtype)
    tail = _layer_bytes(batch, new_tokens, kv_heads, head_dim, dtype)
    return any(_fits(mode, n, num_layers, full, prefix, tail, device_budget_bytes,
                     host_budget_bytes)
               for mode in modes
               for n in ((0,) if mode == "none" else range(num_layers + 1)))

  per_position = num_layers * _layer_bytes(batch, 1, kv_heads, head_dim, dtype)
  lo, hi = 0, int((device_budget_bytes + host_budget_bytes) // per_position)
  if not fits(0):
    return 0
  while lo < hi:
    mid = (lo + hi + 1) // 2
    lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
  return lo


def plan_offload(num_layers: int, batch: int, context: int, new_tokens: int, kv_heads: int,
                 head_dim: int, dtype, *, device_budget_bytes: int, host_budget_bytes: int,
                 rates: Rates | None = None, mode: str = "auto", host_layers: int | None = None,
                 weight_bytes_per_layer: int = 0, page_size: int | None = None) -> OffloadPlan:
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

  A paged cache (``page_size``: ``PagedKVCache`` pools, each sequence's
  S_max rounded up to whole pages) is served on the device or in mode
  "host", whose CPU kernel reads the pages in place through a copy of the
  block table; "stream" keeps a never-written prefix apart from a
  contiguous device tail, which pages shared and reused by the allocator
  do not split into, so it is unavailable.

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
    page_size: None for contiguous caches; else the positions per page of
      a paged cache (a power of two >= 16).

  Returns:
    An ``OffloadPlan``.

  Raises:
    ValueError: non-positive sizes, negative budgets, an unknown mode,
      ``host_layers`` out of [0, L] or with mode "auto"/"none", "auto"
      needing offload without ``rates``, a page size that is not a power of
      two >= 16, mode "stream" with ``page_size``, or an int8 or
      float8_e4m3fn ``dtype`` (a quantized cache is not offloaded).
    OffloadError: (a ValueError) nothing fits the budgets in the requested
      mode; the message gives the device budget or host memory that would
      fit, and the longest context that fits.
  """
  _check_positive("plan_offload", num_layers=num_layers, batch=batch, context=context,
                  new_tokens=new_tokens, kv_heads=kv_heads, head_dim=head_dim)
  for name, value in (("device_budget_bytes", device_budget_bytes),
                      ("host_budget_bytes", host_budget_bytes),
                      ("weight_bytes_per_layer", weight_bytes_per_layer)):
    if value < 0:
      raise ValueError(f"plan_offload: {name} must be >= 0, got {value}")
  if mode not in ("auto", *MODES):
    raise ValueError(f"plan_offload: mode must be one of {('auto', *MODES)}, got {mode!r}")
  if page_size is not None:
    check_page_size("plan_offload", page_size)
  if host_layers is not None:
    if mode not in ("stream", "host"):
      raise ValueError(f"plan_offload: host_layers={host_layers} needs mode 'stream' or "
                       f"'host', got mode={mode!r}")
    if not 0 <= host_layers <= num_layers:
      raise ValueError(f"plan_offload: host_layers must be in [0, {num_layers}], got "
                       f"{host_layers}")
  if is_quantized(dtype):
    raise ValueError(f"plan_offload: dtype {jnp.dtype(dtype).name} is a quantized cache, whose "
                     f"scales the offloaded cache does not keep; offload a float cache (or "
                     f"keep a quantized one on the device: KVCache or PagedKVCache)")
  dtype = jnp.dtype(dtype).name
  L = num_layers
  max_len = context + new_tokens
  full = _layer_bytes(batch, _room(max_len, page_size), kv_heads, head_dim, dtype)
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
    if m == "stream" and page_size is not None:
      return "a paged cache is served on the device or in mode 'host'"
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
        raise OffloadError(_no_fit_message(
            L, batch, context, new_tokens, kv_heads, head_dim, dtype, (full, prefix, tail),
            budgets, ("stream", "host") if page_size is None else ("host",), by_mode, page_size))
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
                                         dtype, (full, prefix, tail), budgets, (mode,), by_mode,
                                         page_size))
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
                                             device_budget_bytes=device_budget_bytes,
                                             page_size=page_size),
      page_size=page_size)


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
                    modes, by_mode, page_size):
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
                            modes=modes, page_size=page_size)
  fixes.append(f"a context of at most {longest} tokens (with {new_tokens} new)"
               if longest else "no context at all with these budgets")
  offload_modes = "'auto', 'stream' or 'host'" if page_size is None else "'auto' or 'host'"
  hint = (f"; offloading to host memory (mode {offload_modes}) may fit"
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

