"""The training features: segment ids (packed sequences), attention sinks and
ALiBi, forward and gradients, on the path under test.

Each is checked against this suite's float64 reference given the equivalent
dense form: segment ids as the (B, 1, T, S) mask of equal ids, ALiBi as the
(B|1, N, T, S) bias ``-slope |i - j|``, a sink as an extra logit with a value
row of zeros. Outputs, LSE and every gradient (dq, dk, dv, the sinks' and
the slopes') under the acceptance rule of ``fa_testutil``: at most twice the
xla path's error in the same dtype, plus the dtype's atol.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa_testutil as tu
from fastattn_jax import cuda, explain, fast_attention


def dense_terms(B, T, S, N, q_ids, kv_ids, slopes):
  """The reference's mask and bias for segment ids and ALiBi slopes (top-left
  aligned: pos(i) = i)."""
  mask = None if q_ids is None else (q_ids[:, None, :, None] == kv_ids[:, None, None, :])
  bias = None
  if slopes is not None:
    distance = np.abs(np.arange(T)[:, None] - np.arange(S)[None, :]).astype(np.float64)
    bias = -np.asarray(slopes, np.float64).reshape(-1, N)[:, :, None, None] * distance
  return mask, bias


CASES = {
    "packed_causal": dict(B=2, T=150, S=150, N=4, K=2, H=64, segments=5, order="sorted",
                          opts=dict(is_causal=True)),
    "single_rows": dict(B=1, T=40, S=40, N=2, K=1, H=32, segments=40, order="sorted"),
    "shuffled_gqa": dict(B=2, T=97, S=97, N=6, K=2, H=40, segments=8, order="shuffled"),
    "scattered_window": dict(B=2, T=70, S=70, N=2, K=2, H=24, segments=3, order="scattered",
                             opts=dict(local_window_size=(9, 4))),
    "cross_lengths": dict(B=2, T=33, S=129, N=2, K=1, H=64, segments=4, order="sorted",
                          opts=dict(query_seq_lengths=(33, 20),
                                    key_value_seq_lengths=(129, 50))),
    "sinks": dict(B=2, T=65, S=81, N=4, K=2, H=48, sinks=True, opts=dict(is_causal=True)),
    "sinks_empty_rows": dict(B=2, T=30, S=30, N=2, K=1, H=32, sinks=True,
                             opts=dict(key_value_seq_lengths=(30, 0))),
    "alibi": dict(B=2, T=90, S=90, N=4, K=4, H=64, alibi="heads", opts=dict(is_causal=True)),
    "alibi_per_batch_cross": dict(B=2, T=31, S=70, N=3, K=1, H=20, alibi="batch"),
    "alibi_packed_window": dict(B=2, T=260, S=260, N=4, K=2, H=128, segments=4, order="sorted",
                                alibi="heads", opts=dict(is_causal=True,
                                                         local_window_size=(100, 0),
                                                         query_seq_lengths=(260, 190))),
    "all_three_softcap": dict(B=2, T=120, S=120, N=4, K=2, H=64, segments=3, order="sorted",
                              sinks=True, alibi="heads",
                              opts=dict(is_causal=True, logits_soft_cap=20.0)),
}


def make_case(rng, name, dtype):
  spec = dict(CASES[name])
  B, T, S, N, K, H = (spec.pop(x) for x in "BTSNKH")
  opts = {k: (tu.lengths(v) if k.endswith("lengths") else v)
          for k, v in spec.pop("opts", {}).items()}
  q, k, v = tu.qkv(rng, B, T, S, N, K, H, tu.DTYPES[dtype])
  features, ref = {}, {}
  q_ids = kv_ids = slopes = None
  if "segments" in spec:
    q_ids = tu.random_ids(rng, B, T, spec["segments"], spec["order"])
    kv_ids = q_ids if T == S else tu.random_ids(rng, B, S, spec["segments"], spec["order"])
    features["segment_ids"] = q_ids if T == S else (q_ids, kv_ids)
  if spec.get("sinks"):
    features["sinks"] = ref["sinks"] = rng.normal(0.0, 2.0, N).astype(np.float32)
    ref["sinks"] = ref["sinks"][None]
  if spec.get("alibi"):
    shape = (N,) if spec["alibi"] == "heads" else (B, N)
    slopes = features["alibi_slopes"] = rng.uniform(0.01, 0.3, shape).astype(np.float32)
  mask, bias = dense_terms(B, T, S, N, q_ids, kv_ids, slopes)
  return (q, k, v), opts, features, mask, bias, ref


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(CASES))
def test_forward(name, dtype, rng, impl):
  (q, k, v), opts, features, mask, bias, ref = make_case(rng, name, dtype)
  run = lambda impl, q, k, v: jax.jit(functools.partial(
      fast_attention, return_residual=True, implementation=impl, **opts, **features))(q, k, v)
  out, lse = run(impl, q, k, v)
  computed = tu.computed_dtype(impl, dtype)
  xout, xlse = run("xla", *(x.astype(tu.DTYPES[computed]) for x in (q, k, v)))
  ref_out, ref_lse = tu.reference64(q, k, v, bias, mask, **opts, **ref)
  atol = max(tu.OUT_ATOL[dtype], tu.OUT_ATOL[computed])
  tu.assert_accepted(out, xout.astype(q.dtype), ref_out, atol,
                     max(tu.XLA_MAX_ERR[dtype], 2 * tu.XLA_MAX_ERR[computed]), "output")
  tu.assert_accepted(lse, xlse, ref_lse, tu.LSE_ATOL[computed], 2 * tu.XLA_MAX_ERR[computed],
                     "LSE")


@pytest.mark.parametrize("name", ["packed_causal", "shuffled_gqa", "cross_lengths", "sinks",
                                  "sinks_empty_rows", "alibi", "alibi_per_batch_cross",
                                  "all_three_softcap"])
def test_gradients(name, rng, impl):
  """dq, dk, dv, dsinks and dslopes within twice the xla path's error of the
  float64 definition (FlashAttention's rule), in float32 (bfloat16 on the
  CUDA paths, which multiply in 16 bits)."""
  dtype = "float32" if impl is None or not impl.startswith("cuda") else "bfloat16"
  (q, k, v), opts, features, mask, bias, ref = make_case(rng, name, dtype)
  d_out = jnp.asarray(rng.standard_normal(q.shape), q.dtype)
  sinks = features.pop("sinks", None)
  slopes = features.pop("alibi_slopes", None)

  def grads(impl, q, k, v):
    def loss(q, k, v, sinks, slopes):
      out = fast_attention(q, k, v, implementation=impl, sinks=sinks, alibi_slopes=slopes,
                           **opts, **features)
      return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(q, k, v, sinks, slopes)

  fast = grads(impl, q, k, v)
  computed = tu.DTYPES[tu.computed_dtype(impl, dtype)]
  xla = grads("xla", *(x.astype(computed) for x in (q, k, v)))
  dq, dk, dv, dbias, dsinks = tu.reference64_grads(q, k, v, d_out, bias, mask, **opts, **ref,
                                                   with_sinks=True)
  want = {"dq": dq, "dk": dk, "dv": dv}
  if sinks is not None:
    want["dsinks"] = dsinks.reshape(np.shape(sinks))
  if slopes is not None:
    distance = np.abs(np.arange(q.shape[1])[:, None] - np.arange(k.shape[1])[None, :])
    dslopes = -np.sum(dbias * distance, axis=(2, 3))  # (B|1, N)
    want["dslopes"] = dslopes.sum(axis=0) if np.ndim(slopes) == 1 else dslopes
  got = dict(zip(("dq", "dk", "dv", "dsinks", "dslopes"), fast))
  xgot = dict(zip(("dq", "dk", "dv", "dsinks", "dslopes"), xla))
  for what, ref_grad in want.items():
    scale = max(1.0, float(np.max(np.abs(ref_grad))))
    err, xerr = tu.max_err(got[what], ref_grad), tu.max_err(xgot[what], ref_grad)
    atol = tu.grad_floor(impl, dtype) * scale
    assert err <= 2 * xerr + atol, f"{what}: {err:.3g} > 2 * {xerr:.3g} + {atol:.3g}"


def test_segments_skip_nothing_they_need(rng, impl):
  """Ids that never meet: every row sees no key (out 0, LSE -inf); one id in
  all: bit for bit the call that computes the same: on kernel 90 the call
  without ids (its features build skips the test on tiles of one id and is
  otherwise the plain kernel); on the other CUDA kernels (ids in the extras
  build) and the CPU (ids on its tiled path), a mask of all True."""
  q, k, v = tu.qkv(rng, 1, 64, 64, 2, 1, 32)
  apart = fast_attention(q, k, v, segment_ids=(jnp.zeros((1, 64), jnp.int32),
                                                jnp.ones((1, 64), jnp.int32)),
                         implementation=impl, return_residual=True)
  assert np.all(np.asarray(apart[0]) == 0) and np.all(np.isneginf(apart[1]))
  same = fast_attention(q, k, v, segment_ids=jnp.full((1, 64), 7), implementation=impl,
                        is_causal=True)
  path = impl
  if tu.has_gpu() and impl is None:
    path = cuda.default_implementation(cuda.compute_capability(), 32)
  kernel_90 = path == "cuda_sm90"
  mask = None if kernel_90 else jnp.ones((1, 1, 64, 64), bool)
  plain = fast_attention(q, k, v, mask=mask, implementation=impl, is_causal=True)
  np.testing.assert_array_equal(np.asarray(same), np.asarray(plain))


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(segment_ids=np.zeros((2, 5), np.int32)), ValueError, "segment_ids must have shape"),
    (dict(segment_ids=np.zeros((2, 16), np.float32)), TypeError, "segment_ids must be an integ"),
    (dict(segment_ids=(np.zeros((2, 16), np.int32), np.zeros((2, 9), np.int32))), ValueError,
     "kv_segment_ids must have shape \\(2, 16\\)"),
    (dict(sinks=np.zeros((3,), np.float32)), ValueError, "sinks must have shape \\(4,\\)"),
    (dict(sinks=np.zeros((4,), np.int32)), TypeError, "sinks must be a floating"),
    (dict(alibi_slopes=np.zeros((3, 4), np.float32)), ValueError, "alibi_slopes must have sh"),
    (dict(sinks=np.zeros((4,), np.float32), implementation="cudnn"), ValueError, "cudnn"),
])
def test_errors_name_the_argument(kwargs, error, message):
  q = jnp.zeros((2, 16, 4, 8))
  kv = jnp.zeros((2, 16, 2, 8))
  with pytest.raises(error, match=message):
    jax.eval_shape(functools.partial(fast_attention, **kwargs), q, kv, kv)


def test_one_array_of_ids_needs_t_equal_s():
  q, kv = jnp.zeros((1, 4, 1, 8)), jnp.zeros((1, 6, 1, 8))
  with pytest.raises(ValueError, match="T == S"):
    fast_attention(q, kv, kv, segment_ids=jnp.zeros((1, 4), jnp.int32))


def test_explain_names_the_features():
  q = jax.ShapeDtypeStruct((1, 128, 4, 64), jnp.float32)
  ids = jax.ShapeDtypeStruct((1, 128), jnp.int32)
  text = str(explain(q, q, q, segment_ids=ids, sinks=jax.ShapeDtypeStruct((4,), jnp.float32),
                     backend="cpu"))
  assert "segment ids, sinks computed per tile" in text, text


def test_vmap_folds_features(rng, impl):
  """vmap over segment ids, sinks and slopes (batched along with q) equals
  the calls one by one."""
  q, k, v = tu.qkv(rng, 3, 40, 40, 2, 1, 16)
  ids = jnp.asarray(tu.random_ids(rng, 3, 40, 4, "sorted"))
  sinks = jnp.asarray(rng.normal(size=(3, 2)), jnp.float32)
  slopes = jnp.asarray(rng.uniform(0, 0.2, (3, 2)), jnp.float32)
  one = lambda q, k, v, ids, s, a: fast_attention(q, k, v, segment_ids=ids, sinks=s,
                                                  alibi_slopes=a, implementation=impl)
  batched = jax.vmap(one)(q, k, v, ids, sinks, slopes)
  for b in range(3):
    np.testing.assert_allclose(np.asarray(batched[b]),
                               np.asarray(one(q[b], k[b], v[b], ids[b], sinks[b], slopes[b])),
                               rtol=1e-5, atol=1e-6)


def test_segment_spans_against_their_definition(rng):
  """``custom_calls.segment_spans`` (the kernels' view of the ids), and each
  of its rules on any platform, equal their definitions position by
  position, on sorted ids, runs in any order (MaxText's padding 0 last among
  them; exact on the CPU only), scattered and cross ids, and their ranges
  hold every key a row shares a segment with (and every row a key does)."""
  from fastattn_jax.custom_calls import segment_spans, spans_by_rule

  def spans(ids, other, is_sorted, general):
    n = len(ids)
    if not (is_sorted or general):
      return np.stack([ids, np.arange(1, n + 1), np.zeros(n), np.full(n, len(other))], -1)
    if is_sorted:
      ends = [next((k for k in range(i + 1, n) if ids[k] != ids[i]), n) for i in range(n)]
      return np.stack([ids, ends, [sum(y < x for y in other) for x in ids],
                       [sum(y <= x for y in other) for x in ids]], -1)
    own = [np.flatnonzero(ids == x) for x in ids]
    ends = [w[-1] + 1 if w[-1] - w[0] + 1 == len(w) else i + 1 for i, w in enumerate(own)]
    where = [np.flatnonzero(other == x) for x in ids]
    lo = np.array([w[0] if len(w) else 0 for w in where])
    hi = np.array([w[-1] + 1 if len(w) else len(other) for w in where])
    if np.any(np.diff(lo) < 0) or np.any(np.diff(hi) < 0):
      lo, hi = np.zeros(n), np.full(n, len(other))
    return np.stack([ids, ends, lo, hi], -1)

  def runs(length):  # 1 to 4 runs of distinct ids in a random order, padding 0 last or not
    cuts = np.sort(rng.choice(np.arange(1, length), min(3, length - 1), replace=False)) \
        if length > 1 else []
    ids = np.concatenate([np.full(len(c), x) for c, x in zip(
        np.split(np.arange(length), cuts), rng.permutation(np.arange(1, 5)))])
    return ids if rng.random() < 0.5 else np.where(np.arange(length) >= length - 2, 0, ids)

  for trial in range(12):
    T, S = rng.choice([1, 9, 33], 2)  # few shapes: few compiles
    q_ids = rng.integers(0, 5, (2, T)).astype(np.int32)
    kv_ids = rng.integers(0, 5, (2, S)).astype(np.int32)
    if trial % 3 == 1:
      q_ids, kv_ids = np.sort(q_ids, 1), np.sort(kv_ids, 1)
    if trial % 6 == 1:
      kv_ids[1] = kv_ids[1, ::-1]  # one sequence sorted, the other not
    if trial % 3 == 2:  # self-attention over runs
      q_ids = kv_ids = np.stack([runs(T), runs(T)]).astype(np.int32)
    on_cpu = jax.default_backend() == "cpu"  # runs in any order: the CPU's spans only
    for general, fn in ((on_cpu, segment_spans),
                        (False, functools.partial(spans_by_rule, runs=False)),
                        (True, functools.partial(spans_by_rule, runs=True))):
      q_spans, kv_spans = jax.jit(fn)(q_ids, kv_ids)
      for b in range(2):
        is_sorted = all(np.all(np.diff(x[b]) >= 0) for x in (q_ids, kv_ids))
        for own, other, sp in ((q_ids[b], kv_ids[b], q_spans[b]),
                               (kv_ids[b], q_ids[b], kv_spans[b])):
          np.testing.assert_array_equal(sp, spans(own, other, is_sorted, general))
          for i, x in enumerate(own):
            keys = np.flatnonzero(other == x)
            assert np.all((keys >= sp[i:, 2].min()) & (keys < sp[:i + 1, 3].max()))
            assert np.all(own[i:sp[i, 1]] == x)
        if trial % 3 == 2 and general:  # runs: every row's bounds are its own run
          counts = [np.sum(q_ids[b] == x) for x in q_ids[b]]
          np.testing.assert_array_equal(np.asarray(q_spans[b, :, 3] - q_spans[b, :, 2]),
                                        counts)
