"""Property tests: random valid shapes and options, fused path vs the float64
reference under the acceptance rule (fa_testutil.check_call)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import fa_testutil as tu
from fastattn_jax import fast_attention

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


@st.composite
def problems(draw, max_T=80, max_S=150, allow_three_d=True):
  B = draw(st.integers(1, 3))
  K = draw(st.integers(1, 3))
  N = K * draw(st.sampled_from([1, 2, 3]))
  T = draw(st.integers(1, max_T))
  S = draw(st.integers(1, max_S))
  H = draw(st.sampled_from([4, 8, 12, 20, 32, 40, 64]))
  dtype = draw(st.sampled_from(list(tu.DTYPES)))
  three_d = allow_three_d and B == 1 and draw(st.booleans())
  opts = {}
  opts["is_causal"] = draw(st.booleans())
  opts["local_window_size"] = draw(st.one_of(
      st.none(), st.integers(0, 40), st.tuples(st.integers(0, 40), st.integers(0, 40))))
  opts["logits_soft_cap"] = draw(st.one_of(st.none(), st.floats(0.5, 50.0)))
  opts["scale"] = draw(st.one_of(st.none(), st.floats(0.05, 0.6)))
  if not three_d and draw(st.booleans()):
    opts["query_seq_lengths"] = draw(st.lists(st.integers(0, T), min_size=B, max_size=B))
  if not three_d and draw(st.booleans()):
    opts["key_value_seq_lengths"] = draw(st.lists(st.integers(0, S), min_size=B, max_size=B))
  full = (B, N, T, S)
  broadcast = lambda: tuple(d if draw(st.booleans()) else 1 for d in full)
  bias_shape = draw(st.one_of(st.none(), st.builds(broadcast)))
  mask_shape = draw(st.one_of(st.none(), st.builds(broadcast)))
  if three_d:  # rank-3 operands: drop the batch dim of bias/mask sometimes
    bias_shape = bias_shape and bias_shape[draw(st.integers(0, 2)):]
    mask_shape = mask_shape and mask_shape[1:]
  seed = draw(st.integers(0, 2**31))
  return dict(B=B, T=T, S=S, N=N, K=K, H=H, dtype=dtype, three_d=three_d, opts=opts,
              bias_shape=bias_shape, mask_shape=mask_shape, seed=seed)


@pytest.mark.slow
@SETTINGS
@given(problems())
def test_fused_matches_float64_reference(p):
  rng = np.random.default_rng(p["seed"])
  dtype = tu.DTYPES[p["dtype"]]
  q, k, v = tu.qkv(rng, p["B"], p["T"], p["S"], p["N"], p["K"], p["H"], dtype,
                   batch=not p["three_d"])
  bias = None if p["bias_shape"] is None else tu.random_bias(rng, p["bias_shape"], dtype)
  mask = None if p["mask_shape"] is None else tu.random_mask(rng, p["mask_shape"])
  opts = {k_: (tu.lengths(v_) if k_.endswith("lengths") else v_)
          for k_, v_ in p["opts"].items()}
  tu.check_call(q, k, v, bias, mask, implementation=tu.IMPL, compare_jax_nn=False, **opts)


#: Examples of the gradient property per run (FASTATTN_PROPERTY_EXAMPLES: more on a GPU run).
GRAD_EXAMPLES = int(os.environ.get("FASTATTN_PROPERTY_EXAMPLES", "25"))


@st.composite
def gradient_problems(draw):
  """``problems`` with the gradients' edges: larger and tiny scales (16-bit D
  rounding grows with the scale), a single key (P = 1 exactly where it is
  visible), a key no query sees holding NaN or inf (hidden by causality or by
  the mask), rows that see no key (lengths 0, drawn by ``problems``)."""
  one_key = draw(st.booleans())
  p = draw(problems(max_T=48, max_S=1 if one_key else 64, allow_three_d=False))
  p["opts"]["scale"] = draw(st.sampled_from([None, 0.3, 1.0, 2.0, 1e-3]))
  p["poison"] = None if p["S"] < 2 else draw(st.sampled_from([None, "nan", "inf"]))
  return p


@pytest.mark.slow
@settings(SETTINGS, max_examples=GRAD_EXAMPLES)
@given(gradient_problems())
def test_gradients_match_float64_reference(p):
  """dQ, dK, dV (and dBias) of random calls against the float64 backward,
  by the FlashAttention rule of tests/test_backward.py: error at most twice
  the xla path's in the same dtype, plus a floor of a few ulps."""
  from test_backward import _floor
  rng = np.random.default_rng(p["seed"])
  name, dtype = p["dtype"], tu.DTYPES[p["dtype"]]
  T, S = p["T"], p["S"]
  q, k, v = tu.qkv(rng, p["B"], T, S, p["N"], p["K"], p["H"], dtype)
  d_out = jnp.asarray(rng.standard_normal(q.shape), dtype)
  bias = None if p["bias_shape"] is None else tu.random_bias(rng, p["bias_shape"], dtype)
  mask = None if p["mask_shape"] is None else tu.random_mask(rng, p["mask_shape"])
  opts = {k_: (tu.lengths(v_) if k_.endswith("lengths") else v_)
          for k_, v_ in p["opts"].items() if v_ is not None}
  if p["poison"]:  # key S-1, hidden from every row: by causality where T < S, else the mask
    if not (opts.get("is_causal") and T < S):
      mask = jnp.ones((1, 1, T, S), bool) if mask is None else jnp.broadcast_to(
          mask, mask.shape[:2] + (T, S))
      mask = mask.at[..., S - 1].set(False)
    k = k.at[:, S - 1, :, 0].set(jnp.nan if p["poison"] == "nan" else jnp.inf)
  clean_k = k.at[:, S - 1, :, 0].set(0) if p["poison"] else k

  def grads(impl, q, k, v, d_out, bias):
    def loss(q, k, v, bias):
      out = fast_attention(q, k, v, bias, mask, implementation=impl, **opts)
      return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32))
    argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
    return jax.jit(jax.grad(loss, argnums=argnums))(q, k, v, bias)

  ours = grads(tu.IMPL, q, k, v, d_out, bias)
  computed = tu.DTYPES[tu.computed_dtype(tu.IMPL, name)]
  xla = grads("xla", *(None if x is None else x.astype(computed)
                       for x in (q, clean_k, v, d_out, bias)))
  ref = tu.reference64_grads(q, clean_k, v, d_out, bias, mask, **opts)
  for what, g, x, r, like in zip(("dQ", "dK", "dV", "dBias"), ours, xla, ref, (q, k, v, bias)):
    assert g.shape == like.shape and g.dtype == like.dtype, (what, g.shape, g.dtype)
    g, x, r = (np.asarray(a, np.float64).reshape(like.shape) for a in (g, x, r))
    if what == "dK" and p["poison"]:  # the poisoned key's own gradient: not compared
      g, x, r = g[:, :S - 1], x[:, :S - 1], r[:, :S - 1]
    err, err_xla = tu.max_err(g, r), tu.max_err(x, r)
    floor = _floor(tu.IMPL, name) * max(float(np.abs(r).max()), 1.0)
    assert err <= 2 * err_xla + floor, (
        f"{what}: max|ours - ref64| = {err:.3g} > 2 * max|xla - ref64| ({err_xla:.3g}) "
        f"+ {floor:.3g}")
