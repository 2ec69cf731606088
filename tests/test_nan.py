"""NaN propagates exactly to the output rows that read it, nowhere else.

Rows that do not read a poisoned element must equal the clean run, which
catches a kernel that multiplies the value row of a masked key by a zero
probability (0 * NaN = NaN) inside a partially masked tile.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa_testutil as tu
from fastattn_jax import fast_attention, resolve_implementation

B, T, S, N, K, H = 2, 70, 70, 4, 2, 32
G = N // K


def _skip_value_on_xla(impl, operand):
  path = resolve_implementation(impl, dtype=jnp.float32)
  if operand == "value" and (path == "xla" or path.startswith(("cuda", "ascend"))):
    pytest.skip(f"the {path} path, like jax.nn, multiplies a masked value row by probability 0 "
                "(0 * NaN = NaN) inside a tile; only the CPU path isolates it")


def _run(impl, q, k, v, **opts):
  out, lse = fast_attention(q, k, v, return_residual=True, implementation=impl, **opts)
  return np.asarray(out), np.asarray(lse)


def _assert_only(out, lse, clean_out, expected_nan, lse_nan=True):
  """expected_nan: bool (B, T, N) rows that must hold NaN (all-NaN if
  ``lse_nan``, i.e. the NaN entered the logits); others equal the clean run."""
  row_nan = np.isnan(out).all(-1) if lse_nan else np.isnan(out).any(-1)
  any_nan = np.isnan(out).any(-1)
  assert np.array_equal(row_nan, expected_nan) and np.array_equal(any_nan, expected_nan), (
      f"NaN rows {np.argwhere(any_nan)[:8].tolist()} (all-NaN "
      f"{np.argwhere(row_nan)[:8].tolist()}), expected {np.argwhere(expected_nan)[:8].tolist()}")
  lse_expected = expected_nan if lse_nan else np.zeros_like(expected_nan)
  assert np.array_equal(np.isnan(lse), lse_expected), (
      f"LSE NaN at {np.argwhere(np.isnan(lse))[:8].tolist()}, expected at "
      f"{np.argwhere(lse_expected)[:8].tolist()}")
  np.testing.assert_allclose(out[~expected_nan], clean_out[~expected_nan],
                             rtol=1e-6, atol=1e-6)


@pytest.fixture
def inputs(rng):
  return tu.qkv(rng, B, T, S, N, K, H)


@pytest.mark.parametrize("causal", [False, True])
def test_nan_in_query_row_reaches_only_that_row(inputs, impl, causal):
  q, k, v = inputs
  clean, _ = _run(impl, q, k, v, is_causal=causal)
  b, i, n = 1, 37, 2
  out, lse = _run(impl, q.at[b, i, n, 5].set(jnp.nan), k, v, is_causal=causal)
  expected = np.zeros((B, T, N), bool)
  expected[b, i, n] = True
  _assert_only(out, lse, clean, expected)


@pytest.mark.parametrize("operand", ["key", "value"])
def test_nan_in_key_row_with_causal_reaches_rows_at_or_after_it(inputs, impl, operand):
  _skip_value_on_xla(impl, operand)
  q, k, v = inputs
  clean, _ = _run(impl, q, k, v, is_causal=True)
  b, j, kh = 0, 41, 1
  args = {"key": k, "value": v}
  args[operand] = args[operand].at[b, j, kh, 3].set(jnp.nan)
  out, lse = _run(impl, q, args["key"], args["value"], is_causal=True)
  expected = np.zeros((B, T, N), bool)
  expected[b, j:, kh * G:(kh + 1) * G] = True  # the query heads of kv head kh
  # A NaN key enters the logits (whole row NaN, LSE NaN); a NaN value only
  # the output column it is in.
  _assert_only(out, lse, clean, expected, lse_nan=operand == "key")


@pytest.mark.parametrize("path", ["under_test", "xla"])
@pytest.mark.parametrize("garbage", [np.nan, np.inf, -np.inf, 3e38])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_garbage_beyond_kv_lengths_never_reaches_output(rng, impl, garbage, dtype, path):
  """The docstring promises keys j >= length are never read, on every path."""
  impl = "xla" if path == "xla" else impl
  q, k, v = tu.qkv(rng, B, T, S, N, K, H, tu.DTYPES[dtype])
  kv_lens = tu.lengths([S - 13, 1])
  opts = dict(key_value_seq_lengths=kv_lens, query_seq_lengths=tu.lengths([T, T - 5]))
  clean, clean_lse = _run(impl, q, k, v, **opts)
  beyond = np.arange(S)[None, :, None, None] >= np.asarray(kv_lens)[:, None, None, None]
  k_bad = jnp.where(beyond, jnp.asarray(garbage, k.dtype), k)
  v_bad = jnp.where(beyond, jnp.asarray(garbage, v.dtype), v)
  out, lse = _run(impl, q, k_bad, v_bad, **opts)
  assert np.array_equal(out, clean, equal_nan=False), "garbage beyond the key lengths leaked"
  np.testing.assert_array_equal(lse, clean_lse)
  assert np.isfinite(np.asarray(out, np.float32)).all()


@pytest.mark.parametrize("operand", ["key", "value"])
def test_nan_in_masked_keys_does_not_leak(inputs, impl, operand):
  """Keys hidden by mask, window or causality are never read either."""
  _skip_value_on_xla(impl, operand)
  q, k, v = inputs
  mask = np.ones((B, 1, T, S), bool)
  mask[:, :, :, 10] = False  # key 10 masked for every row
  opts = dict(mask=jnp.asarray(mask), is_causal=True, local_window_size=(20, 0))
  clean, clean_lse = _run(impl, q, k, v, **opts)
  args = {"key": k, "value": v}
  args[operand] = args[operand].at[:, 10].set(jnp.nan).at[:, 60].set(jnp.nan)
  out, lse = _run(impl, q, args["key"], args["value"], **opts)
  expected = np.zeros((B, T, N), bool)
  expected[:, 60:] = True  # key 60 is visible to rows 60..69 (window 20)
  _assert_only(out, lse, clean, expected, lse_nan=operand == "key")


def test_nan_in_bias_entry_reaches_only_its_row(inputs, rng, impl):
  q, k, v = inputs
  bias = tu.random_bias(rng, (B, N, T, S))
  clean, _ = _run(impl, q, k, v, bias=bias)
  out, lse = _run(impl, q, k, v, bias=bias.at[1, 3, 12, 50].set(jnp.nan))
  expected = np.zeros((B, T, N), bool)
  expected[1, 12, 3] = True
  _assert_only(out, lse, clean, expected)


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
def test_a_mask_creates_no_infinity(rng, impl, dtype):
  """Under ``jax.debug_infs`` (what users switch on to hunt NaNs) attention with
  a boolean mask, and its gradient, run clean as jax.nn's do: masked logits
  create no infinity anywhere (every row here sees a key, so not even the
  documented -inf LSE of an empty row appears). float64 takes the reference
  math; the gradient of every dtype replays it."""
  with tu.x64():
    q, k, v = tu.qkv(rng, B, 17, 23, N, K, H, tu.DTYPES.get(dtype, jnp.float64))
    mask = tu.random_mask(rng, (B, 1, 17, 23), 0.5).at[..., 0].set(True)
    f = lambda q, k, v: fast_attention(q, k, v, mask=mask, is_causal=True,
                                       implementation=None if dtype == "float64" else impl)
    loss = lambda q, k, v: jnp.sum(jnp.square(f(q, k, v).astype(jnp.float32)))
    with jax.debug_infs(True):
      out = f(q, k, v)
      grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  assert np.isfinite(np.asarray(out, np.float64)).all()
  assert all(np.isfinite(np.asarray(g, np.float64)).all() for g in grads)
