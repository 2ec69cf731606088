"""jit, vmap, grad, scan and checkpoint of ``fast_attention``."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import fa_testutil as tu
from fastattn_jax import backends, fast_attention, resolve_implementation
from fastattn_jax.attention import AttentionConfig

B, T, S, N, K, H = 2, 19, 23, 4, 2, 16
# Same computation, different batching/shapes: agreement up to float32
# reassociation only.
CLOSE = dict(rtol=2e-6, atol=2e-6)


@pytest.fixture
def qkv(rng):
  return tu.qkv(rng, B, T, S, N, K, H)


def test_jit_equals_eager_and_reference(qkv, rng, impl):
  q, k, v = qkv
  bias = tu.random_bias(rng, (1, N, T, S))
  opts = dict(is_causal=True, key_value_seq_lengths=tu.lengths([S, 9]))
  eager = fast_attention(q, k, v, bias, implementation=impl, **opts)
  jitted = jax.jit(lambda q, k, v, b: fast_attention(q, k, v, b, implementation=impl,
                                                     **opts))(q, k, v, bias)
  if resolve_implementation(impl) == "xla":  # XLA may fuse differently under jit
    np.testing.assert_allclose(eager, jitted, rtol=0, atol=1e-6)
  else:
    np.testing.assert_array_equal(eager, jitted)
  ref, _ = tu.reference64(q, k, v, bias, **opts)
  np.testing.assert_allclose(jitted, ref, atol=tu.ref_atol())


def test_jit_takes_fused_kernel_on_cpu(qkv, impl):
  if jax.default_backend() != "cpu" or impl not in (None, "cpu"):
    pytest.skip("the CPU kernel is the default path only on CPU")
  hlo = jax.jit(lambda q, k, v: fast_attention(q, k, v, implementation=impl)).lower(*qkv).as_text()
  assert "fastattn_attention_cpu" in hlo


# --- vmap ------------------------------------------------------------------------

def _loop(f, in_axes, args, size):
  """Reference for vmap: a Python loop over slices, stacked on axis 0."""
  outs = []
  for i in range(size):
    sl = [a if ax is None else jnp.take(a, i, axis=ax) for a, ax in zip(args, in_axes)]
    outs.append(f(*sl))
  return jax.tree.map(lambda *xs: jnp.stack(xs), *outs)


VMAP_CASES = {
    # name: (in_axes of (q, k, v, bias, q_lens, kv_lens), with_bias, with_lens)
    "qkv_axis0": ((0, 0, 0, None, None, None), False, False),
    "q_only": ((0, None, None, None, None, None), False, False),
    "kv_only": ((None, 0, 0, None, None, None), False, False),
    "mixed_positions": ((1, 0, 4, None, None, None), False, False),
    "bias_mapped": ((0, 0, 0, 0, None, None), True, False),
    "bias_unmapped": ((0, 0, 0, None, None, None), True, False),
    "bias_only_mapped": ((None, None, None, 2, None, None), True, False),
    "lengths_mapped": ((0, 0, 0, None, 0, 0), False, True),
    "all_mapped": ((0, 0, 0, 0, 0, 0), True, True),
}


@pytest.mark.parametrize("name", list(VMAP_CASES))
def test_vmap(name, rng, impl):
  in_axes, with_bias, with_lens = VMAP_CASES[name]
  V = 3
  shapes = [(B, T, N, H), (B, S, K, H), (B, S, K, H), (1, N, T, S), (B,), (B,)]
  args = []
  for shape, ax in zip(shapes, in_axes):
    if ax is not None:
      shape = shape[:ax] + (V,) + shape[ax:]
    if len(shape) == 1 or (len(shape) == 2 and shape[0] == V and ax == 0 and shape[1] == B):
      args.append(jnp.asarray(rng.integers(0, S + 1, shape), jnp.int32))
    else:
      args.append(jnp.asarray(rng.standard_normal(shape), jnp.float32))
  # Lengths: q lengths in [0, T], kv lengths in [0, S].
  if not with_bias:
    args[3] = None
  if not with_lens:
    args[4] = args[5] = None
  else:
    args[4] = jnp.minimum(args[4], T)
  in_axes = tuple(None if a is None else ax for a, ax in zip(args, in_axes))

  def f(q, k, v, bias, ql, kl):
    return fast_attention(q, k, v, bias, is_causal=True, query_seq_lengths=ql,
                          key_value_seq_lengths=kl, return_residual=True,
                          implementation=impl)

  out, lse = jax.vmap(f, in_axes=in_axes)(*args)
  ref_out, ref_lse = _loop(f, in_axes, args, V)
  np.testing.assert_allclose(out, ref_out, **CLOSE)
  np.testing.assert_allclose(lse, ref_lse, **CLOSE)
  assert np.isfinite(np.asarray(out)).all()
  # And the loop itself against the float64 reference, one slice.
  sl = [a if ax is None else jnp.take(a, 1, axis=ax) for a, ax in zip(args, in_axes)]
  r, _ = tu.reference64(*sl[:4], is_causal=True, query_seq_lengths=sl[4],
                        key_value_seq_lengths=sl[5])
  np.testing.assert_allclose(out[1], r, atol=tu.ref_atol())


def test_nested_vmap_and_mask(rng, impl):
  """vmap over two extra axes (3-D inputs inside), with a vmapped mask."""
  V1, V2 = 2, 3
  q = jnp.asarray(rng.standard_normal((V1, V2, T, N, H)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((V2, V1, S, K, H)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((V1, S, K, H)), jnp.float32)
  mask = tu.random_mask(rng, (V2, T, S))

  f = lambda q, k, v, m: fast_attention(q, k, v, mask=m, implementation=impl)
  inner = jax.vmap(f, in_axes=(0, 0, None, 0))        # over V2
  outer = jax.vmap(inner, in_axes=(0, 1, 0, None))    # over V1
  out = outer(q, k, v, mask)
  assert out.shape == (V1, V2, T, N, H)
  for a in range(V1):
    for c in range(V2):
      ref, _ = tu.reference64(q[a, c], k[c, a], v[a], mask=mask[c])
      np.testing.assert_allclose(out[a, c], ref, atol=tu.ref_atol())


# --- grad ---------------------------------------------------------------------

GRAD_OPTS = {
    "plain": dict(),
    "causal_window": dict(is_causal=True, local_window_size=(4, 0)),
    "softcap_scale": dict(logits_soft_cap=2.0, scale=0.4),
    "lengths": dict(query_seq_lengths=[T, 7], key_value_seq_lengths=[5, S]),
}


def _opts(name):
  return {k: (tu.lengths(v) if k.endswith("lengths") else v)
          for k, v in GRAD_OPTS[name].items()}


@pytest.mark.parametrize("name", list(GRAD_OPTS))
def test_check_grads_float64(name, rng, impl):
  """Float64 inputs go through the same custom_vjp (reference math both ways)."""
  if impl in backends.FUSED_PATHS:
    pytest.skip(f"implementation={impl!r} refuses float64 by design (test_errors checks it)")
  with tu.x64():
    q, k, v = tu.qkv(rng, 1, 6, 7, 2, 1, 8, jnp.float64)
    bias = jnp.asarray(rng.standard_normal((1, 2, 6, 7)), jnp.float64)
    opts = _opts(name)
    if "query_seq_lengths" in opts:
      opts = dict(query_seq_lengths=tu.lengths([4]), key_value_seq_lengths=tu.lengths([5]))
    f = lambda q, k, v, bias: fast_attention(q, k, v, bias, implementation=impl, **opts)
    assert f(q, k, v, bias).dtype == jnp.float64
    check_grads(f, (q, k, v, bias), order=1, modes=("rev",), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("extra", ["none", "bias_mask"])
@pytest.mark.parametrize("name", list(GRAD_OPTS))
def test_float64_grads_match_the_definition(name, extra, rng, impl):
  """float64 gradients (the reference VJP) against the backward written out
  in float64 (fa_testutil.reference64_grads) to 1e-10: dQ, dK, dV summed
  over a GQA group of 2, and dBias over its broadcast dims."""
  if impl in backends.FUSED_PATHS:
    pytest.skip(f"implementation={impl!r} refuses float64 by design (test_errors checks it)")
  opts = _opts(name)
  with tu.x64():
    q, k, v = tu.qkv(rng, B, T, S, N, K, H, jnp.float64)
    d_out = jnp.asarray(rng.standard_normal((B, T, N, H)))
    bias = mask = None
    if extra == "bias_mask":
      bias = jnp.asarray(rng.standard_normal((1, N, T, S)))
      mask = tu.random_mask(rng, (B, 1, T, S))
    f = lambda q, k, v, bias: fast_attention(q, k, v, bias, mask, implementation=impl, **opts)
    _, vjp = jax.vjp(f, q, k, v, bias)
    got = vjp(d_out)
  want = tu.reference64_grads(q, k, v, d_out, bias, mask, **opts)
  for name_, a, b in zip(("dq", "dk", "dv", "dbias"), got, want):
    if b is None:
      continue
    assert np.abs(b).max() > 0, name_
    np.testing.assert_allclose(np.asarray(a), b.reshape(np.shape(a)), rtol=0, atol=1e-10,
                               err_msg=name_)


@pytest.mark.parametrize("name", list(GRAD_OPTS))
def test_grads_with_lse_match_jax_nn(name, rng, impl):
  """A loss of both outputs: the LSE is returned under stop_gradient, as
  jax.nn returns it, so the gradients are jax.nn's (its XLA path, float64:
  both exact up to rounding; rows with no visible key are left out of the
  loss, since jax.nn's output there is the mean of the values; no soft cap,
  which jax.nn lacks)."""
  opts = {k_: v_ for k_, v_ in _opts(name).items() if k_ != "logits_soft_cap"}
  with tu.x64():
    q, k, v = tu.qkv(rng, B, T, S, N, K, H, jnp.float64)
    ct_out = jnp.asarray(rng.standard_normal((B, T, N, H)))
    ct_lse = jnp.asarray(rng.standard_normal((B, T, N)))
    impl64 = None if impl in backends.FUSED_PATHS else impl

    def loss(attend, q, k, v):
      out, lse = attend(q, k, v, return_residual=True, **opts)
      seen = jnp.isfinite(lse) & (lse > -1e30)  # jax.nn's empty rows: a huge negative LSE
      return (jnp.sum(jnp.where(seen[..., None], out, 0) * ct_out) +
              jnp.sum(jnp.where(seen, lse, 0) * ct_lse))

    ours = jax.grad(functools.partial(loss, functools.partial(
        fast_attention, implementation=impl64)), argnums=(0, 1, 2))(q, k, v)
    theirs = jax.grad(functools.partial(loss, functools.partial(
        jax.nn.dot_product_attention, implementation="xla")), argnums=(0, 1, 2))(q, k, v)
  for name_, a, b in zip("qkv", ours, theirs):
    assert np.abs(np.asarray(b)).max() > 0, name_
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"d/d{name_}")


@pytest.mark.parametrize("name", list(GRAD_OPTS))
def test_float32_grads_match_xla_path(name, rng, impl):
  """float32 gradients are XLA's to 1e-5 where the backward computes in
  float32 (the CPU kernel, the blockwise jax.numpy backward of the paths
  without a fused one)."""
  path = resolve_implementation(impl, dtype=jnp.float32, head_dim=H)
  if tu.computed_dtype(path, "float32") != "float32" and backends.choose_backward(
      path, AttentionConfig(scale=0.25, has_bias=True), (B, T, N, H), (B, S, K, H),
      jnp.float32)[0] == path:
    pytest.skip("this path's backward kernels multiply float32 in float16, as its forward "
                "does: test_backward holds them to XLA's gradients of inputs so rounded")
  q, k, v = tu.qkv(rng, B, T, S, N, K, H)
  bias = tu.random_bias(rng, (B, 1, T, S))
  opts = _opts(name)
  ct_out = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)

  def loss(implementation, q, k, v, bias):
    out = fast_attention(q, k, v, bias, implementation=implementation, **opts)
    return jnp.sum(out * ct_out)

  grads = jax.jit(jax.grad(functools.partial(loss, impl), argnums=(0, 1, 2, 3)))(q, k, v, bias)
  xla = jax.jit(jax.grad(functools.partial(loss, "xla"), argnums=(0, 1, 2, 3)))(q, k, v, bias)
  for name_, g, x in zip("qkvb", grads, xla):
    assert np.isfinite(np.asarray(g)).all(), name_
    assert np.abs(np.asarray(x)).max() > 0, name_
    np.testing.assert_allclose(g, x, rtol=1e-5, atol=1e-5, err_msg=f"d/d{name_}")
  # And the float32 grads against float64 grads of the reference math.
  with tu.x64():
    f64 = [jnp.asarray(np.asarray(a), jnp.float64) for a in (q, k, v, bias)]
    g64 = jax.grad(functools.partial(loss, "xla"), argnums=(0, 1, 2, 3))(*f64)
  for name_, g, x in zip("qkvb", grads, g64):
    np.testing.assert_allclose(g, np.asarray(x), rtol=1e-4, atol=1e-4, err_msg=f"d/d{name_}")


# --- scan, checkpoint -----------------------------------------------------------

def test_scan_over_layers(qkv, rng, impl):
  q, k, v = qkv
  wq = jnp.asarray(rng.standard_normal((3, H, H)) / np.sqrt(H), jnp.float32)

  def layer(x, w):
    y = fast_attention(jnp.einsum("btnh,hg->btng", x, w), k, v, is_causal=True,
                       implementation=impl)
    return y, jnp.sum(y)

  final, sums = jax.jit(lambda q: jax.lax.scan(layer, q, wq))(q)
  x, expected = q, []
  for i in range(3):
    x, s = layer(x, wq[i])
    expected.append(s)
  np.testing.assert_allclose(final, x, **CLOSE)
  np.testing.assert_allclose(sums, jnp.stack(expected), rtol=1e-5)
  # grad through scan
  g = jax.grad(lambda q: jnp.sum(jax.lax.scan(layer, q, wq)[0] ** 2))(q)
  g_xla = jax.grad(lambda q: jnp.sum(jax.lax.scan(
      lambda x, w: (fast_attention(jnp.einsum("btnh,hg->btng", x, w), k, v, is_causal=True,
                                   implementation="xla"), 0.0), q, wq)[0] ** 2))(q)
  np.testing.assert_allclose(g, g_xla, rtol=1e-4, atol=tu.ref_atol())


@pytest.mark.parametrize("policy", [None, "nothing_saveable", "everything_saveable"])
def test_checkpoint(qkv, rng, impl, policy):
  q, k, v = qkv
  bias = tu.random_bias(rng, (1, 1, T, S))
  f = lambda q, k, v, b: jnp.sum(jnp.sin(fast_attention(q, k, v, b, implementation=impl)))
  pol = None if policy is None else getattr(jax.checkpoint_policies, policy)
  g_ckpt = jax.jit(jax.grad(jax.checkpoint(f, policy=pol), argnums=(0, 1, 2, 3)))(q, k, v, bias)
  g = jax.jit(jax.grad(f, argnums=(0, 1, 2, 3)))(q, k, v, bias)
  for a, b in zip(g_ckpt, g):
    np.testing.assert_allclose(a, b, **CLOSE)


def test_vmap_of_grad_and_grad_of_vmap(qkv, impl):
  q, k, v = qkv
  f = lambda q, k, v: jnp.sum(fast_attention(q, k, v, is_causal=True, implementation=impl) ** 2)
  per_example = jax.vmap(jax.grad(f), in_axes=(0, 0, 0))(q, k, v)
  loop = jnp.stack([jax.grad(f)(q[i], k[i], v[i]) for i in range(B)])
  np.testing.assert_allclose(per_example, loop, **CLOSE)
  g = jax.grad(lambda q: jnp.sum(jax.vmap(f)(q, k, v)))(q)
  np.testing.assert_allclose(g, loop, **CLOSE)


def _grads(impl, q, k, v, bias, **opts):
  f = lambda q, k, v, b: jnp.sum(fast_attention(q, k, v, b, implementation=impl, **opts) ** 2)
  return jax.grad(f, argnums=(0, 1, 2, 3))(q, k, v, bias)


def test_disable_jit_runs_forward_and_gradient(qkv, rng, impl):
  """Under jax.disable_jit() (a debugging mode) the fused primitive still runs,
  as its own compiled call, with the jitted results."""
  q, k, v = qkv
  bias = tu.random_bias(rng, (1, N, T, S))
  opts = dict(is_causal=True, query_seq_lengths=tu.lengths([T, 7]))
  want_out = jax.jit(lambda *a: fast_attention(*a, implementation=impl, **opts))(q, k, v, bias)
  want = jax.jit(functools.partial(_grads, impl, **opts))(q, k, v, bias)
  with jax.disable_jit():
    out = fast_attention(q, k, v, bias, implementation=impl, **opts)
    got = _grads(impl, q, k, v, bias, **opts)
  np.testing.assert_allclose(out, want_out, **CLOSE)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["debug_nans", "debug_infs"])
def test_debug_modes_quiet_on_padding_rows(qkv, rng, impl, mode):
  """Rows that see no key (query padding, key length 0) give out 0, LSE -inf
  and zero gradients: neither debug mode reports a NaN or inf that the
  caller's values do not hold (dBias included)."""
  q, k, v = qkv
  bias = tu.random_bias(rng, (B, N, T, S))
  opts = dict(query_seq_lengths=tu.lengths([T, 5]), key_value_seq_lengths=tu.lengths([S, 0]))
  with getattr(jax, mode)(True):
    out = jax.jit(lambda *a: fast_attention(*a, implementation=impl, **opts))(q, k, v, bias)
    grads = jax.jit(functools.partial(_grads, impl, **opts))(q, k, v, bias)
  assert np.all(np.asarray(out)[1] == 0)
  for g in grads:
    assert np.isfinite(np.asarray(g)).all()
  assert np.all(np.asarray(grads[3])[1] == 0)  # batch 1 sees no key: no dBias


def test_grad_inside_shard_map(qkv, impl):
  """Data-parallel training: the gradient taken inside jax.shard_map (the
  custom VJP there), on a mesh of Auto axes, equals the unsharded one."""
  if len(jax.devices()) < 2:
    pytest.skip("needs 2 devices")
  from jax.sharding import PartitionSpec as P
  q, k, v = qkv
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
  f = lambda q, k, v: jnp.sum(fast_attention(q, k, v, is_causal=True, implementation=impl) ** 2)
  sharded = jax.jit(jax.shard_map(jax.grad(f, argnums=(0, 1, 2)), mesh=mesh,
                                  in_specs=P("data"), out_specs=P("data")))
  for a, b in zip(sharded(q, k, v), jax.jit(jax.grad(f, argnums=(0, 1, 2)))(q, k, v)):
    np.testing.assert_allclose(a, b, **CLOSE)
