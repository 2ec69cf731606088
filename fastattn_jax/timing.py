"""Timing JAX calls: ``median_seconds``.

The library times itself to plan (``fastattn_jax.offload.measure_rates``,
``fastattn_jax.parallel.measure_rates``); the benchmarks and examples time
with the same function, so a plan and a benchmark measure alike.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

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
