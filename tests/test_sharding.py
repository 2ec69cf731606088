"""Inputs sharded along batch and/or heads on a (2, 2) mesh of host CPUs
(conftest sets --xla_force_host_platform_device_count=4): the kernel runs
shard by shard (no all-gather / all-to-all in the compiled HLO), the output
keeps the inputs' sharding and equals the unsharded result."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fa_testutil as tu
from fastattn_jax import fast_attention

B, T, S, N, H = 4, 24, 40, 4, 16
COLLECTIVES = ("all-gather", "all-to-all", "all-reduce", "collective-permute")


@pytest.fixture(scope="module", params=["explicit", "auto"])
def mesh(request):
  if len(jax.devices()) < 4:
    pytest.skip(f"needs 4 devices, have {jax.devices()!r}")
  kind = {"explicit": jax.sharding.AxisType.Explicit, "auto": jax.sharding.AxisType.Auto}
  return jax.make_mesh((2, 2), ("data", "model"), devices=jax.devices()[:4],
                       axis_types=(kind[request.param],) * 2)


SPECS = {
    "batch": P("data", None, None, None),
    "heads": P(None, None, "model", None),
    "batch_and_heads": P("data", None, "model", None),
}
EXTRAS = {
    "none": {},
    "bias_full": {"bias": (B, N, T, S)},
    "bias_broadcast": {"bias": (1, N, 1, S)},
    "mask_batch": {"mask": (B, 1, T, S)},
    "lengths_causal": {"lengths": True, "is_causal": True},
    "everything": {"bias": (B, 1, T, S), "mask": (1, N, T, S), "lengths": True,
                   "local_window_size": (6, 2), "logits_soft_cap": 3.0},
}


def _operand_spec(spec, shape):
  """The bias/mask spec that follows q's: batch on dim 0, heads on dim 1."""
  b, _, n, _ = spec
  return P(b if shape[0] == B else None, n if shape[1] == N else None, None, None)


def _setup(mesh, spec, extra, K, rng):
  q, k, v = tu.qkv(rng, B, T, S, N, K, H)
  bias = mask = None
  kw = {}
  if "bias" in extra:
    bias = tu.random_bias(rng, extra["bias"])
  if "mask" in extra:
    mask = tu.random_mask(rng, extra["mask"])
  if extra.get("lengths"):
    kw["query_seq_lengths"] = tu.lengths([T, 5, 0, 17])
    kw["key_value_seq_lengths"] = tu.lengths([S, 33, 9, 1])
  kw.update({k_: v_ for k_, v_ in extra.items() if k_ not in ("bias", "mask", "lengths")})
  put = lambda x, s: None if x is None else jax.device_put(x, NamedSharding(mesh, s))
  sharded = dict(q=put(q, spec), k=put(k, spec), v=put(v, spec),
                 bias=put(bias, None if bias is None else _operand_spec(spec, bias.shape)),
                 mask=put(mask, None if mask is None else _operand_spec(spec, mask.shape)))
  for name in ("query_seq_lengths", "key_value_seq_lengths"):
    if name in kw:
      kw[name] = put(kw[name], P(spec[0]))
  plain = dict(q=q, k=k, v=v, bias=bias, mask=mask)
  return sharded, plain, kw


@pytest.mark.parametrize("K", [N, 2])
@pytest.mark.parametrize("extra", list(EXTRAS))
@pytest.mark.parametrize("spec_name", list(SPECS))
def test_sharded_forward(mesh, spec_name, extra, K, rng, impl):
  spec = SPECS[spec_name]
  sharded, plain, kw = _setup(mesh, spec, EXTRAS[extra], K, rng)
  lens = {k_: v_ for k_, v_ in kw.items() if k_.endswith("lengths")}
  static = {k_: v_ for k_, v_ in kw.items() if k_ not in lens}

  def f(q, k, v, bias, mask, lens):
    return fast_attention(q, k, v, bias, mask, return_residual=True,
                          implementation=impl, **lens, **static)

  jitted = jax.jit(f)
  args = (sharded["q"], sharded["k"], sharded["v"], sharded["bias"], sharded["mask"], lens)
  hlo = jitted.lower(*args).compile().as_text()
  for name in COLLECTIVES:
    assert name not in hlo, f"{name} in the compiled HLO of a {spec_name}-sharded call"
  out, lse = jitted(*args)
  expected = NamedSharding(mesh, spec)
  assert out.sharding.is_equivalent_to(expected, 4), (out.sharding, expected)
  assert lse.sharding.is_equivalent_to(NamedSharding(mesh, P(*spec[:3])), 3), lse.sharding
  plain_lens = {k_: np.asarray(v_) for k_, v_ in lens.items()}
  ref_out, ref_lse = jax.jit(f)(plain["q"], plain["k"], plain["v"], plain["bias"],
                                plain["mask"], plain_lens)
  np.testing.assert_allclose(out, ref_out, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(lse, ref_lse, rtol=1e-6, atol=1e-6)
  r64, _ = tu.reference64(plain["q"], plain["k"], plain["v"], plain["bias"], plain["mask"],
                          **plain_lens, **static)
  # Paths that multiply float32 inputs in 16 bits are held to that dtype's error.
  computed = tu.computed_dtype(impl, tu.dtype_name(plain["q"]))
  np.testing.assert_allclose(out, r64, atol=1e-5 if computed == "float32"
                             else 2 * tu.XLA_MAX_ERR[computed])


def test_sharded_k_not_divisible_falls_back_correctly(mesh, rng, impl):
  """K = 1 (MQA): query heads sharded, key/value heads cannot be: correct."""
  sharded, plain, _ = _setup(mesh, SPECS["batch"], {}, 1, rng)
  q = jax.device_put(plain["q"], NamedSharding(mesh, SPECS["batch_and_heads"]))
  f = jax.jit(lambda q, k, v: fast_attention(q, k, v, implementation=impl))
  out = f(q, sharded["k"], sharded["v"])
  np.testing.assert_allclose(out, f(plain["q"], plain["k"], plain["v"]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("spec_name", ["batch", "batch_and_heads"])
def test_grad_under_sharding(mesh, spec_name, rng, impl):
  spec = SPECS[spec_name]
  sharded, plain, _ = _setup(mesh, spec, {"bias": (B, N, T, S)}, 2, rng)

  def loss(q, k, v, bias):
    return jnp.sum(jnp.sin(fast_attention(q, k, v, bias, is_causal=True, implementation=impl)))

  g = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
  got = g(sharded["q"], sharded["k"], sharded["v"], sharded["bias"])
  want = g(plain["q"], plain["k"], plain["v"], plain["bias"])
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_grad_inside_shard_map(mesh, rng, impl):
  """jax.grad of a data-parallel loss whose shards call fast_attention
  inside jax.shard_map: the outputs vary over the manual axis as their
  inputs do, so the custom VJP's cotangents carry that axis."""
  sharded, plain, _ = _setup(mesh, SPECS["batch"], {}, 2, rng)

  def shard_loss(q, k, v):
    out, lse = fast_attention(q, k, v, is_causal=True, return_residual=True,
                              implementation=impl)
    return jax.lax.psum(jnp.sum(jnp.sin(out)) + jnp.sum(lse), "data")

  spec = P("data")
  loss = jax.shard_map(shard_loss, mesh=mesh, in_specs=(spec,) * 3, out_specs=P())
  with jax.set_mesh(mesh):
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(sharded["q"], sharded["k"], sharded["v"])
  want = jax.grad(lambda q, k, v: jnp.sum(jnp.sin(fast_attention(
      q, k, v, is_causal=True, implementation=impl))), argnums=(0, 1, 2))(
          plain["q"], plain["k"], plain["v"])
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_sequence_sharding_is_gathered(mesh, rng, impl):
  """Control: the kernel needs whole sequences, so a T-sharded query is
  gathered; the HLO check above does see collectives when there are some."""
  q, k, v = tu.qkv(rng, B, T, S, N, N, H)
  q_s = jax.device_put(q, NamedSharding(mesh, P(None, "data", None, None)))
  f = jax.jit(lambda q, k, v: fast_attention(q, k, v, implementation=impl))
  hlo = f.lower(q_s, k, v).compile().as_text()
  assert any(name in hlo for name in COLLECTIVES)
  np.testing.assert_allclose(f(q_s, k, v), f(q, k, v), rtol=1e-6, atol=1e-6)
