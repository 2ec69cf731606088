"""A stacked ``KVCache`` (``stacked=True``: every layer in one (L, B, S_max,
K, H) array) under ``lax.scan`` over the layers, the layer index traced.

References: the tuple-layout ``KVCache`` driven by the same steps with
static layers (bit for bit: the stacked cache is read as pages of the
stacked array, ``decode.stacked_pages``, and a paged read runs the same
arithmetic on the same keys as a contiguous one, tests/test_paged.py); the
float64 definition over the cache's contents (test_decode's ``_check``);
the compiled step's memory (no copy of a layer where XLA:CPU keeps the
write in place); the errors and room checks of the tuple layout.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa_testutil as tu
from fastattn_jax import KVCache
from fastattn_jax._util import host_cpu_device
from fastattn_jax.decode import decode_attention, stacked_pages, write
from fastattn_jax.models import llama
from test_decode import _check

L, B, K, N, H = 3, 3, 2, 4, 64
KV_DTYPES = {"float": None, "int8": jnp.int8, "float8_e4m3fn": jnp.float8_e4m3fn}


def _scan_step(cache, q, k_new, v_new, **kwargs):
  """One decode step of every layer under ``lax.scan``: the per-layer
  inputs (L, B, T, ...) are the scan's xs, the cache its carry."""
  def layer(cache, xs):
    index, q, k_new, v_new = xs
    out, cache = cache.attend(index, q, k_new, v_new, **kwargs)
    return cache, out
  cache, outs = jax.lax.scan(layer, cache, (jnp.arange(L), q, k_new, v_new))
  return outs, cache.advance(q.shape[2])


def _loop_step(cache, q, k_new, v_new, **kwargs):
  """The same step over a tuple-layout cache, the layers a Python loop."""
  outs = []
  for index in range(L):
    out, cache = cache.attend(index, q[index], k_new[index], v_new[index], **kwargs)
    outs.append(out)
  return jnp.stack(outs), cache.advance(q.shape[2])


def _inputs(rng, T, dtype):
  make = lambda *shape: jnp.asarray(rng.standard_normal((L, B, T, *shape)), dtype)
  return make(N, H), make(K, H), make(K, H)


def _as_tuple(x):
  return tuple(x[i] for i in range(L))


def _assert_same_contents(stacked, layers):
  """The stacked cache holds what the tuple cache holds, layer by layer."""
  assert stacked.stacked and not layers.stacked
  np.testing.assert_array_equal(np.asarray(stacked.lengths), np.asarray(layers.lengths))
  for got, want in ((stacked.k, layers.k), (stacked.v, layers.v),
                    (stacked.k_scale, layers.k_scale), (stacked.v_scale, layers.v_scale)):
    assert isinstance(want, tuple) and len(want) == (L if want else 0)
    for i, x in enumerate(want):
      np.testing.assert_array_equal(np.asarray(got[i], np.float32), np.asarray(x, np.float32))


def _caches(rng, dtype, kv, prompt, P, max_len):
  """A prefill of ragged lengths as a stacked and a tuple cache; a float8
  cache with random per-layer, per-head scales (a calibration's), so that a
  step that used another layer's scales would be seen."""
  k = jnp.asarray(rng.standard_normal((L, B, P, K, H)), dtype)
  v = jnp.asarray(rng.standard_normal((L, B, P, K, H)), dtype)
  stacked = KVCache.from_prefill(k, v, prompt, max_len, dtype=KV_DTYPES[kv], stacked=True)
  layers = KVCache.from_prefill(k, v, prompt, max_len, dtype=KV_DTYPES[kv])
  if kv == "float8_e4m3fn":
    scales = [jnp.asarray(rng.uniform(0.01, 0.05, (L, 1, 1, K)), jnp.float32) for _ in "kv"]
    stacked = dataclasses.replace(stacked, k_scale=scales[0], v_scale=scales[1])
    layers = dataclasses.replace(layers, k_scale=_as_tuple(scales[0]),
                                 v_scale=_as_tuple(scales[1]))
  return stacked, layers


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("kv", list(KV_DTYPES))
def test_scan_over_layers_matches_tuple_cache(dtype, kv):
  """Prefill of ragged lengths (one empty), then steps of T = 1 and 3 (GQA,
  N = 2K): the scan over the stacked cache gives the tuple cache's outputs
  bit for bit and leaves the same contents, scales and lengths."""
  rng = np.random.default_rng(tu.seed_of(f"stacked{dtype}{kv}"))
  stacked, layers = _caches(rng, tu.DTYPES[dtype], kv, [40, 17, 0], 40, 64)
  assert stacked.k.shape == (L, B, 64, K, H) and stacked.max_len == layers.max_len == 64
  _assert_same_contents(stacked, layers)
  scan = jax.jit(lambda *a: _scan_step(*a, implementation=tu.IMPL), donate_argnums=0)
  loop = jax.jit(lambda *a: _loop_step(*a, implementation=tu.IMPL), donate_argnums=0)
  for T in (1, 3, 3, 1):
    q, k_new, v_new = _inputs(rng, T, tu.DTYPES[dtype])
    got, stacked = scan(stacked, q, k_new, v_new)
    want, layers = loop(layers, q, k_new, v_new)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    _assert_same_contents(stacked, layers)
  np.testing.assert_array_equal(np.asarray(stacked.lengths), [48, 25, 8])


def test_stacked_step_matches_the_definition():
  """The last layer's step against the float64 definition over that layer's
  contents (the suite's acceptance rule), through ``stacked_pages``."""
  rng = np.random.default_rng(tu.seed_of("stacked-definition"))
  stacked, _ = _caches(rng, jnp.bfloat16, "float", [40, 17, 3], 40, 48)
  q, k_new, v_new = _inputs(rng, 3, jnp.bfloat16)
  outs, cache = jax.jit(lambda *a: _scan_step(*a, implementation=tu.IMPL))(
      stacked, q, k_new, v_new)
  k_pages, v_pages, paged = stacked_pages(cache.k, cache.v, L - 1)
  got = decode_attention(q[-1], k_pages, v_pages, cache.lengths, **paged, return_residual=True,
                         implementation=tu.IMPL)
  np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(outs[-1], np.float32))
  _check(q[-1], cache.k[-1], cache.v[-1], cache.lengths, "bfloat16", got=got)


@pytest.mark.parametrize("max_len,page", [(48, 16), (64, 64), (100, 16), (768, 256),
                                          (1024, 256)])
def test_stacked_pages_address_each_layer_and_sequence(max_len, page):
  """The block table of layer l names, for sequence b, the pages that hold
  exactly ``k[l, b]`` (gathered, they are that row); S rounded up to a
  multiple of 16, the page the largest power of two <= 256 dividing it."""
  cache = KVCache.create(L, B, max_len, K, 4, jnp.float32, stacked=True)
  S = cache.max_len
  assert S == -(-max_len // 16) * 16
  k = jnp.arange(L * B * S * K * 4, dtype=jnp.float32).reshape(L, B, S, K, 4)
  for layer in range(L):
    k_pages, _, paged = jax.jit(stacked_pages)(k, k, layer)
    assert k_pages.shape == (L * B * S // page, page, K, 4)
    table = np.asarray(paged["block_table"])
    assert table.shape == (B, S // page)
    gathered = np.asarray(k_pages)[table].reshape(B, S, K, 4)
    np.testing.assert_array_equal(gathered, np.asarray(k[layer]))


@pytest.mark.skipif(host_cpu_device() is None, reason="JAX has no CPU device (JAX_PLATFORMS)")
@pytest.mark.parametrize("kv", ["float32", "float16", "int8"])
def test_scan_step_copies_no_layer(kv):
  """The compiled scan step (cache donated) needs temporary memory far
  below one layer's keys and values: the write lands in the stacked arrays
  in place and the CPU kernel's decode path reads the layer as pages of
  them. (XLA:CPU copies a bfloat16 or float8 stacked cache around its
  write, ``decode.write``; those dtypes are not claimed here.)"""
  on_cpu = jax.sharding.SingleDeviceSharding(host_cpu_device())
  S, T = 1024, 1
  dtype = {"float32": jnp.float32, "float16": jnp.float16, "int8": jnp.int8}[kv]
  cache = jax.eval_shape(lambda: KVCache.create(L, B, S, K, H, dtype, stacked=True))
  cache = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_cpu), cache)
  queries = jnp.float16 if kv == "float16" else jnp.float32
  args = [jax.ShapeDtypeStruct((L, B, T, *shape), queries, sharding=on_cpu)
          for shape in ((N, H), (K, H), (K, H))]
  step = jax.jit(lambda *a: _scan_step(*a, implementation="cpu"), donate_argnums=0)
  compiled = step.lower(cache, *args).compile()
  layer_bytes = 2 * B * S * K * H * np.dtype(dtype).itemsize
  temp = compiled.memory_analysis().temp_size_in_bytes
  assert temp < layer_bytes / 8, f"{temp} temporary bytes, one layer's K and V {layer_bytes}"


def test_traced_layer_needs_the_stacked_layout():
  layers = KVCache.create(L, B, 32, K, H, jnp.float32)
  q, k_new, v_new = (x[0] for x in _inputs(np.random.default_rng(0), 1, jnp.float32))
  with pytest.raises(TypeError, match=r"KVCache.attend: layer is traced.*stacked=True"):
    jax.jit(lambda c, i: c.attend(i, q, k_new, v_new))(layers, 1)
  with pytest.raises(TypeError, match=r"KVCache.replace_layer: layer is traced"):
    jax.jit(lambda c, i: c.replace_layer(i, c.k[0], c.v[0]))(layers, 1)


@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("layer,error,match", [
    (L, ValueError, rf"layer={L} is outside \[0, {L}\)"),
    (-1, ValueError, rf"layer=-1 is outside \[0, {L}\)"),
    (1.0, TypeError, "layer must be a scalar integer"),
    (np.array([1]), TypeError, "layer must be a scalar integer"),
])
def test_bad_concrete_layer(stacked, layer, error, match):
  cache = KVCache.create(L, B, 32, K, H, jnp.float32, stacked=stacked)
  q, k_new, v_new = (x[0] for x in _inputs(np.random.default_rng(0), 1, jnp.float32))
  with pytest.raises(error, match=match):
    cache.attend(layer, q, k_new, v_new)


def test_stacked_arrays_and_scales_are_checked():
  """``write`` with ``layer`` names the stacked layout and the scales it
  needs, with the shapes it got."""
  lengths = jnp.zeros((B,), jnp.int32)
  new = jnp.zeros((B, 1, K, H))
  layer_k = jnp.zeros((B, 16, K, H))
  with pytest.raises(ValueError, match=r"\(L, B, S_max, K, H\) of one dtype, got \(3, 16"):
    write(layer_k, layer_k, lengths, new, new, layer=0)
  cache = KVCache.create(L, B, 16, K, H, jnp.float8_e4m3fn, stacked=True)
  with pytest.raises(ValueError, match=r"needs k_scale float32 of shape \(3, 1, 1, 2\), got "
                                       r"float32 of shape \(1, 1, 2\)"):
    write(cache.k, cache.v, lengths, new, new, layer=0, k_scale=cache.k_scale[0],
          v_scale=cache.v_scale)
  with pytest.raises(ValueError, match=r"needs v_scale .* got None"):
    write(cache.k, cache.v, lengths, new, new, layer=0, k_scale=cache.k_scale)
  floats = KVCache.create(L, B, 16, K, H, jnp.float32, stacked=True)
  with pytest.raises(ValueError, match="k_scale and v_scale are for an int8 or float8"):
    write(floats.k, floats.v, lengths, new, new, layer=0, k_scale=cache.k_scale,
          v_scale=cache.v_scale)


def test_traced_layer_is_clamped():
  """A traced layer past the last is taken as the last (documented), as a
  slice update clamps its start."""
  rng = np.random.default_rng(tu.seed_of("stacked-clamp"))
  cache, _ = _caches(rng, jnp.float32, "float", [5, 9, 2], 16, 32)
  q, k_new, v_new = (x[0] for x in _inputs(rng, 1, jnp.float32))
  attend = jax.jit(lambda c, i: c.attend(i, q, k_new, v_new, implementation=tu.IMPL))
  for past, last in ((L + 5, L - 1), (-4, 0)):
    got, got_cache = attend(cache, past)
    want, want_cache = attend(cache, last)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(got_cache.k), np.asarray(want_cache.k))


@pytest.mark.parametrize("kv", list(KV_DTYPES))
def test_layer_accessors_under_a_traced_layer(kv):
  """``replace_layer`` and ``layer_scales`` of a stacked cache with a traced
  layer do what the tuple cache's do with a static one."""
  rng = np.random.default_rng(tu.seed_of(f"stacked-accessors{kv}"))
  stacked, layers = _caches(rng, jnp.bfloat16, kv, [8, 3, 1], 8, 16)
  new = jnp.asarray(rng.standard_normal((B, 16, K, H)), jnp.bfloat16)
  fresh = KVCache.from_prefill(new[None], new[None], [16] * B, 16, dtype=KV_DTYPES[kv])
  k, v = fresh.k[0], fresh.v[0]
  scales = [s[0] for s in (fresh.k_scale, fresh.v_scale)] if fresh.k_scale else []
  got = jax.jit(lambda c, i: c.replace_layer(i, k, v, *scales))(stacked, 1)
  _assert_same_contents(got, layers.replace_layer(1, k, v, *scales))
  got = jax.jit(lambda c, i: c.layer_scales(i))(stacked, 2)
  want = layers.layer_scales(2)
  assert got.keys() == want.keys() == ({"k_scale", "v_scale"} if kv != "float" else set())
  for name in want:
    np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]))


def test_room_checks():
  """max_len rounds up to a multiple of 16; check_room and advance report an
  overflow past it as for the tuple layout (at once, and under jit when the
  step runs)."""
  cache = KVCache.create(L, 2, 20, 1, 8, jnp.float32, lengths=[2, 30], stacked=True)
  assert cache.k.shape == (L, 2, 32, 1, 8) and cache.max_len == 32
  assert cache.check_room(2)
  with pytest.raises(ValueError, match=r"KV cache overflow.*S_max=32"):
    cache.check_room(3)
  with pytest.raises(ValueError, match=r"KV cache overflow"):
    cache.advance(3)
  answers = []
  jax.jit(lambda c: answers.append(c.check_room(3)) or c.lengths)(cache)
  assert answers == [False]
  if host_cpu_device() is not None:  # traced: reported through a host callback
    with pytest.raises(Exception, match=r"KV cache overflow"):
      jax.block_until_ready(jax.jit(lambda c: c.advance(3).lengths)(cache))
  jax.block_until_ready(jax.jit(lambda c: c.advance(2).lengths)(cache))
  with pytest.raises(ValueError, match=r"KV cache overflow.*S_max=32"):
    cache.attend(0, jnp.zeros((2, 3, 1, 8)), jnp.zeros((2, 3, 1, 8)), jnp.zeros((2, 3, 1, 8)))


def test_llama_decode_step_over_a_stacked_cache():
  """``llama.decode_step`` takes a stacked cache as it is (its layers run
  with static indices, each read in place as pages): the tuple cache's
  logits, bit for bit, over two steps."""
  config = llama.PRESETS["tiny"]
  params = llama.init_params(config)
  tokens = np.random.default_rng(tu.seed_of("stacked-llama")).integers(
      0, config.vocab_size, (2, 12), dtype=np.int32)
  _, k, v = llama.prefill(params, tokens, config=config, implementation=tu.IMPL)
  caches = [KVCache.from_prefill(k, v, [12, 7], 32, stacked=stacked) for stacked in (True, False)]
  for step in range(2):
    ids = tokens[:, step:step + 1]
    got, caches[0] = llama.decode_step(params, caches[0], ids, config=config,
                                       implementation=tu.IMPL)
    want, caches[1] = llama.decode_step(params, caches[1], ids, config=config,
                                        implementation=tu.IMPL)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert caches[0].stacked and int(caches[0].lengths[1]) == 9
