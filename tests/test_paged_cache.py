"""``PagedKVCache``: the page allocator (reserve, release, truncate, shared
prefixes) and decoding through it, against a contiguous ``KVCache`` holding
the same positions (bit for bit: the same keys at the same positions, and
the block table as wide as the contiguous cache is long)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa_testutil as tu
from fastattn_jax import KVCache, PagedKVCache

L, B, K, N, H, PS = 2, 3, 2, 4, 64, 16


def _prefill(rng, P):
  k = jnp.asarray(rng.standard_normal((L, B, P, K, H)), jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal((L, B, P, K, H)), jnp.bfloat16)
  return k, v


@functools.partial(jax.jit, donate_argnums=0)
def _step(cache, q, k_new, v_new):
  T = q.shape[2]
  if isinstance(cache, PagedKVCache):
    cache = cache.reserve(T)
  outs = []
  for layer in range(L):
    out, cache = cache.attend(layer, q[layer], k_new[layer], v_new[layer],
                              implementation=tu.IMPL)
    outs.append(out)
  return jnp.stack(outs), cache.advance(T)


def _steps(rng, T):
  return (jnp.asarray(rng.standard_normal((L, B, T, N, H)), jnp.bfloat16),
          jnp.asarray(rng.standard_normal((L, B, T, K, H)), jnp.bfloat16),
          jnp.asarray(rng.standard_normal((L, B, T, K, H)), jnp.bfloat16))


def test_decoding_matches_contiguous_cache():
  """Prefill of ragged lengths, then steps of T = 1 and T = 3 crossing page
  boundaries: outputs equal the contiguous cache's, and each sequence holds
  exactly the pages its length needs."""
  rng = np.random.default_rng(tu.seed_of("paged-cache"))
  max_len = 8 * PS
  k, v = _prefill(rng, 40)
  lengths = [40, 16, 1]
  paged = PagedKVCache.from_prefill(k, v, lengths, num_pages=20, page_size=PS, max_len=max_len)
  dense = KVCache.from_prefill(k, v, lengths, max_len)
  for T in (1, 3, 1, 3, 3):
    q, k_new, v_new = _steps(rng, T)
    got, paged = _step(paged, q, k_new, v_new)
    want, dense = _step(dense, q, k_new, v_new)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  lengths = np.asarray(paged.lengths)
  np.testing.assert_array_equal(lengths, np.asarray(dense.lengths))
  table = np.asarray(paged.block_table)
  held = (table >= 0).sum(axis=1)
  np.testing.assert_array_equal(held, -(-lengths // PS))
  pages = table[table >= 0]
  assert len(set(pages.tolist())) == len(pages), "a page given to two sequences"
  np.testing.assert_array_equal(np.asarray(paged.refs)[pages], 1)
  assert int(np.asarray(paged.refs).sum()) == len(pages)


def test_release_returns_pages_and_they_are_reused():
  rng = np.random.default_rng(tu.seed_of("paged-release"))
  k, v = _prefill(rng, 64)
  cache = PagedKVCache.from_prefill(k, v, [64, 33, 20], num_pages=9, page_size=PS,
                                    max_len=6 * PS)
  assert int((np.asarray(cache.refs) == 0).sum()) == 9 - (4 + 3 + 2)
  with pytest.raises(ValueError, match="out of pages"):
    cache.check_room(16)  # 64 + 16 and 33 + 16 need two more pages, none free
  freed = set(np.asarray(cache.block_table)[0, :4].tolist())
  cache = cache.release(jnp.array([True, False, False]))
  assert int(cache.lengths[0]) == 0 and (np.asarray(cache.block_table)[0] < 0).all()
  assert int((np.asarray(cache.refs) == 0).sum()) == 4
  cache = cache.reserve(16)
  # The new sequence 0 and sequence 1's next page come from the freed pages.
  reused = set(np.asarray(cache.block_table).ravel().tolist()) & freed
  assert len(reused) == 3
  # Decoding after reuse still matches a contiguous cache of the same contents.
  q, k_new, v_new = _steps(rng, 16)
  out, cache = _step(cache, q, k_new, v_new)
  dense = KVCache.from_prefill(k, v, [64, 33, 20], 6 * PS)
  dense = KVCache(k=dense.k, v=dense.v, lengths=jnp.array([0, 33, 20], jnp.int32))
  want, _ = _step(dense, q, k_new, v_new)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))


def test_shared_prefix_pages():
  """Sequence 1 starts with sequence 0's first two pages, not copied: the
  shared pages are held twice, released once each, and attention over them
  equals attention over a copy."""
  rng = np.random.default_rng(tu.seed_of("paged-share"))
  k, v = _prefill(rng, 40)
  cache = PagedKVCache.from_prefill(k, v, [40, 0, 0], num_pages=12, page_size=PS,
                                    max_len=4 * PS)
  cache = cache.share_prefix(0, 1, 2 * PS)
  shared = np.asarray(cache.block_table)[0, :2]
  np.testing.assert_array_equal(np.asarray(cache.block_table)[1, :2], shared)
  np.testing.assert_array_equal(np.asarray(cache.refs)[shared], 2)
  q, k_new, v_new = _steps(rng, 1)
  out, cache = _step(cache, q, k_new, v_new)
  copy = jnp.concatenate([k[:, :1, :2 * PS], k[:, :1, :2 * PS]], axis=1)
  copy_v = jnp.concatenate([v[:, :1, :2 * PS], v[:, :1, :2 * PS]], axis=1)
  zeros = jnp.zeros((L, 1, 2 * PS, K, H), k.dtype)
  dense = KVCache.from_prefill(jnp.concatenate([copy, zeros], 1),
                               jnp.concatenate([copy_v, zeros], 1), [2 * PS, 2 * PS, 0], 4 * PS)
  want, _ = _step(dense, q.at[:, 0].set(q[:, 1]), k_new.at[:, 0].set(k_new[:, 1]),
                  v_new.at[:, 0].set(v_new[:, 1]))
  np.testing.assert_array_equal(np.asarray(out[:, 1], np.float32),
                                np.asarray(want[:, 1], np.float32))
  cache = cache.release(jnp.array([True, False, False]))
  np.testing.assert_array_equal(np.asarray(cache.refs)[shared], 1)
  with pytest.raises(ValueError, match="multiple of page_size"):
    cache.share_prefix(1, 2, PS + 1)


def test_limits_are_reported():
  cache = PagedKVCache.create(1, 2, 4, PS, K, H, max_len=3 * PS)
  with pytest.raises(ValueError, match="max_len"):
    cache.check_room(3 * PS + 1)
  with pytest.raises(ValueError, match="out of pages"):
    cache.reserve(3 * PS)  # two sequences of three pages each, four pages
  assert cache.reserve(2 * PS).check_room(0)
  with pytest.raises(ValueError, match="page_size"):
    PagedKVCache.create(1, 2, 4, 24, K, H)
