"""Small helpers that the library and its examples and benchmarks share.

``median_seconds`` times JAX calls and ``affine_fit`` fits them, ``host_cpu_device`` and ``sharding_of``
name the host CPU device and place arrays, ``format_bytes`` prints sizes,
``sources_digest`` names a set of embedded kernel sources.
"""

from __future__ import annotations

import functools
import hashlib
import statistics
import time
from typing import Callable

import humanize
import jax


def median_seconds(fn: Callable[[], object], repeats: int, *, warmup: int = 1,
                   calls: int = 1, warmup_seconds: float = 0.0) -> float:
  """Median wall-clock seconds of one call of ``fn``, device work included.

  Runs ``fn`` ``warmup`` times (compiles, fills caches), then on for
  ``warmup_seconds`` more (a GPU left idle while a program compiles raises
  its clocks over tens of milliseconds of work: a benchmark's first short
  loops would time the slower clocks; the clock starts after the compiling
  call, which would otherwise use the time up), then
  takes ``repeats`` samples, each of ``calls`` calls in a row that waits
  (``jax.block_until_ready``) for the last one's result: with several calls
  the dispatch of one overlaps the device work of the one before, as in a
  program. Returns the median sample divided by ``calls``, in seconds.

  Raises:
    ValueError: ``repeats`` or ``calls`` below 1, or ``warmup`` below 0.
  """
  if repeats < 1 or calls < 1 or warmup < 0:
    raise ValueError(f"median_seconds: repeats={repeats} and calls={calls} must be >= 1, "
                     f"warmup={warmup} >= 0")
  for _ in range(warmup):
    jax.block_until_ready(fn())
  start = time.perf_counter()
  while time.perf_counter() - start < warmup_seconds:
    jax.block_until_ready(fn())
  samples = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(calls):
      out = fn()
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - start) / calls)
  return statistics.median(samples)


@functools.cache
def host_cpu_device():
  """``jax.devices("cpu")[0]``, or None when JAX has no CPU backend
  (``JAX_PLATFORMS`` without ``cpu``)."""
  try:
    return jax.devices("cpu")[0]
  except RuntimeError:
    return None


def sharding_of(device, memory_kind: str | None = None):
  """A ``jax.sharding.Sharding`` for ``device``: a ``jax.Device`` (in
  ``memory_kind``, e.g. "pinned_host"), a sharding (returned as it is) or
  None (None: the default placement)."""
  if device is None or isinstance(device, jax.sharding.Sharding):
    return device
  return jax.sharding.SingleDeviceSharding(device, memory_kind=memory_kind)


def affine_fit(sizes, seconds) -> tuple[float, float]:
  """``(rate, fixed)`` of the model ``t = fixed + size / rate`` through two
  points (sizes in any unit, seconds), kept non-negative: when timing noise
  swamps the size effect (t2 <= t1), all of t2 counts as the size term."""
  (s1, s2), (t1, t2) = sizes, seconds
  slope = (t2 - t1) / (s2 - s1)
  if slope <= 0:
    return s2 / t2, 0.0
  return 1.0 / slope, max(t1 - s1 * slope, 0.0)


def format_bytes(nbytes: float) -> str:
  """Bytes in binary units with two decimals: "1.50 GiB", "3.00 MiB"."""
  return humanize.naturalsize(nbytes, binary=True, format="%.2f")


def sources_digest(sources: dict[str, str]) -> str:
  """SHA-256 hex of kernel sources {file name: text}, whatever their order."""
  return hashlib.sha256(repr(sorted(sources.items())).encode()).hexdigest()
