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

A paged cache (``plan_offload(..., page_size=...)``: every layer a pool of
pages addressed through one block table, ``fastattn_jax.PagedKVCache``) is
served on the device or in mode "host": a host-resident layer's pools live on
the host CPU device and the CPU kernel reads their pages in place through a
copy of the block table, taken once a step after the device-side allocator
has reserved the step's pages for every layer. Mode "stream" keeps a
never-written prefix apart from a contiguous device tail, which does not
split along pages that the allocator shares and reuses, so it serves
contiguous caches only.

This is the CPU-GPU cooperative strategy of FastAttention (Lin et al. 2024,
"FastAttention: Extend FlashAttention2 to NPUs and Low-resource GPUs for
Efficient Inference"): for long contexts, copying a layer's KV cache to the
GPU costs far more than that layer's attention (about 10x on an H100 by public
reports), so computing the attention of the offloaded layers on the CPU where
their cache lives can win over streaming. Which mode wins depends on the
machine, so ``plan_offload`` predicts both from measured rates
(``measure_rates``) and explains its choice (``OffloadPlan.explain``).

By concern:

* ``rates``: ``Rates`` and ``measure_rates``, the speeds of this machine;
* ``planner``: ``plan_offload`` (pure arithmetic), ``OffloadPlan``,
  ``longest_context``, ``available_host_bytes``;
* ``cache``: ``OffloadedKVCache``, the caches placed by a plan, with the
  functional contract of ``fastattn_jax.decode.KVCache``;
* ``schedule``: ``decode_step``, one decode step of any decoder given its
  per-layer functions (``Decoder``), over either cache.

Shapes: B batch, T new tokens per step, N query heads, K key/value heads, H
head dim; per layer the cache is (B, S_max, K, H) with S_max = context +
new_tokens (the prefix of ``context`` positions, then room for
``new_tokens`` decoded ones).
"""

from fastattn_jax._util import host_cpu_device
from fastattn_jax.offload.cache import OffloadedKVCache
from fastattn_jax.offload.planner import (GiB, MODES, OffloadError, OffloadPlan, Prediction,
                                          available_host_bytes, longest_context, plan_offload)
from fastattn_jax.offload.rates import Rates, has_pinned_host, measure_rates
from fastattn_jax.offload.schedule import Decoder, decode_step

__all__ = ["Decoder", "GiB", "MODES", "OffloadError", "OffloadPlan", "OffloadedKVCache",
           "Prediction", "Rates", "available_host_bytes", "decode_step", "has_pinned_host",
           "host_cpu_device", "longest_context", "measure_rates", "plan_offload"]
