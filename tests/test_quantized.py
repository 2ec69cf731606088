"""Decode attention over quantized KV caches: int8 (a scale per position and
key/value head) and float8_e4m3fn (a scale per head), contiguous and paged
(``decode_attention(..., k_scale=..., v_scale=...)``, ``decode.quantize``,
``KVCache`` / ``PagedKVCache`` of those dtypes).

References: the float64 definition over the dequantized cache (the cache's
exact values, ``values * scale`` in float64), by the suite's acceptance rule
against the xla path; paged against the same cache gathered (bit for bit);
the quantization error itself against its documented bound; and the
quantized cache against the unquantized one within the error bounds the
docs give (docs/validation.md). The CPU kernel's decode path reads the 8-bit
cache in place: its dequantization of every int8 and float8_e4m3fn value is
exact (``values * scale`` rounded once to float32), and the compiled program
holds no dequantized copy of the cache.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa_testutil as tu
from fastattn_jax import KVCache, PagedKVCache, backends
from fastattn_jax._util import host_cpu_device
from fastattn_jax.custom_calls import kernel_call
from fastattn_jax.decode import decode_attention, quantize
from fastattn_jax.reference import gather_pages
from fastattn_jax.shapes import AttentionConfig
from test_decode import _end_aligned_reference
from test_paged import _paged

on_the_cpu = pytest.mark.skipif(host_cpu_device() is None,
                                reason="JAX has no CPU device (JAX_PLATFORMS)")

QUANT = {"int8": jnp.int8, "float8_e4m3fn": jnp.float8_e4m3fn}


def _quantized(x, kind, rng):
  """(values, scale): int8 per position and head; float8 with random per-head
  scales around max|x| / 448 (a calibration's), so values use the range."""
  if kind == "int8":
    return quantize(x, jnp.int8)
  K = x.shape[2]
  scale = jnp.asarray(rng.uniform(0.5, 2.0, (1, 1, K)) * np.abs(np.asarray(x)).max() / 448,
                      jnp.float32)
  return quantize(x, jnp.float8_e4m3fn, scale)


def _dequantized64(values, scale):
  return np.asarray(values, np.float64) * np.asarray(scale, np.float64)[..., None]


def _gathered(x, scale, table):
  """A quantized pool and its scales gathered into one cache through ``table``."""
  return gather_pages(x, table), scale if scale.shape[0] == 1 else gather_pages(scale, table)


def _check(q, kq, vq, ks, vs, lengths, dtype, got=None, **opts):
  """The path under test (or its result `got`) against the float64 definition
  over the dequantized cache, by the suite's acceptance rule: the framework's
  own error is the xla path's over the cache dequantized to query's dtype or
  to the dtype the path computes in, whichever errs more (a path that does
  not read the cache in place dequantizes it to its operand dtype; the CUDA
  decode kernel reads the 8-bit values exactly)."""
  fast, fast_lse = got or decode_attention(q, kq, vq, lengths, k_scale=ks, v_scale=vs,
                                           implementation=tu.IMPL, return_residual=True, **opts)
  computed = tu.computed_dtype(tu.IMPL, dtype)
  k64, v64 = _dequantized64(kq, ks), _dequantized64(vq, vs)
  ref, ref_lse = _end_aligned_reference(q, k64, v64, lengths, opts.get("local_window_size"))
  xla = [decode_attention(q.astype(tu.DTYPES[d]), kq, vq, lengths, k_scale=ks, v_scale=vs,
                          implementation="xla", return_residual=True, **opts)
         for d in {dtype, computed}]
  xla_out = max((x[0] for x in xla), key=lambda x: tu.max_err(x, ref))
  xla_lse = max((x[1] for x in xla), key=lambda x: tu.max_err(x, ref_lse))
  atol = max(tu.OUT_ATOL[dtype], tu.OUT_ATOL[computed])
  xla_max = max(tu.XLA_MAX_ERR[dtype], 2 * tu.XLA_MAX_ERR[computed])
  tu.assert_accepted(fast, xla_out.astype(q.dtype), ref, atol, xla_max, "out")
  tu.assert_accepted(fast_lse, xla_lse, ref_lse, max(tu.LSE_ATOL[dtype], tu.LSE_ATOL[computed]),
                     2 * tu.XLA_MAX_ERR[computed], "lse")
  assert not np.asarray(fast)[~np.isfinite(ref_lse)].any(), "rows that see nothing must be 0"


def test_quantize_error_bounds():
  """int8: |x - values * scale| <= scale / 2 per element; float8: the
  relative rounding of e4m3 (2**-4) above its normal range, its subnormal
  step below, saturation to 448 * scale."""
  rng = np.random.default_rng(tu.seed_of("quantize"))
  x = jnp.asarray(rng.standard_normal((3, 17, 4, 40)) * rng.uniform(0.01, 50, (3, 17, 4, 1)),
                  jnp.float32)
  x = x.at[0, 0, 0].set(0.0)  # an all-zero row: scale 0, values 0
  values, scale = quantize(x, jnp.int8)
  assert values.dtype == jnp.int8 and scale.shape == (3, 17, 4)
  err = np.abs(np.asarray(x, np.float64) - _dequantized64(values, scale))
  assert np.all(err <= np.asarray(scale, np.float64)[..., None] / 2 * (1 + 1e-6) + 1e-30)
  assert float(scale[0, 0, 0]) == 0.0 and not np.asarray(values[0, 0, 0]).any()

  scale8 = jnp.asarray([[[0.01, 0.1, 1.0, 0.05]]], jnp.float32)
  values, same = quantize(x, jnp.float8_e4m3fn, scale8)
  assert values.dtype == jnp.float8_e4m3fn and same is not None
  x64, s64 = np.asarray(x, np.float64), np.asarray(scale8, np.float64)[..., None]
  deq = _dequantized64(values, scale8)
  inside = np.abs(x64) <= 448 * s64
  bound = np.maximum(np.abs(x64) * 2.0**-4, 2.0**-10 * s64)
  assert np.all(np.abs(x64 - deq)[inside] <= np.broadcast_to(bound, x64.shape)[inside])
  assert np.all(np.abs(deq[~inside]) == np.broadcast_to(448 * s64, x64.shape)[~inside])


@pytest.mark.parametrize("kind", list(QUANT))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("T,N,K,opts", [
    (1, 8, 2, {}),
    (1, 6, 1, {"local_window_size": (50, 0)}),
    (4, 4, 4, {}),
    (3, 16, 2, {}),                                   # 24 rows
])
def test_quantized_decode_matches_reference(kind, dtype, T, N, K, opts):
  rng = np.random.default_rng(tu.seed_of(f"quant{kind}{dtype}{T}{N}{K}{opts}"))
  B, S_max, H = 4, 301, 64
  q = jnp.asarray(rng.standard_normal((B, T, N, H)), tu.DTYPES[dtype])
  k = jnp.asarray(rng.standard_normal((B, S_max, K, H)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((B, S_max, K, H)), jnp.float32)
  (kq, ks), (vq, vs) = _quantized(k, kind, rng), _quantized(v, kind, rng)
  lengths = jnp.array([max(T - 1, 0), T, 177, S_max], jnp.int32)
  _check(q, kq, vq, ks, vs, lengths, dtype, **opts)


@pytest.mark.parametrize("kind", list(QUANT))
@pytest.mark.parametrize("page_size", [16, 64])
def test_paged_quantized_is_contiguous_quantized(kind, page_size):
  """A quantized pool read through a shuffled block table (shared prefix
  pages) equals the same cache gathered, bit for bit."""
  rng = np.random.default_rng(tu.seed_of(f"pagedquant{kind}{page_size}"))
  lengths = [700, 333, 2 * page_size, 1]
  B, T, N, K, H = len(lengths), 2, 8, 2, 128
  kp, vp, table = _paged(rng, B, lengths, page_size, K, H, jnp.float32)
  (kq, ks), (vq, vs) = _quantized(kp, kind, rng), _quantized(vp, kind, rng)
  q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.bfloat16)
  lengths = jnp.asarray(lengths, jnp.int32)
  got = decode_attention(q, kq, vq, lengths, block_table=table, k_scale=ks, v_scale=vs,
                         return_residual=True, implementation=tu.IMPL)
  (kc, ksc), (vc, vsc) = _gathered(kq, ks, table), _gathered(vq, vs, table)
  contiguous = decode_attention(q, kc, vc, lengths, k_scale=ksc, v_scale=vsc,
                                return_residual=True, implementation=tu.IMPL)
  for x, y in zip(got, contiguous):
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
  _check(q, kc, vc, ksc, vsc, lengths, "bfloat16", got=got)


@pytest.mark.parametrize("kind", list(QUANT))
def test_quantized_caches_write_and_attend(kind):
  """``KVCache`` and ``PagedKVCache`` of a quantized dtype: a prefill then
  steps of T = 1 and 3 under jit; each step equals ``decode_attention`` over
  the positions quantized by ``quantize``, and the two caches agree."""
  rng = np.random.default_rng(tu.seed_of(f"quantcache{kind}"))
  L, B, P, K, H, N = 2, 3, 40, 2, 64, 4
  dtype = QUANT[kind]
  k = jnp.asarray(rng.standard_normal((L, B, P, K, H)), jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal((L, B, P, K, H)), jnp.bfloat16)
  prompt = [40, 17, 1]
  dense = KVCache.from_prefill(k, v, prompt, 64, dtype=dtype)
  paged = PagedKVCache.from_prefill(k, v, prompt, num_pages=16, page_size=16, max_len=64,
                                    dtype=dtype)
  all_k, all_v = [np.asarray(k[1], np.float32)], [np.asarray(v[1], np.float32)]
  step = jax.jit(lambda c, q, kn, vn: c.attend(1, q, kn, vn))
  for T in (1, 3):
    q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.bfloat16)
    kn = jnp.asarray(rng.standard_normal((B, T, K, H)), jnp.bfloat16)
    vn = jnp.asarray(rng.standard_normal((B, T, K, H)), jnp.bfloat16)
    out, dense = step(dense, q, kn, vn)
    out_paged, paged = step(paged.reserve(T), q, kn, vn)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(out_paged, np.float32))
    # The same positions quantized directly, as a contiguous cache.
    lengths = np.asarray(dense.lengths) + T
    full_k = np.zeros((B, 64, K, H), np.float32)
    full_v = np.zeros((B, 64, K, H), np.float32)
    for b in range(B):
      n = prompt[b]
      full_k[b, :n] = all_k[0][b, :n]
      full_v[b, :n] = all_v[0][b, :n]
    all_k.append(np.asarray(kn, np.float32))
    all_v.append(np.asarray(vn, np.float32))
    for b in range(B):
      pos = prompt[b]
      for x in all_k[1:]:
        full_k[b, pos:pos + x.shape[1]] = x[b]
        pos += x.shape[1]
      pos = prompt[b]
      for x in all_v[1:]:
        full_v[b, pos:pos + x.shape[1]] = x[b]
        pos += x.shape[1]
    unit = None if kind == "int8" else jnp.ones((1, 1, K), jnp.float32)
    kq, ks = quantize(jnp.asarray(full_k, jnp.bfloat16), dtype, unit)
    vq, vs = quantize(jnp.asarray(full_v, jnp.bfloat16), dtype, unit)
    want = decode_attention(q, kq, vq, jnp.asarray(lengths, jnp.int32), k_scale=ks, v_scale=vs)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
    dense, paged = dense.advance(T), paged.advance(T)


@pytest.mark.parametrize("kind", list(QUANT))
def test_quantized_error_against_float_cache(kind):
  """The documented bound (docs/validation.md): over a bf16 cache of N(0, 1) keys
  and values at S = 4096, the int8 cache's output differs from the bf16
  cache's by at most 2% of the output's largest magnitude, the float8 cache's
  (scale max|x| / 448 per head, times 0.5 to 2) by at most 6% (measured on
  the CPU: 1.2% and 3.9%)."""
  rng = np.random.default_rng(tu.seed_of(f"quantbound{kind}"))
  B, S, N, K, H = 2, 4096, 8, 2, 128
  q = jnp.asarray(rng.standard_normal((B, 1, N, H)), jnp.bfloat16)
  k = jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.bfloat16)
  lengths = jnp.full((B,), S, jnp.int32)
  plain = decode_attention(q, k, v, lengths, implementation=tu.IMPL)
  (kq, ks), (vq, vs) = _quantized(k, kind, rng), _quantized(v, kind, rng)
  got = decode_attention(q, kq, vq, lengths, k_scale=ks, v_scale=vs, implementation=tu.IMPL)
  err = tu.max_err(got, np.asarray(plain, np.float64))
  largest = float(jnp.max(jnp.abs(plain.astype(jnp.float32))))
  assert err <= {"int8": 0.02, "float8_e4m3fn": 0.06}[kind] * largest, (err, largest)


def test_quantized_gradients_reach_query_and_scales():
  """Gradients through a quantized cache: query's and the scales', as those of
  the same attention over the dequantized cache (float32, the xla path)."""
  rng = np.random.default_rng(tu.seed_of("quantgrad"))
  B, S, N, K, H = 2, 200, 4, 2, 64
  q = jnp.asarray(rng.standard_normal((B, 2, N, H)), jnp.float32)
  kq, ks = quantize(jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.float32), jnp.int8)
  vq, vs = quantize(jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.float32), jnp.int8)
  lengths = jnp.asarray([S, 77], jnp.int32)
  d_out = jnp.asarray(rng.standard_normal((B, 2, N, H)), jnp.float32)

  def loss(implementation):
    return lambda q, ks, vs: jnp.sum(decode_attention(
        q, kq, vq, lengths, k_scale=ks, v_scale=vs, implementation=implementation) * d_out)

  got = jax.grad(loss(tu.IMPL), argnums=(0, 1, 2))(q, ks, vs)
  want = jax.grad(loss("xla"), argnums=(0, 1, 2))(q, ks, vs)
  # A path computing in float16 rounds q and the dequantized cache to it.
  rtol = 1e-4 if tu.computed_dtype(tu.IMPL, "float32") == "float32" else 1e-2
  for name, x, y in zip(("dq", "dk_scale", "dv_scale"), got, want):
    scale = float(jnp.max(jnp.abs(y)))
    assert tu.max_err(x, np.asarray(y, np.float64)) <= rtol * scale + 1e-6, name


def test_quantized_outputs_poisoned():
  """Every output element is written (outputs donated as NaN buffers, as
  test_poison does it), through the split-KV merge."""
  rng = np.random.default_rng(tu.seed_of("quantpoison"))
  B, T, S, N, K, H = 3, 1, 4099, 8, 2, 128
  q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.bfloat16)
  kq, ks = quantize(jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.float32), jnp.int8)
  vq, vs = quantize(jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.float32), jnp.int8)
  lengths = jnp.asarray([S, 1000, 0], jnp.int32)

  def attention(poison, q, kq, vq, ks, vs):
    del poison
    return decode_attention(q, kq, vq, lengths, k_scale=ks, v_scale=vs, return_residual=True,
                            implementation=tu.IMPL)

  poisoned = jax.jit(attention, donate_argnums=0, keep_unused=True)
  poison = (jnp.full(q.shape, jnp.nan, q.dtype), jnp.full(q.shape[:-1], jnp.nan, jnp.float32))
  out, lse = poisoned(poison, q, kq, vq, ks, vs)
  assert not np.isnan(np.asarray(out, np.float32)).any()
  assert not np.isnan(np.asarray(lse)).any()
  _check(q, kq, vq, ks, vs, lengths, "bfloat16", got=(out, lse))


@pytest.mark.parametrize("case, error, message", [
    ("no_scales", ValueError, "needs k_scale and v_scale"),
    ("one_scale", ValueError, "must be given together"),
    ("float_cache", ValueError, "are for an int8 or float8_e4m3fn cache"),
    ("bad_shape", ValueError, "does not broadcast"),
    ("int_scale", TypeError, "k_scale must be floating point"),
    ("mixed", ValueError, "of one dtype"),
])
def test_quantized_errors(case, error, message):
  B, S, N, K, H = 2, 32, 4, 2, 16
  q = jnp.zeros((B, 1, N, H), jnp.bfloat16)
  kq = jnp.zeros((B, S, K, H), jnp.int8)
  s = jnp.ones((B, S, K), jnp.float32)
  args = {
      "no_scales": (kq, kq, {}),
      "one_scale": (kq, kq, {"k_scale": s}),
      "float_cache": (kq.astype(jnp.bfloat16), kq.astype(jnp.bfloat16),
                      {"k_scale": s, "v_scale": s}),
      "bad_shape": (kq, kq, {"k_scale": jnp.ones((B, S + 1, K)), "v_scale": s}),
      "int_scale": (kq, kq, {"k_scale": jnp.ones((B, S, K), jnp.int32), "v_scale": s}),
      "mixed": (kq, kq.astype(jnp.float8_e4m3fn), {"k_scale": s, "v_scale": s}),
  }[case]
  with pytest.raises(error, match=message):
    decode_attention(q, args[0], args[1], jnp.full((B,), S), **args[2])


@on_the_cpu
@pytest.mark.parametrize("kind", list(QUANT))
@pytest.mark.parametrize("T,N,K,H,dtype", [
    (1, 4, 4, 40, "bfloat16"),      # 1 row per key/value head: the head dimension in the lanes
    (1, 8, 2, 20, "float16"),       # 4 rows
    (3, 8, 2, 40, "float32"),       # 12 rows: the rows in the lanes
    (16, 4, 1, 20, "bfloat16"),     # 64 rows, the most the decode path takes
    (2, 32, 1, 128, "bfloat16"),    # 64 rows
])
def test_cpu_decode_layouts_read_the_quantized_cache(kind, T, N, K, H, dtype):
  """The CPU decode path's layouts (attention_cpu.cc: decode_layout) over a
  quantized cache, H not a multiple of 8 and an odd cache length: contiguous
  against the float64 definition, paged against the same cache gathered, bit
  for bit."""
  rng = np.random.default_rng(tu.seed_of(f"cpuquant{kind}{T}{N}{K}{H}{dtype}"))
  lengths = [max(T - 1, 0), T, 177, 333]
  B = len(lengths)
  kp, vp, table = _paged(rng, B, lengths, 16, K, H, jnp.float32)
  (kq, ks), (vq, vs) = _quantized(kp, kind, rng), _quantized(vp, kind, rng)
  (kc, ksc), (vc, vsc) = _gathered(kq, ks, table), _gathered(vq, vs, table)
  kc, ksc, vc, vsc = kc[:, :333], ksc[:, :333], vc[:, :333], vsc[:, :333]
  q = jnp.asarray(rng.standard_normal((B, T, N, H)), tu.DTYPES[dtype])
  lengths = jnp.asarray(lengths, jnp.int32)
  with jax.default_device(host_cpu_device()):
    got = decode_attention(q, kc, vc, lengths, k_scale=ksc, v_scale=vsc, return_residual=True,
                           implementation="cpu")
    paged = decode_attention(q, kq, vq, lengths, block_table=table, k_scale=ks, v_scale=vs,
                             return_residual=True, implementation="cpu")
  for x, y in zip(paged, got):
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
  _check(q, kc, vc, ksc, vsc, lengths, dtype, got=got)


@on_the_cpu
@pytest.mark.parametrize("kind", list(QUANT))
@pytest.mark.parametrize("N", [1, 8])
def test_cpu_dequantizes_every_value_exactly(kind, N):
  """A row whose only visible key has P = 1 returns that key's value: every
  one of the 256 int8 or float8_e4m3fn values times its scale, rounded once to
  float32 (float8's NaNs NaN, its subnormals exact), with the head dimension
  (N = 1) or the rows (N = 8) in the lanes."""
  every = np.arange(256, dtype=np.uint8).view(QUANT[kind])
  v = jnp.asarray(np.broadcast_to(every, (1, 3, 1, 256)))
  k = jnp.zeros((1, 3, 1, 256), QUANT[kind])
  v_scale = jnp.asarray([[[0.37], [5.0], [2.0]]], jnp.float32)
  q = jnp.ones((1, 1, N, 256), jnp.float32)
  with jax.default_device(host_cpu_device()):
    out = decode_attention(q, k, v, jnp.ones((1,), jnp.int32), k_scale=jnp.ones((1, 1, 1)),
                           v_scale=v_scale, implementation="cpu")
  want = every.astype(np.float32) * np.float32(0.37)
  np.testing.assert_array_equal(np.asarray(out), np.broadcast_to(want, out.shape))


@on_the_cpu
@pytest.mark.parametrize("kind", list(QUANT))
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("T,in_place", [(1, True), (16, True), (17, False)])
def test_cpu_decode_path_reads_the_quantized_cache_in_place(kind, paged, T, in_place):
  """On the CPU the decode path (up to 64 rows per key/value head) reads the
  8-bit cache, contiguous or paged: the compiled program holds no dequantized
  copy of it; past it (68 rows) the cache is dequantized (and the pages
  gathered) for the tiled kernel."""
  on_cpu = jax.sharding.SingleDeviceSharding(host_cpu_device())
  spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=on_cpu)
  cache = (10, 16, 2, 64) if paged else (2, 80, 2, 64)
  scale = cache[:3] if kind == "int8" else (1, 1, 2)
  args = [spec((2, T, 8, 64), jnp.bfloat16), spec(cache, QUANT[kind]), spec(cache, QUANT[kind]),
          spec((2,), jnp.int32), spec(scale, jnp.float32), spec(scale, jnp.float32)]
  table = spec((2, 5), jnp.int32) if paged else None
  hlo = jax.jit(lambda q, k, v, lengths, ks, vs, table: decode_attention(
      q, k, v, lengths, block_table=table, k_scale=ks, v_scale=vs, implementation="cpu")).lower(
          *args, table).compile().as_text()
  dequantized = "bf16[" + ",".join(map(str, cache)) + "]"
  assert (dequantized in hlo) == (not in_place)
  assert ("gather(" in hlo) == (paged and not in_place)


@on_the_cpu
@pytest.mark.parametrize("T,kv_dtype,message", [
    (17, jnp.int8, "only the decode path"),
    (1, jnp.bfloat16, "must be S8 or F8E4M3FN"),
])
def test_cpu_target_refuses_scales(T, kv_dtype, message):
  """The CPU target takes scales on its decode path only, with an int8 or
  float8_e4m3fn cache (fused_call never sends it others)."""
  q = jnp.zeros((1, T, 8, 16), jnp.bfloat16)
  k = jnp.zeros((1, 32, 2, 16), kv_dtype)
  scale = jnp.ones((1, 1, 2), jnp.float32)
  config = AttentionConfig(scale=0.25)
  with (jax.default_device(host_cpu_device()),
        pytest.raises(jax.errors.JaxRuntimeError, match=message)):
    jax.block_until_ready(kernel_call(
        backends.CPU_TARGET, (jax.ShapeDtypeStruct(q.shape, q.dtype),
                              jax.ShapeDtypeStruct(q.shape[:3], jnp.float32)),
        config, q, k, k, None, None, None, None, jnp.zeros((0,), jnp.int32), scale, scale,
        variant=np.int64(0), fold_heads=np.int64(0)))
