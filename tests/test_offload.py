"""fastattn_jax.offload: the planner's placement arithmetic, its choice, explanation and
errors (against sums done here by hand), and the offloaded KV cache in both modes
against a float64 attention over the same keys and values written from the definition."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa_testutil as tu
from fastattn_jax import KVCache, offload
from fastattn_jax._util import format_bytes, host_cpu_device
from fastattn_jax.offload import OffloadedKVCache, OffloadError, Rates, plan_offload

# A small model: L layers of (B, S_max, K, H) float16 caches.
L, B, CONTEXT, NEW, K, H = 8, 2, 1000, 24, 2, 16
ITEM = 2
FULL = 2 * B * (CONTEXT + NEW) * K * H * ITEM  # one layer, S_max positions
PREFIX = 2 * B * CONTEXT * K * H * ITEM
TAIL = 2 * B * NEW * K * H * ITEM
BIG = 1 << 40

#: Mode "host" computes on the host CPU device, which JAX lacks under JAX_PLATFORMS=cuda.
needs_cpu = pytest.mark.skipif(host_cpu_device() is None,
                               reason="JAX has no CPU device (JAX_PLATFORMS without cpu)")

#: Copies are fast, the host CPU slow: streaming should win.
STREAM_WINS = Rates(h2d_bytes_per_s=50e9, device_bytes_per_s=3e12, device_fixed_s=2e-5,
                    host_bytes_per_s=1e9, host_fixed_s=3e-4, device="test")
#: Copies are slow, the host CPU fast: computing on the host should win.
HOST_WINS = Rates(h2d_bytes_per_s=1e9, device_bytes_per_s=3e12, device_fixed_s=2e-5,
                  host_bytes_per_s=100e9, host_fixed_s=3e-4, device="test")


def plan(dtype="float16", **kw):
  args = dict(device_budget_bytes=BIG, host_budget_bytes=BIG)
  args.update(kw)
  return plan_offload(L, B, CONTEXT, NEW, K, H, dtype, **args)


def test_everything_fits_on_the_device():
  p = plan(device_budget_bytes=L * FULL, rates=STREAM_WINS)
  assert p.mode == "none" and p.device_layers == tuple(range(L)) and p.host_layers == ()
  assert p.device_kv_bytes == L * FULL and p.host_kv_bytes == 0 and p.device_bytes == L * FULL
  assert p.longest_device_context == CONTEXT  # exactly at the budget
  assert "chosen: none" in p.explain()
  # One byte less and the cache must be offloaded.
  assert plan(device_budget_bytes=L * FULL - 1, rates=STREAM_WINS).mode != "none"


@pytest.mark.parametrize("budget_layers", [0.0, 2.5, 5.5, 7.99])
def test_host_mode_places_the_fewest_layers_on_the_host(budget_layers):
  budget = int(budget_layers * FULL)
  p = plan(device_budget_bytes=budget, mode="host")
  n_gpu = math.floor(budget_layers)
  assert p.mode == "host"
  assert p.device_layers == tuple(range(n_gpu)) and p.host_layers == tuple(range(n_gpu, L))
  assert p.device_kv_bytes == n_gpu * FULL and p.host_kv_bytes == (L - n_gpu) * FULL
  assert p.staging_bytes == p.tail_bytes == 0


@pytest.mark.parametrize("budget_layers", [2.5, 5.5, 7.99])
def test_stream_mode_budgets_two_prefixes_in_flight_and_the_tails(budget_layers):
  budget = int(budget_layers * FULL)
  p = plan(device_budget_bytes=budget, mode="stream")
  # n host layers fit when (L - n) FULL + 2 PREFIX + n TAIL <= budget.
  n = math.ceil((L * FULL + 2 * PREFIX - budget) / (FULL - TAIL))
  assert p.mode == "stream" and len(p.host_layers) == n and p.host_layers[-1] == L - 1
  assert p.staging_bytes == 2 * PREFIX and p.tail_bytes == n * TAIL
  assert p.host_kv_bytes == n * PREFIX
  assert p.device_bytes == (L - n) * FULL + 2 * PREFIX + n * TAIL <= budget
  assert (L - n + 1) * FULL + 2 * PREFIX + (n - 1) * TAIL > budget  # n is the fewest


def test_host_budget_limits_the_plan():
  # The device holds 3 layers, so 5 must go to the host; host memory for 4 only.
  with pytest.raises(OffloadError) as err:
    plan(device_budget_bytes=3 * FULL, host_budget_bytes=4 * FULL, mode="host")
  assert "host" in str(err.value)
  assert plan(device_budget_bytes=3 * FULL, host_budget_bytes=5 * FULL, mode="host").host_layers \
      == (3, 4, 5, 6, 7)


def _expected_seconds(rates, n_stream, n_host, weights):
  t_dev = rates.device_fixed_s + (PREFIX + weights) / rates.device_bytes_per_s
  stream = max(L * t_dev, n_stream * PREFIX / rates.h2d_bytes_per_s)
  t_cpu = weights / rates.device_bytes_per_s + rates.host_fixed_s + PREFIX / \
      rates.host_bytes_per_s
  return stream, (L - n_host) * t_dev + n_host * t_cpu


@pytest.mark.parametrize("rates,winner", [(STREAM_WINS, "stream"), (HOST_WINS, "host")])
def test_auto_picks_the_faster_mode_and_explains_why(rates, winner):
  weights = 1 << 20
  p = plan(device_budget_bytes=int(4.5 * FULL), rates=rates, weight_bytes_per_layer=weights)
  n_stream = math.ceil((L * FULL + 2 * PREFIX - int(4.5 * FULL)) / (FULL - TAIL))
  stream_s, host_s = _expected_seconds(rates, n_stream, 4, weights)
  assert p.prediction("stream").seconds == pytest.approx(stream_s, rel=1e-9)
  assert p.prediction("host").seconds == pytest.approx(host_s, rel=1e-9)
  assert p.prediction("none").seconds is None
  assert p.mode == winner == ("stream" if stream_s < host_s else "host")
  text = p.explain()
  loser = "host" if winner == "stream" else "stream"
  assert f"chosen: {winner}" in text and f"faster than {loser!r}" in text
  for seconds in (stream_s, host_s):
    assert f"{seconds * 1e3:.2f} ms" in text
  assert f"host layers: {p.host_layers[0]}-{L - 1}" in text
  assert format_bytes(p.host_kv_bytes) in text


def test_auto_needs_rates_only_when_offloading():
  assert plan(device_budget_bytes=L * FULL).mode == "none"
  with pytest.raises(ValueError, match="rates"):
    plan(device_budget_bytes=L * FULL // 2)


def test_unavailable_mode_is_skipped_by_auto_and_refused_when_forced():
  no_cpu = Rates(50e9, 3e12, 2e-5, None, None)
  assert plan(device_budget_bytes=4 * FULL, rates=no_cpu).mode == "stream"
  with pytest.raises(ValueError, match="no CPU device"):
    plan(device_budget_bytes=4 * FULL, rates=no_cpu, mode="host")


def test_forced_host_layers():
  p = plan(mode="stream", host_layers=3)
  assert p.mode == "stream" and p.host_layers == (5, 6, 7) and p.device_layers == tuple(range(5))
  p = plan(mode="host", host_layers=0)
  assert p.mode == "none" and "nothing is offloaded" in p.reason


def test_error_when_nothing_fits_says_what_would():
  device, host = int(1.5 * FULL), 2 * FULL
  with pytest.raises(OffloadError) as err:
    plan(device_budget_bytes=device, host_budget_bytes=host, rates=STREAM_WINS)
  message = str(err.value)
  # Host mode keeps one layer on the device, so 7 need host memory.
  assert format_bytes(7 * FULL) + " of host memory (mode 'host')" in message
  # Two layers fit in host memory, so the device must hold the other six.
  assert "a device budget of " + format_bytes(6 * FULL) + " (mode 'host')" in message
  longest = int(message.split("a context of at most ")[1].split()[0])
  assert 0 < longest < CONTEXT
  fits = lambda context: plan_offload(L, B, context, NEW, K, H, "float16",
                                      device_budget_bytes=device, host_budget_bytes=host,
                                      rates=STREAM_WINS)
  assert fits(longest).mode in ("stream", "host")
  with pytest.raises(OffloadError):
    fits(longest + 1)


def test_mode_none_that_does_not_fit_points_to_offload():
  with pytest.raises(OffloadError, match="offloading to host memory") as err:
    plan(device_budget_bytes=L * FULL - 1, mode="none")
  longest = int(str(err.value).split("a context of at most ")[1].split()[0])
  # The largest context with L * 2 * B * (context + NEW) * K * H * ITEM <= budget.
  assert longest == (L * FULL - 1) // (L * 2 * B * K * H * ITEM) - NEW


def test_longest_context_is_bounded_by_the_budgets_alone():
  per_position = L * 2 * B * K * H * ITEM
  assert offload.longest_context(L, B, NEW, K, H, "float16", device_budget_bytes=BIG) == \
      BIG // per_position - NEW
  # In mode "host" the layers split evenly between two equal budgets.
  both = offload.longest_context(L, B, NEW, K, H, "float16", device_budget_bytes=BIG,
                                 host_budget_bytes=BIG, modes=("host",))
  assert both == 2 * BIG // per_position - NEW
  with pytest.raises(ValueError, match="longest_context: num_layers must be positive"):
    offload.longest_context(0, B, NEW, K, H, "float16", device_budget_bytes=BIG)


@pytest.mark.parametrize("kw,match", [
    (dict(mode="fast"), "mode must be one of"),
    (dict(mode="auto", host_layers=2), "host_layers=2 needs mode"),
    (dict(mode="host", host_layers=L + 1), r"host_layers must be in \[0, 8\]"),
    (dict(device_budget_bytes=-1), "device_budget_bytes must be >= 0"),
    (dict(dtype="int8"), "dtype int8 is a quantized cache"),
    (dict(dtype="float8_e4m3fn"), "dtype float8_e4m3fn is a quantized cache"),
])
def test_bad_arguments(kw, match):
  with pytest.raises(ValueError, match=match):
    plan(**kw)
  with pytest.raises(ValueError, match="context must be positive, got 0"):
    plan_offload(L, B, 0, NEW, K, H, "float16", device_budget_bytes=BIG, host_budget_bytes=BIG)


# --- the cache ----------------------------------------------------------------------

def reference_attention(q, keys, values, lengths):
  """float64 softmax attention of the T queries at the end of each sequence (causal)."""
  q, keys, values = (np.asarray(x, np.float64) for x in (q, keys, values))
  Bq, T, N, Hq = q.shape
  G = N // keys.shape[2]
  out = np.zeros_like(q)
  for b in range(Bq):
    for t in range(T):
      pos = lengths[b] - T + t
      for n in range(N):
        logits = keys[b, :pos + 1, n // G] @ q[b, t, n] / np.sqrt(Hq)
        w = np.exp(logits - logits.max())
        out[b, t, n] = (w / w.sum()) @ values[b, :pos + 1, n // G]
  return out


def _layer_arrays(rng, n_layers, batch, length, kv_heads, head_dim):
  return [rng.standard_normal((2, batch, length, kv_heads, head_dim)).astype(np.float32)
          for _ in range(n_layers)]


def _run_cache_against_reference(rng, mode, T, device, host_device=None, atol=2e-5):
  layers, batch, context, new, kv_heads, q_heads, head_dim = 3, 2, 37, 7, 2, 4, 16
  p = plan_offload(layers, batch, context, new, kv_heads, head_dim, "float32",
                   device_budget_bytes=BIG, host_budget_bytes=BIG, mode=mode, host_layers=2)
  assert p.host_layers == (1, 2)
  prefix = _layer_arrays(rng, layers, batch, context, kv_heads, head_dim)
  sharding = jax.sharding.SingleDeviceSharding(device)

  def fill(layer, length):
    padded = np.zeros((2, batch, length, kv_heads, head_dim), np.float32)
    padded[:, :, :context] = prefix[layer]
    return jax.device_put(padded[0], sharding), jax.device_put(padded[1], sharding)

  cache = OffloadedKVCache.build(p, fill, device=device, host_device=host_device)
  kinds = {layer: {x.sharding.memory_kind for x in (cache.host_k[layer], cache.host_v[layer])}
           for layer in p.host_layers}
  if mode == "stream":
    assert all(kind == {"pinned_host"} for kind in kinds.values())
  else:
    assert all({x.devices().pop().platform for x in (cache.host_k[layer], cache.host_v[layer])}
               == {"cpu"} for layer in p.host_layers)
  assert cache.host_bytes() == p.host_kv_bytes
  history = [[] for _ in range(layers)]
  for _ in range(new // T):
    lengths = cache.lengths + T
    for layer in range(layers):
      q = rng.standard_normal((batch, T, q_heads, head_dim)).astype(np.float32)
      kv = rng.standard_normal((2, batch, T, kv_heads, head_dim)).astype(np.float32)
      history[layer].append(kv)
      out, cache = cache.attend(layer, *(jax.device_put(x, sharding) for x in (q, kv[0], kv[1])))
      assert out.shape == q.shape and out.devices() == {device}
      keys = np.concatenate([prefix[layer]] + history[layer], axis=2)
      expected = reference_attention(q, keys[0], keys[1], lengths)
      np.testing.assert_allclose(np.asarray(out), expected, atol=atol, rtol=atol)
    cache = cache.advance(T)
  np.testing.assert_array_equal(cache.lengths, context + (new // T) * T)
  with pytest.raises(ValueError, match="KV cache overflow"):
    cache.attend(0, *(jnp.zeros((batch, new, n, head_dim)) for n in (q_heads, kv_heads, kv_heads)))


@pytest.mark.parametrize("mode", ["stream", pytest.param("host", marks=needs_cpu)])
@pytest.mark.parametrize("T", [1, 3])
def test_offloaded_cache_matches_float64_attention(rng, mode, T):
  _run_cache_against_reference(rng, mode, T, jax.devices()[0])


@pytest.mark.skipif(not tu.has_gpu(), reason="needs a GPU: streams from pinned host memory over "
                    "PCIe and runs host layers on jax.devices('cpu')")
@pytest.mark.parametrize("mode", ["stream", pytest.param("host", marks=needs_cpu)])
def test_offloaded_cache_on_gpu(rng, mode):
  # float32 products on a GPU may round through TF32 (10-bit mantissa).
  _run_cache_against_reference(rng, mode, 1, jax.devices("gpu")[0], host_cpu_device(),
                               atol=3e-3)


def test_measure_rates_gives_positive_finite_rates():
  r = offload.measure_rates(1, 4, 2, 16, jnp.float32, contexts=(256, 1024),
                            transfer_bytes=1 << 20, repeats=2)
  if host_cpu_device() is None:
    assert r.host_bytes_per_s is None and "no CPU device" in r.describe()
  else:
    assert np.isfinite(r.host_bytes_per_s) and r.host_bytes_per_s > 0 and r.host_fixed_s >= 0
  for value in (r.h2d_bytes_per_s, r.device_bytes_per_s):
    assert np.isfinite(value) and value > 0
  assert r.device_fixed_s >= 0
  assert "GB/s" in r.describe()
  with pytest.raises(ValueError, match="contexts must be two increasing"):
    offload.measure_rates(contexts=(1024, 256))


# --- paged caches -------------------------------------------------------------------

def test_paged_plan_counts_whole_pages_and_has_no_stream_mode():
  """A paged plan's layer is every sequence's S_max rounded up to pages;
  streaming is refused when forced and skipped by "auto"."""
  ps = 64
  room = -(-(CONTEXT + NEW) // ps) * ps  # 1024 positions of 1024
  p = plan(mode="host", host_layers=3, page_size=ps)
  assert p.page_size == ps and p.num_pages == B * room // ps
  assert p.host_kv_bytes == 3 * 2 * B * room * K * H * ITEM
  assert f"in {p.num_pages} pages of {ps} positions" in p.explain()
  p = plan(device_budget_bytes=4 * FULL, rates=STREAM_WINS, page_size=ps)
  assert p.mode == "host" and p.prediction("stream").host_layers is None
  with pytest.raises(ValueError, match="mode 'stream' is unavailable: a paged cache"):
    plan(mode="stream", page_size=ps)
  with pytest.raises(ValueError, match="plan_offload: page_size must be a power of two"):
    plan(mode="host", page_size=24)
  with pytest.raises(ValueError, match="a plan of contiguous caches has no pages"):
    plan(mode="host").num_pages


@needs_cpu
@pytest.mark.parametrize("T", [1, 3])
def test_offloaded_paged_cache_matches_float64_attention(rng, T):
  """Mode "host" over pages: the host layers' pools and a copy of the block
  table on the CPU device, one allocator for every layer. Sequence 1 is
  released halfway and starts again in pages freed and taken out of order,
  so the lengths are ragged and the pages of a sequence shuffled."""
  layers, batch, context, new, kv_heads, q_heads, head_dim, ps = 3, 3, 37, 24, 2, 4, 16, 16
  p = plan_offload(layers, batch, context, new, kv_heads, head_dim, "float32",
                   device_budget_bytes=BIG, host_budget_bytes=BIG, mode="host", host_layers=2,
                   page_size=ps)
  device = jax.devices()[0]
  prefix = _layer_arrays(rng, layers, batch, context, kv_heads, head_dim)
  asked = []

  def fill(layer, length):
    asked.append(length)
    return tuple(jax.device_put(x, device) for x in prefix[layer])

  cache = OffloadedKVCache.build(p, fill, device=device)
  assert asked == [context] * layers
  for layer in p.host_layers:
    for x in (cache.host_k[layer], cache.host_v[layer]):
      assert x.devices() == {host_cpu_device()} and x.shape == (p.num_pages, ps, kv_heads,
                                                                 head_dim)
  assert cache.host_table.devices() == {host_cpu_device()}
  assert cache.host_bytes() == p.host_kv_bytes
  history = [[prefix[layer][:, b] for b in range(batch)] for layer in range(layers)]
  steps = new // T
  for step in range(steps):
    if step == steps // 2:
      before = np.asarray(cache.device.block_table)[1]
      freed = set(before[before >= 0].tolist())
      cache = cache.release(np.array([False, True, False]))
      with pytest.raises(ValueError, match=r"no pages yet; call reserve"):  # sequence 1 has none
        cache.attend(0, *(jnp.zeros((batch, T, n, head_dim)) for n in (q_heads, kv_heads,
                                                                        kv_heads)))
      for layer in range(layers):
        history[layer][1] = history[layer][1][:, :0]  # sequence 1 starts empty
    cache = cache.reserve(T)
    lengths = cache.lengths + T
    for layer in range(layers):
      q = rng.standard_normal((batch, T, q_heads, head_dim)).astype(np.float32)
      kv = rng.standard_normal((2, batch, T, kv_heads, head_dim)).astype(np.float32)
      out, cache = cache.attend(layer, *(jax.device_put(x, device) for x in (q, kv[0], kv[1])))
      assert out.devices() == {device}
      for b in range(batch):
        history[layer][b] = np.concatenate([history[layer][b], kv[:, b]], axis=1)
        keys = history[layer][b]
        expected = reference_attention(q[b:b + 1], keys[None, 0], keys[None, 1], lengths[b:b + 1])
        np.testing.assert_allclose(np.asarray(out[b:b + 1]), expected, atol=2e-5, rtol=2e-5)
    cache = cache.advance(T)
  restart = steps - steps // 2
  np.testing.assert_array_equal(cache.lengths, [context + steps * T, restart * T,
                                                context + steps * T])
  table = np.asarray(cache.device.block_table)
  np.testing.assert_array_equal(np.asarray(cache.host_table), table)
  held = table[table >= 0]
  assert len(set(held.tolist())) == len(held), "a page given to two sequences"
  np.testing.assert_array_equal((table >= 0).sum(axis=1), -(-cache.lengths // ps))
  assert set(table[1][table[1] >= 0].tolist()) <= freed, "sequence 1 reused no freed page"
  with pytest.raises(ValueError, match="KV cache overflow"):
    cache.reserve(new)


def test_paged_layer_attend_names_mismatched_new_keys():
  from fastattn_jax import paged
  pool = jnp.zeros((4, 16, 2, 8), jnp.float32)
  table = jnp.zeros((1, 2), jnp.int32)
  with pytest.raises(ValueError, match=r"k_new and v_new must be \(B, T, K, H\) = \(1, 1, 2, 8\)"):
    paged.layer_attend(jnp.zeros((1, 1, 4, 8)), pool, pool, table, jnp.zeros((1,), jnp.int32),
                       jnp.zeros((1, 1, 3, 8)), jnp.zeros((1, 1, 3, 8)), scale=None,
                       implementation=None)


@pytest.mark.parametrize("kind", ["stacked", "int8"])
def test_whole_layer_decoder_refuses_caches_it_cannot_write(kind):
  """A decoder of whole layers (``Decoder.layer``, the tensor-parallel one)
  writes per-layer float arrays: a stacked or a quantized cache is an error
  before any layer runs, not a silent copy or a cast without scales."""
  cache = KVCache.create(2, 1, 32, 2, 16, jnp.int8 if kind == "int8" else jnp.float32,
                         stacked=kind == "stacked")
  never = lambda *args: pytest.fail("a layer ran")
  decoder = offload.Decoder(embed=never, attention_inputs=None, attention_output=None,
                            head=never, layer=never)
  with pytest.raises(ValueError, match="not a PagedKVCache, a quantized or a stacked cache"):
    offload.decode_step(decoder, [None, None], None, cache, np.zeros((1, 1), np.int32))
