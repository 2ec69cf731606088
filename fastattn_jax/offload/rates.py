"""The speeds the offload planner predicts from, measured on this machine.

``measure_rates`` times a host-to-device copy and one layer's decode step on
the device and on the host CPU (the operations of ``OffloadedKVCache``) and
fits the affine model of ``Rates``; ``plan_offload`` extrapolates it to long
contexts, after FastAttention's CPU-GPU cooperative strategy (Lin et al. 2024).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from fastattn_jax._util import affine_fit, host_cpu_device, sharding_of
from fastattn_jax.timing import median_seconds
from fastattn_jax.decode import layer_attend


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


def has_pinned_host(device) -> bool:
  """Whether the ``jax.Device`` ``device`` addresses a "pinned_host" memory (streaming needs
  one)."""
  return any(m.kind == "pinned_host" for m in device.addressable_memories())


def _layer_step_seconds(q, kv_new, S, where, device, implementation, roundtrip, repeats):
  """Median seconds of one layer's write + decode_attention over S cached positions on ``where``.

  With ``roundtrip``, q and the new keys/values are copied from ``device`` to
  ``where`` and the output back, as the host mode does.
  """
  B, _, K, H = kv_new.shape
  zeros = jax.jit(lambda: jnp.zeros((B, S, K, H), kv_new.dtype), out_shardings=sharding_of(where))
  state = {"k": zeros(), "v": zeros()}
  lengths = np.full((B,), S - 1, np.int32)

  def step():
    args = (q, kv_new) if not roundtrip else tuple(jax.device_put(x, where) for x in (q, kv_new))
    out, state["k"], state["v"] = layer_attend(
        args[0], state["k"], state["v"], lengths, args[1], args[1], scale=None,
        implementation=implementation)
    return jax.device_put(out, device) if roundtrip else out

  return median_seconds(step, repeats)


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

  Each is the median of ``repeats`` runs after a warm-up run
  (``timing.median_seconds``); the two contexts give the affine model
  ``fixed_s + bytes / bytes_per_s`` (bytes of KV read: 2 * B * S * K * H *
  itemsize), which the planner extrapolates to long contexts (linear in the
  KV bytes, as the kernels are memory-bound there). The operations are those
  of FastAttention's CPU-GPU cooperative strategy (Lin et al. 2024).

  Args:
    batch, query_heads, kv_heads, head_dim: B, N, K, H of the model (N a
      multiple of K).
    dtype: the KV cache dtype.
    device: the accelerator (default ``jax.devices()[0]``).
    host_device: the CPU device (default ``offload.host_cpu_device()``; None
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
  host_device = host_cpu_device() if host_device is None else host_device
  on_device = sharding_of(device)
  h2d = None
  if has_pinned_host(device):
    blob = jax.jit(lambda: jnp.ones((transfer_bytes,), jnp.uint8), out_shardings=on_device)()
    pinned = jax.block_until_ready(jax.device_put(blob, sharding_of(device, "pinned_host")))
    del blob
    h2d = transfer_bytes / median_seconds(
        lambda: jax.device_put(pinned, sharding_of(device, "device")), repeats)

  q = jax.device_put(jnp.ones((batch, 1, query_heads, head_dim), dtype), on_device)
  kv_new = jax.device_put(jnp.ones((batch, 1, kv_heads, head_dim), dtype), on_device)
  itemsize = jnp.dtype(dtype).itemsize
  sizes = [2 * batch * S * kv_heads * head_dim * itemsize for S in contexts]

  def layer_seconds(where, implementation, roundtrip):
    return affine_fit(sizes, [
        _layer_step_seconds(q, kv_new, S, where, device, implementation, roundtrip, repeats)
        for S in contexts])

  device_rate, device_fixed = layer_seconds(device, None, False)
  host_rate = host_fixed = None
  if host_device is not None:
    host_rate, host_fixed = layer_seconds(host_device, "cpu", True)
  return Rates(h2d, device_rate, device_fixed, host_rate, host_fixed,
               device=f"{device.device_kind} ({device.platform})")
