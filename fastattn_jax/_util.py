"""Small helpers of the library's own modules (not public).

``affine_fit`` fits measured times, ``host_cpu_device`` and ``sharding_of``
name the host CPU device and place arrays, ``format_bytes`` prints sizes,
``sources_digest`` names a set of embedded kernel sources.
"""

from __future__ import annotations

import functools
import hashlib

import jax


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
  """Bytes in binary units with two decimals: "1.50 GiB", "3.00 MiB", "12 Bytes"."""
  if abs(nbytes) < 1024:
    return f"{int(nbytes)} Bytes"
  for unit in ("KiB", "MiB", "GiB", "TiB"):
    nbytes /= 1024
    if abs(nbytes) < 1024 or unit == "TiB":
      return f"{nbytes:.2f} {unit}"


def sources_digest(sources: dict[str, str]) -> str:
  """SHA-256 hex of kernel sources {file name: text}, whatever their order."""
  return hashlib.sha256(repr(sorted(sources.items())).encode()).hexdigest()
