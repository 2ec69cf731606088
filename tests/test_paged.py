"""Decode attention over a paged KV cache (``decode_attention(...,
block_table=...)``): pools of pages shared by every sequence, read through a
per-sequence block table.

References: the same call over the pages gathered into one contiguous cache
(bit for bit: the paths run the same arithmetic on the same keys, in place or
gathered), and the float64 definition (test_decode's ``_check``). The block
tables are shuffled, share prefix pages between sequences, and leave pages of
the pool unused and entries past a sequence's length pointing anywhere.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa_testutil as tu
from fastattn_jax import cuda
from fastattn_jax._util import host_cpu_device
from fastattn_jax.decode import decode_attention
from fastattn_jax.reference import gather_pages
from test_decode import _check


def _paged(rng, B, lengths, page_size, K, H, dtype, spare_pages=3, shared_pages=1):
  """Pools of random pages and a block table: every sequence's pages
  shuffled over the pool, the first ``shared_pages`` of sequences 0 and 1 the
  same pages (a shared prompt), ``spare_pages`` pages no sequence holds, and
  entries past a sequence's pages set to -1 or to another sequence's page."""
  max_pages = -(-max(lengths) // page_size) + 1
  needed = [-(-n // page_size) for n in lengths]
  pages = sum(needed) + spare_pages
  order = iter(rng.permutation(pages))
  table = np.full((B, max_pages), -1, np.int32)
  for b, n in enumerate(needed):
    for i in range(n):
      table[b, i] = next(order)
  if B > 1 and min(needed[:2]) >= shared_pages:
    table[1, :shared_pages] = table[0, :shared_pages]
  table[-1, needed[-1]:] = table[0, 0]
  k = rng.standard_normal((pages, page_size, K, H)).astype(np.float32)
  v = rng.standard_normal((pages, page_size, K, H)).astype(np.float32)
  return jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(table)


@pytest.mark.parametrize("page_size", [16, 64, 256])
@pytest.mark.parametrize("T,N,K,H,opts", [
    (1, 8, 2, 64, {}),
    (1, 32, 8, 128, {"logits_soft_cap": 5.0}),
    (3, 8, 2, 128, {}),                                  # 12 rows
    (16, 4, 1, 64, {"local_window_size": (100, 0)}),     # 64 rows, a window
    (20, 4, 1, 64, {}),                                  # 80 rows: the forward kernels
])
def test_paged_matches_contiguous(page_size, T, N, K, H, opts):
  """Paged equals the gathered cache bit for bit, and both the definition."""
  rng = np.random.default_rng(tu.seed_of(f"paged{page_size}{T}{N}{K}{H}{opts}"))
  lengths = [1000, 777, T - 1, 3 * page_size]
  B = len(lengths)
  q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.bfloat16)
  kp, vp, table = _paged(rng, B, lengths, page_size, K, H, jnp.bfloat16)
  lengths = jnp.asarray(lengths, jnp.int32)
  got = decode_attention(q, kp, vp, lengths, block_table=table, return_residual=True,
                         implementation=tu.IMPL, **opts)
  k, v = gather_pages(kp, table), gather_pages(vp, table)
  contiguous = decode_attention(q, k, v, lengths, return_residual=True,
                                implementation=tu.IMPL, **opts)
  for x, y in zip(got, contiguous):
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
  if "logits_soft_cap" not in opts:  # _check's definition has no soft cap (test_decode_rows')
    _check(q, k, v, lengths, "bfloat16", got=got, **opts)


def test_paged_float32_and_float16():
  rng = np.random.default_rng(tu.seed_of("paged-dtypes"))
  for dtype in ("float32", "float16"):
    lengths = [300, 31]
    q = jnp.asarray(rng.standard_normal((2, 2, 6, 40)), tu.DTYPES[dtype])
    kp, vp, table = _paged(rng, 2, lengths, 32, 3, 40, tu.DTYPES[dtype])
    lengths = jnp.asarray(lengths, jnp.int32)
    got = decode_attention(q, kp, vp, lengths, block_table=table, return_residual=True,
                           implementation=tu.IMPL)
    _check(q, gather_pages(kp, table), gather_pages(vp, table), lengths, dtype, got=got)


def test_paged_outputs_are_written(impl):
  """Outputs poisoned with NaN (donated buffers aliased with the results, as in
  test_poison.py): every element written, on the path that reads pages in
  place (the CUDA decode kernel) as on the others."""
  rng = np.random.default_rng(tu.seed_of("paged-poison"))
  dtype = tu.DTYPES[cuda.operand_dtype(impl, "bfloat16")] if impl in cuda.IMPLEMENTATIONS \
      else jnp.bfloat16
  lengths = [4099, 0, 17]
  q = jnp.asarray(rng.standard_normal((3, 4, 8, 128)), dtype)
  kp, vp, table = _paged(rng, 3, lengths, 64, 2, 128, dtype)
  lengths = jnp.asarray(lengths, jnp.int32)

  def attention(poison, q, kp, vp, lengths, table):
    del poison
    return decode_attention(q, kp, vp, lengths, block_table=table, return_residual=True,
                            implementation=impl)

  poisoned = jax.jit(attention, donate_argnums=0, keep_unused=True)
  poison = (jnp.full(q.shape, jnp.nan, q.dtype), jnp.full(q.shape[:-1], jnp.nan, jnp.float32))
  assert "input_output_alias" in poisoned.lower(poison, q, kp, vp, lengths,
                                                table).compile().as_text()
  pointers = [x.unsafe_buffer_pointer() for x in poison]
  out, lse = poisoned(poison, q, kp, vp, lengths, table)
  assert [out.unsafe_buffer_pointer(), lse.unsafe_buffer_pointer()] == pointers
  assert not np.isnan(np.asarray(out, np.float32)).any()
  assert not np.isnan(np.asarray(lse)).any()
  _check(q, gather_pages(kp, table), gather_pages(vp, table), lengths,
         tu.dtype_name(q), got=(out, lse))


def test_paged_gradients_reach_the_pages():
  """dQ and the pools' gradients equal those of the gathered cache (a page two
  sequences share gets both their gradients)."""
  rng = np.random.default_rng(tu.seed_of("paged-grad"))
  lengths = [70, 50]
  q = jnp.asarray(rng.standard_normal((2, 2, 4, 32)), jnp.float32)
  kp, vp, table = _paged(rng, 2, lengths, 16, 2, 32, jnp.float32, shared_pages=2)
  lengths = jnp.asarray(lengths, jnp.int32)
  d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

  def loss(paged, q, kp, vp):
    if paged:
      out = decode_attention(q, kp, vp, lengths, block_table=table, implementation=tu.IMPL)
    else:
      out = decode_attention(q, gather_pages(kp, table), gather_pages(vp, table), lengths,
                             implementation=tu.IMPL)
    return jnp.sum(out * d_out)

  got = jax.grad(lambda *a: loss(True, *a), argnums=(0, 1, 2))(q, kp, vp)
  want = jax.grad(lambda *a: loss(False, *a), argnums=(0, 1, 2))(q, kp, vp)
  for x, y in zip(got, want):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-6)
  assert float(jnp.abs(got[1][table[0, 0]]).sum()) > 0


def test_paged_under_vmap_and_jit():
  """vmap over pools and tables (each map index its own pool) and jit."""
  rng = np.random.default_rng(tu.seed_of("paged-vmap"))
  lengths = jnp.asarray([90, 33], jnp.int32)
  q = jnp.asarray(rng.standard_normal((3, 2, 1, 4, 64)), jnp.bfloat16)
  pools = [_paged(rng, 2, [90, 33], 32, 2, 64, jnp.bfloat16) for _ in range(3)]
  kp, vp, table = (jnp.stack(x) for x in zip(*pools))
  run = jax.jit(jax.vmap(lambda q, kp, vp, table: decode_attention(
      q, kp, vp, lengths, block_table=table, implementation=tu.IMPL)))
  got = run(q, kp, vp, table)
  for i in range(3):
    want = decode_attention(q[i], kp[i], vp[i], lengths, block_table=table[i],
                            implementation=tu.IMPL)
    np.testing.assert_array_equal(np.asarray(got[i], np.float32), np.asarray(want, np.float32))


@pytest.mark.skipif(host_cpu_device() is None, reason="JAX has no CPU device (JAX_PLATFORMS)")
@pytest.mark.parametrize("T,gathered", [(1, False), (16, False), (17, True)])
def test_cpu_decode_path_reads_pages_in_place(T, gathered):
  """On the CPU the decode path (up to 64 rows per key/value head) reads the
  pools through the block table: the compiled program gathers no pages; past
  it (68 rows) the pages are gathered for the tiled kernel."""
  on_cpu = jax.sharding.SingleDeviceSharding(host_cpu_device())
  q = jax.ShapeDtypeStruct((2, T, 8, 64), jnp.bfloat16, sharding=on_cpu)
  pool = jax.ShapeDtypeStruct((10, 16, 2, 64), jnp.bfloat16, sharding=on_cpu)
  table = jax.ShapeDtypeStruct((2, 5), jnp.int32, sharding=on_cpu)
  lengths = jax.ShapeDtypeStruct((2,), jnp.int32, sharding=on_cpu)
  hlo = jax.jit(lambda q, k, v, lengths, table: decode_attention(
      q, k, v, lengths, block_table=table, implementation="cpu")).lower(
          q, pool, pool, lengths, table).compile().as_text()
  assert ("gather(" in hlo) == gathered


@pytest.mark.parametrize("change,error,match", [
    (dict(page_size=8), ValueError, "page_size"),
    (dict(page_size=48), ValueError, "page_size"),
    (dict(table_shape=(3, 4)), ValueError, "block_table"),
    (dict(table_dtype=jnp.float32), TypeError, "block_table"),
    (dict(pool_K=3), ValueError, "k_pages"),
    (dict(length=5 * 16 + 1), ValueError, "lengths"),
])
def test_paged_errors(change, error, match):
  ps = change.get("page_size", 16)
  q = jnp.zeros((2, 1, 4, 32), jnp.float32)
  kp = jnp.zeros((10, ps, change.get("pool_K", 2), 32), jnp.float32)
  table = jnp.zeros(change.get("table_shape", (2, 5)),
                    jnp.int32).astype(change.get("table_dtype", jnp.int32))
  lengths = jnp.asarray([change.get("length", 1), 1], jnp.int32)
  with pytest.raises(error, match=match):
    decode_attention(q, kp, kp, lengths, block_table=table)
