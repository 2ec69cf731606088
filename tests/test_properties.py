"""Property tests: random valid shapes and options, fused path vs the float64
reference under the acceptance rule (fa_testutil.check_call)."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import fa_testutil as tu

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


@st.composite
def problems(draw):
  B = draw(st.integers(1, 3))
  K = draw(st.integers(1, 3))
  N = K * draw(st.sampled_from([1, 2, 3]))
  T = draw(st.integers(1, 80))
  S = draw(st.integers(1, 150))
  H = draw(st.sampled_from([4, 8, 12, 20, 32, 40, 64]))
  dtype = draw(st.sampled_from(list(tu.DTYPES)))
  three_d = B == 1 and draw(st.booleans())
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
