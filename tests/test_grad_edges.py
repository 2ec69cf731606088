"""Gradients at the edges: what the backward recomputes must be what the
forward computed, and what no row sees must not reach any gradient.

* A NaN or Inf in a key that a boolean mask, causality or a local window
  hides leaves the forward and the gradients of the rows that do not see it
  finite, and equal to the gradients without it (0 * NaN must never be
  formed).
* The backward recomputes the forward's logits and exponent bit for bit: with
  logits of 1e3 to 1e5 a row's only visible key has P = 1 exactly, so dV = dO
  and dQ = dK = 0 there; a row of a single key (S = 1) gets dK = 0 as XLA does;
  FlashAttention's overflow test (float16, q * 5, k and v * 3, T = S = 2)
  passes the rule below.
* H = 0: every logit is 0 (plus the bias), so the LSE is log-sum-exp of the
  visible keys' biases, -inf for rows that see none.
* 16-bit gradients with logits of scale 1 and 2 (the forward keeps out in
  float32 for the backward's D = rowsum(dO o O)).

The rule is test_backward.py's: per gradient,
  max|grad - ref64| <= 2 * max|grad_xla - ref64| + GRAD_ATOL[dtype] * max(max|ref64|, 1)
with grad_xla the xla path in the same dtype (that the path multiplies in).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa_testutil as tu
from fastattn_jax import attention, backends, cuda, fast_attention, resolve_implementation
from test_backward import GRAD_ATOL


def _loss(impl, q, k, v, d_out, bias=None, mask=None, **opts):
  out = fast_attention(q, k, v, bias, mask, implementation=impl, **opts)
  return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32))


def _grads(impl, q, k, v, d_out, bias=None, mask=None, **opts):
  """(dq, dk, dv) of sum(out * d_out) as numpy float64."""
  loss = lambda q, k, v, d_out, bias, mask: _loss(impl, q, k, v, d_out, bias, mask, **opts)
  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  return [np.asarray(g, np.float64) for g in grad(q, k, v, d_out, bias, mask)]


def _computed(impl, x):
  """x rounded to the dtype the path multiplies it in (CUDA paths: float16)."""
  return x.astype(tu.DTYPES[tu.computed_dtype(impl, tu.dtype_name(x))])


def _xla_grads(impl, q, k, v, d_out, bias=None, mask=None, **opts):
  """The xla path's gradients in the dtype the path under test computes in."""
  q, k, v, d_out = (_computed(impl, x) for x in (q, k, v, d_out))
  return _grads("xla", q, k, v, d_out, bias, mask, **opts)


def _floor(impl, name):
  return max(GRAD_ATOL[name], GRAD_ATOL[tu.computed_dtype(impl, name)])


def _assert_rule(impl, ours, xla, ref, name, where=None, whats=("dQ", "dK", "dV")):
  """The FlashAttention-2 rule per gradient, over ``where`` (per gradient, or all)."""
  for i, (what, g, x, r) in enumerate(zip(whats, ours, xla, ref)):
    sel = None if where is None else where[i]
    r_sel = r if sel is None else r[sel]
    err, err_xla = tu.max_err(g, r, sel), tu.max_err(x, r, sel)
    floor = _floor(impl, name) * max(float(np.abs(r_sel).max(initial=0.0)), 1.0)
    assert err <= 2 * err_xla + floor, (
        f"{what}: max|ours - ref64| = {err:.3g} > 2 * max|xla - ref64| ({err_xla:.3g}) "
        f"+ {floor:.3g}")


# --- a non-finite key that some rows do not see -------------------------------

B, T, S, N, K, H = 2, 100, 100, 4, 2, 32
G = N // K
POISONED = (1, 45, 1)  # (b, key j, kv head kh)


def _hiding(kind):
  """Options that hide key j = POISONED[1] from some rows, and the (B, T, N)
  rows that do not see it."""
  b, j, kh = POISONED
  hidden = np.ones((B, T, N), bool)
  i = np.arange(T)
  if kind == "mask":
    mask = np.ones((B, 1, T, S), bool)
    mask[:, :, :, j] = False
    return dict(mask=jnp.asarray(mask)), hidden
  if kind == "causal":
    opts, sees = dict(is_causal=True), i >= j
  else:
    opts, sees = dict(local_window_size=(6, 3)), (i - 6 <= j) & (j <= i + 3)
  hidden[b, sees, kh * G:(kh + 1) * G] = False
  return opts, hidden


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("kind", ["mask", "causal", "window"])
def test_hidden_nonfinite_key_reaches_no_gradient_of_rows_that_do_not_see_it(
    kind, value, rng, impl):
  q, k, v = tu.qkv(rng, B, T, S, N, K, H)
  d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  b, j, kh = POISONED
  poisoned = k.at[b, j, kh, 7].set(float(value))
  opts, hidden = _hiding(kind)
  out = np.asarray(jax.jit(functools.partial(fast_attention, implementation=impl, **opts))(
      q, poisoned, v))
  assert np.isfinite(out[hidden]).all(), "the forward of rows that do not see the key"
  dq, dk, dv = _grads(impl, q, poisoned, v, d_out, **opts)
  clean = _grads(impl, q, k, v, d_out, **opts)
  bad = ~np.isfinite(dq[hidden]).all(-1)
  assert not bad.any(), (
      f"dQ of {bad.sum()} rows that do not see the key is not finite, first at "
      f"{np.argwhere(hidden)[np.argmax(bad)]}")
  np.testing.assert_allclose(dq[hidden], clean[0][hidden], rtol=1e-5, atol=1e-6)
  if kind == "mask":  # no row sees it: every gradient is the clean one
    for what, g, c in (("dK", dk, clean[1]), ("dV", dv, clean[2])):
      assert np.isfinite(g).all(), what
      np.testing.assert_allclose(g, c, rtol=1e-5, atol=1e-6, err_msg=what)


# --- large logits: the backward's P is the forward's ----------------------------

@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("magnitude", [1e3, 1e4, 1e5])
@pytest.mark.parametrize("setting", ["window_0", "one_key", "causal", "few_rows", "cap_bias"])
def test_large_logits_single_visible_key(setting, magnitude, head_dim, rng, impl):
  """|scale q.k| ~ magnitude, at each kernel-90 head dim (its softmax builds
  differ by H). window_0: every row sees only its own key;
  one_key: key length 1; causal: row 0 sees key 0 only; few_rows: window_0
  with T = S = 3 and 2 query heads per key head (6 rows per key head: the
  decode paths, the CPU's with the head dim in the vector lanes, whose logits
  it sums in another order (tests/test_cpu_decode.py covers its other
  layout), and whose sm70/sm75 CUDA build the VJP's forward avoids); cap_bias:
  window_0 with a soft cap of the magnitude and a bias. On such a row P = 1,
  so its dQ is 0, and so is dK of a key that only such rows see; dV = dO."""
  T_ = 3 if setting == "few_rows" else 70
  q, k, v = tu.qkv(rng, 2, T_, T_, 2, 1, head_dim)
  d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  opts = dict(scale=magnitude / np.sqrt(head_dim))
  bias = None
  if setting == "cap_bias":
    opts["logits_soft_cap"] = magnitude
    bias = tu.random_bias(rng, (2, 2, T_, T_))
  if setting in ("window_0", "few_rows", "cap_bias"):
    opts["local_window_size"] = (0, 0)
  elif setting == "one_key":
    opts["key_value_seq_lengths"] = tu.lengths((1, 1))
  else:
    opts["is_causal"] = True
  ours = _grads(impl, q, k, v, d_out, bias, **opts)
  xla = _xla_grads(impl, q, k, v, d_out, bias, **opts)
  ref = tu.reference64_grads(q, k, v, d_out, bias, **opts)[:3]
  for what, g in zip(("dQ", "dK", "dV"), ours):
    assert np.isfinite(g).all(), what
  if setting == "causal":  # the other rows' P depend on the float32 rounding of huge logits
    row0 = np.zeros(q.shape, bool)
    row0[:, 0] = True
    _assert_rule(impl, ours[:1], xla[:1], ref[:1], "float32", where=[row0])
    return
  assert np.abs(ref[0]).max() < 1e-6 and np.abs(ref[1]).max() < 1e-6  # premise: 0 but rounding
  _assert_rule(impl, ours, xla, ref, "float32")


def test_single_key_gives_dk_of_zero(rng, impl):
  """S = 1 at ordinary logits: every row's P is 1, dS = 0, so dQ = dK = 0
  (the caller's D = dO . O and the kernel's dP = dO . V differ by rounding)."""
  q, k, v = tu.qkv(rng, 2, 97, 1, 4, 2, 64)
  d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  ours = _grads(impl, q, k, v, d_out)
  xla = _xla_grads(impl, q, k, v, d_out)
  ref = tu.reference64_grads(q, k, v, d_out)
  _assert_rule(impl, ours, xla, ref, "float32")


def test_gradient_through_the_lse_of_single_key_rows(rng, impl):
  """Where P = 1 the exact dS is dLSE (the internal entry, as decode_attention
  uses it): the rounding of dP - D to 0 at such entries must keep it."""
  config = attention.AttentionConfig(scale=0.125, has_kv_lens=True,
                                     implementation="auto" if impl is None else impl)
  q, k, v = tu.qkv(rng, 2, 45, 70, 4, 2, 64)
  kv_lens = tu.lengths((1, 1))
  d_out = rng.standard_normal(q.shape)
  d_lse = rng.standard_normal(q.shape[:-1])

  def loss(run, q, k, v):
    out, lse = run(q, k, v, None, None, None, kv_lens)
    return jnp.sum(out * d_out.astype(out.dtype)) + jnp.sum(lse * d_lse.astype(lse.dtype))

  ours = jax.jit(jax.grad(functools.partial(loss, functools.partial(
      attention.run_config, config)), argnums=(0, 1, 2)))(q, k, v)
  reference = functools.partial(attention.attention_reference, config)
  with tu.x64():
    grad = jax.jit(jax.grad(functools.partial(loss, reference), argnums=(0, 1, 2)))
    ref = grad(*(np.asarray(x, np.float64) for x in (q, k, v)))
    xla = grad(q, k, v)
  ref = [np.asarray(r) for r in ref]
  assert np.abs(ref[1][:, 0]).max() > 1  # premise: dK of key 0 is scale * sum_i dLSE_i q_i
  _assert_rule(impl, ours, xla, ref, "float32")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [16, 32, 64])
def test_flash_attention_overflow_float16(d, causal, impl):
  """FlashAttention's test_flash_attn_bwd_overflow (T = S = 2): float16 q * 5,
  k and v * 3, B = 2, N = 5; held to this suite's rule."""
  rng = np.random.default_rng(0)
  make = lambda scale: jnp.asarray(rng.standard_normal((2, 2, 5, d)) * scale, jnp.float16)
  q, k, v = make(5), make(3), make(3)
  d_out = make(1)
  opts = dict(is_causal=causal)
  ours = _grads(impl, q, k, v, d_out, **opts)
  xla = _xla_grads(impl, q, k, v, d_out, **opts)
  ref = tu.reference64_grads(q, k, v, d_out, **opts)
  _assert_rule(impl, ours, xla, ref, "float16")


# --- H = 0 -------------------------------------------------------------------

def _lse_by_definition(T, S, N, bias, mask, q_len, kv_len, causal):
  """log sum_{visible j} e^(bias_ij) in float64 (the logits are 0), -inf where
  no key is visible; bias (B, N, T, S) or None, mask (B, 1, T, S) or None."""
  B = len(q_len)
  lse = np.full((B, T, N), -np.inf)
  for b in range(B):
    for i in range(min(q_len[b], T)):
      for n in range(N):
        seen = np.arange(S) < kv_len[b]
        if causal:
          seen &= np.arange(S) <= i
        if mask is not None:
          seen &= mask[b, 0, i]
        x = np.zeros(S) if bias is None else np.asarray(bias, np.float64)[b, n, i]
        if seen.any():
          m = x[seen].max()
          lse[b, i, n] = m + np.log(np.exp(x[seen] - m).sum())
  return lse


@pytest.mark.parametrize("features", ["plain", "causal", "bias_mask_lengths"])
def test_head_dim_zero_lse(features, rng, impl):
  B_, T_, S_, N_, K_ = 2, 9, 13, 4, 2
  q = jnp.zeros((B_, T_, N_, 0), jnp.float32)
  k = jnp.zeros((B_, S_, K_, 0), jnp.float32)
  bias = mask = None
  q_len, kv_len = (T_, T_), (S_, S_)
  opts = {}  # the default scale, defined at H = 0 too
  if features == "causal":
    opts["is_causal"] = True
  elif features == "bias_mask_lengths":
    bias = tu.random_bias(rng, (B_, N_, T_, S_))
    mask = np.array(tu.random_mask(rng, (B_, 1, T_, S_), p_true=0.5))
    mask[0, 0, 3] = False  # a row that sees nothing
    q_len, kv_len = (7, 9), (13, 4)
    opts.update(query_seq_lengths=tu.lengths(q_len), key_value_seq_lengths=tu.lengths(kv_len))
  run = jax.jit(lambda q, k, bias, mask: fast_attention(
      q, k, k, bias, mask, return_residual=True, implementation=impl, **opts))
  mask = None if mask is None else jnp.asarray(mask)
  if impl in cuda.IMPLEMENTATIONS:  # no CUDA kernel takes H = 0; the default path is xla's
    with pytest.raises(ValueError, match="head dims 1 to 256, got H=0"):
      run(q, k, bias, mask)
    return
  out, lse = run(q, k, bias, mask)
  assert out.shape == q.shape
  expected = _lse_by_definition(T_, S_, N_, bias, mask, q_len, kv_len,
                                opts.get("is_causal", False))
  lse = np.asarray(lse, np.float64)
  assert np.array_equal(np.isneginf(lse), np.isneginf(expected)), (lse, expected)
  finite = np.isfinite(expected)
  np.testing.assert_allclose(lse[finite], expected[finite], rtol=1e-6, atol=1e-6)


# --- 16-bit gradients -----------------------------------------------------------

@pytest.mark.parametrize("scale", [1.0, 2.0])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16bit_gradients_with_large_logits(dtype, scale, rng, impl):
  """Logits of scale * q.k with H = 64 (standard deviation 8 and 16): a
  softmax near one-hot, where dS = P (dP - D) cancels and D must come from the
  unrounded out."""
  q, k, v = tu.qkv(rng, 1, 128, 128, 2, 1, 64, dtype=tu.DTYPES[dtype])
  d_out = jnp.asarray(rng.standard_normal(q.shape), tu.DTYPES[dtype])
  ours = _grads(impl, q, k, v, d_out, scale=scale)
  xla = _xla_grads(impl, q, k, v, d_out, scale=scale)
  ref = tu.reference64_grads(q, k, v, d_out, scale=scale)
  _assert_rule(impl, ours, xla, ref, dtype)


@pytest.mark.parametrize("shape", [(2, 70, 130, 4, 2, 64), (1, 1, 8192, 8, 8, 64)],
                         ids=["rows", "split_kv"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_forward_writes_float32_out_of_16bit_inputs(dtype, shape, rng, impl):
  """The kernel's float32 out (AttentionConfig.float32_out, which the VJP's
  forward sets) is the unrounded output: within half a 16-bit ulp of the 16-bit
  call's out, with its LSE (also where split-KV partials are combined: one query
  row, long keys). Not bit for bit: the two builds may compute the softmax's
  weights in different forms (kernel 90: by fma in the 16-bit build, exactly in
  the float32 one, which the backward needs), so each weight may differ by
  about 2^-21 relatively (the two ex2.approx results, 2^-22 each, and the
  arguments' roundings), and out = sum p v by 2^-20 (|out| + max |v|)."""
  path = resolve_implementation(impl, dtype=tu.DTYPES[dtype], head_dim=64)
  if path not in backends.FUSED_PATHS:
    pytest.skip(f"{path}: no kernel of ours")
  q, k, v = tu.qkv(rng, *shape, dtype=tu.DTYPES[dtype])
  causal = q.shape[1] > 1  # (one causal query row would see one key: out exact either way)
  config = attention.AttentionConfig(scale=0.125, is_causal=causal, implementation=path)
  out16, lse16 = jax.jit(functools.partial(backends.fused_call, path, config))(q, k, v)
  out32, lse32 = jax.jit(functools.partial(
      backends.fused_call, path, dataclasses.replace(config, float32_out=True)))(q, k, v)
  assert out16.dtype == q.dtype and out32.dtype == jnp.float32
  out16 = np.asarray(out16)
  up = np.nextafter(out16, np.array(np.inf, out16.dtype)).astype(np.float32)
  down = np.nextafter(out16, np.array(-np.inf, out16.dtype)).astype(np.float32)
  out16 = out16.astype(np.float32)
  half_ulp = 0.5 * np.maximum(up - out16, out16 - down)  # the wider side at a power of 2
  # + the weights' difference: sum p v moves by at most 2^-20 sum p |v - out|.
  v_max = float(np.max(np.abs(np.asarray(v, np.float32))))
  err = np.abs(np.asarray(out32) - out16) - half_ulp - 2.0**-20 * (np.abs(out16) + v_max)
  assert err.max() <= 0, (err.max(), np.unravel_index(err.argmax(), err.shape))
  np.testing.assert_allclose(np.asarray(lse32), np.asarray(lse16), rtol=1e-6, atol=1e-6)
  ref, _ = tu.reference64(q, k, v, scale=0.125, is_causal=causal)
  # Rounded to 16 bits the out loses half an ulp more (less on the CUDA paths, which also
  # round P to 16 bits for P V).
  assert tu.max_err(out32, ref) < 0.75 * tu.max_err(out16, ref)
