"""The CPU kernel's decode path for several new tokens: T * N / K packed query
rows per key/value head up to 64, the head dimension in the vector lanes up to
6 rows, the query rows above (attention_cpu.cc: decode_layout), the tiled
kernel past 64.

References: the float64 definition with the end-aligned causal rule
(test_decode's ``_check``); for the backward, the float64 gradients, and the
exact zeros of dQ and dK where a row's only visible key has P = 1 (the
backward recomputes the logits in the order the forward summed them).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa_testutil as tu
from fastattn_jax import _ffi
from fastattn_jax.decode import decode_attention
from test_decode import _cache, _check
from test_grad_edges import _assert_rule, _grads, _xla_grads

#: The rows per key/value head where the CPU kernel changes layout.
HEAD_LANES_MAX, DECODE_MAX = 6, 64


@pytest.fixture(autouse=True)
def _on_the_cpu():
  with jax.default_device(jax.devices("cpu")[0]):
    yield


def _rows_check(T, N, K, H, dtype, lengths, S_max, seed, **opts):
  rng = np.random.default_rng(tu.seed_of(seed))
  B = len(lengths)
  q = jnp.asarray(rng.standard_normal((B, T, N, H)), tu.DTYPES[dtype])
  k, v = _cache(rng, B, S_max, K, H, tu.DTYPES[dtype])
  lengths = jnp.asarray(lengths, jnp.int32)
  got = decode_attention(q, k, v, lengths, implementation="cpu", return_residual=True, **opts)
  _check(q, k, v, lengths, dtype, got=got, **opts)


def _layout(T, N, K, H=64):
  plan = _ffi.cpu_plan(1, T, 4096, N, K, H, 2)
  return "tiled" if not plan["decode"] else "rows" if plan["row_lanes"] else "head"


@pytest.mark.parametrize("T", list(range(1, 18)))
def test_new_tokens_gqa4(T):
  """T = 1 to 17 at G = 4: 4 rows (head dimension in the lanes), 8 to 64 rows
  (rows in the lanes), 68 (the tiled kernel). Ragged lengths: shorter than T
  (the first queries see nothing), one key, T exactly, long enough for split-KV."""
  _rows_check(T, 8, 2, 64, "bfloat16", [T - 1, 1, T, 2500], 2600, f"gqa4{T}")


@pytest.mark.parametrize("G,T", [
    (1, 6), (1, 7), (1, 16), (1, 64), (1, 65),     # 6, 7, 16, 64, 65 rows
    (2, 3), (2, 4), (2, 32), (2, 33),
    (3, 2), (3, 3), (3, 21), (3, 22),              # 6, 9, 63, 66 rows
    (5, 1), (5, 2), (5, 12), (5, 13),
    (6, 1), (7, 1), (7, 9), (7, 10),               # 6, 7, 63, 70 rows
    (8, 1), (8, 8), (8, 9),                        # 8, 64, 72 rows
])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_at_the_limits(G, T, dtype):
  """Query heads per key/value head G = 1 to 8, at and one past each limit."""
  K = 2 if G <= 4 else 1
  _rows_check(T, G * K, K, 64, dtype, [T + 100, max(T - 2, 0), 1500], 1500,
              f"limits{G}{T}{dtype}")


@pytest.mark.parametrize("H", [40, 72, 80, 96, 128])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("T", [1, 3, 8])
def test_head_dims(T, H, dtype):
  """Head dimensions that are and are not a multiple of the vector width (the
  float32 rows in the lanes read K and V in place whatever H)."""
  _rows_check(T, 8, 2, H, dtype, [T - 1, 700, 333], 700, f"dims{T}{H}{dtype}")


@pytest.mark.parametrize("T", [2, 5, 16])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_window(T, dtype):
  """Sliding windows that end inside the new tokens and reach across tiles."""
  _rows_check(T, 8, 2, 64, dtype, [1800, T + 3, 40], 1800, f"window{T}{dtype}",
              local_window_size=(37, 0))


@pytest.mark.parametrize("T", [1, 2, 9, 16])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_soft_cap(T, dtype):
  rng = np.random.default_rng(tu.seed_of(f"cap{T}{dtype}"))
  B, S_max, N, K, H, cap = 3, 1300, 8, 2, 64, 5.0
  q = jnp.asarray(3 * rng.standard_normal((B, T, N, H)), tu.DTYPES[dtype])
  k, v = _cache(rng, B, S_max, K, H, tu.DTYPES[dtype])
  lengths = jnp.array([1300, 450, T - 1], jnp.int32)
  got, lse = decode_attention(q, k, v, lengths, implementation="cpu", logits_soft_cap=cap,
                              return_residual=True)
  pos = np.asarray(lengths)[:, None, None] - T + np.arange(T)[None, :, None]
  j = np.arange(S_max)[None, None, :]
  vis = (j <= pos) & (j < np.asarray(lengths)[:, None, None])
  ref, ref_lse = tu.reference64(q, k, v, mask=vis[:, None], logits_soft_cap=cap)
  xla, xla_lse = decode_attention(q, k, v, lengths, implementation="xla", logits_soft_cap=cap,
                                  return_residual=True)
  tu.assert_accepted(got, xla, ref, tu.OUT_ATOL[dtype], tu.XLA_MAX_ERR[dtype], "out")
  tu.assert_accepted(lse, xla_lse, ref_lse, tu.LSE_ATOL[dtype], tu.LSE_ATOL[dtype], "lse")


def test_non_finite_value_reaches_only_its_rows():
  """A NaN value in a key only the last new token sees (rows in the lanes, the
  guarded P V): every other row stays finite and equal to the clean result."""
  rng = np.random.default_rng(5)
  B, T, S_max, N, K, H = 1, 8, 600, 8, 2, 64
  q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
  k, v = _cache(rng, B, S_max, K, H, jnp.float32)
  lengths = jnp.array([600], jnp.int32)
  poisoned = v.at[0, 599, 1].set(jnp.nan)
  clean = decode_attention(q, k, v, lengths, implementation="cpu")
  got = np.asarray(decode_attention(q, k, poisoned, lengths, implementation="cpu"))
  assert np.isnan(got[0, T - 1, 4:]).all()
  np.testing.assert_array_equal(got[0, :T - 1], np.asarray(clean)[0, :T - 1])
  np.testing.assert_array_equal(got[0, T - 1, :4], np.asarray(clean)[0, T - 1, :4])


def test_layouts():
  """Which layout the CPU plan picks, by rows per key/value head."""
  assert _layout(1, 32, 8) == "head"                # 4 rows
  assert _layout(HEAD_LANES_MAX, 8, 8) == "head"
  assert _layout(HEAD_LANES_MAX + 1, 8, 8) == "rows"
  assert _layout(2, 32, 8) == "rows"                # 8 rows
  assert _layout(16, 32, 8) == "rows"               # 64 rows
  assert _layout(DECODE_MAX, 8, 8) == "rows"
  assert _layout(17, 32, 8) == "tiled"              # 68 rows
  assert _layout(DECODE_MAX + 1, 8, 8) == "tiled"


@pytest.mark.parametrize("T,N", [(3, 2), (4, 2), (32, 2), (33, 2)])  # 6, 8, 64, 66 rows
@pytest.mark.parametrize("magnitude", [1e3, 1e5])
def test_backward_single_visible_key(T, N, magnitude, rng):
  """|scale q.k| ~ magnitude, every row sees only its own key (window 0): P = 1,
  so dQ = dK = 0 and dV = dO, on each layout (the backward sums the logits in
  the order of the forward's layout)."""
  q, k, v = tu.qkv(rng, 2, T, T, N, 1, 64)
  d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  opts = dict(scale=magnitude / 8, local_window_size=(0, 0))
  ours = _grads("cpu", q, k, v, d_out, **opts)
  xla = _xla_grads("cpu", q, k, v, d_out, **opts)
  ref = tu.reference64_grads(q, k, v, d_out, **opts)[:3]
  for what, g in zip(("dQ", "dK", "dV"), ours):
    assert np.isfinite(g).all(), what
  assert np.abs(ref[0]).max() < 1e-6 and np.abs(ref[1]).max() < 1e-6
  _assert_rule("cpu", ours, xla, ref, "float32")


@pytest.mark.parametrize("T,N,K", [(2, 4, 2), (7, 4, 1), (16, 8, 2)])
def test_backward_matches_reference(T, N, K, rng):
  """Gradients of calls on each decode layout, causal end-aligned through
  fast_attention's window rule, against the float64 definition."""
  S = 300
  q, k, v = tu.qkv(rng, 2, T, S, N, K, 64)
  d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  opts = dict(key_value_seq_lengths=tu.lengths((S, 150)))
  ours = _grads("cpu", q, k, v, d_out, **opts)
  xla = _xla_grads("cpu", q, k, v, d_out, **opts)
  ref = tu.reference64_grads(q, k, v, d_out, **opts)[:3]
  _assert_rule("cpu", ours, xla, ref, "float32")
