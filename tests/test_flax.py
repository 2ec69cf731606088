"""``fastattn_jax.flax.attention_fn`` in Flax's attention layers, against Flax's
default attention.

linen's ``MultiHeadDotProductAttention`` and NNX's ``MultiHeadAttention``
(grouped-query: 4 query heads over 2 key/value heads) with a causal mask, a
padding mask and no mask; the documented fast paths (causal, lengths); the
keywords it refuses. The rule, per array (the output, then the gradient of
sum(out * random cotangent) w.r.t. every parameter and input), is the
suite's: Flax's default attention in float64 is the reference and

  max|ours - ref64| <= 2 * max|flax_default_float32 - ref64| + floor,

floor = OUT_ATOL["float32"] for the output and, for a gradient, GRAD_ATOL
times the largest reference gradient (that of the key projection's bias is 0
but for rounding: softmax ignores a logit shift shared by all keys).
"""

import functools
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa_testutil as tu

pytest.importorskip("flax", reason="Flax is a test extra: pip install 'fastattn-jax[flax]'")
from flax import linen as nn, nnx  # noqa: E402

import fastattn_jax.flax as fa_flax  # noqa: E402
from fastattn_jax.flax import attention_fn  # noqa: E402

#: As tests/test_backward.py's float32 floor: a few ulps of the largest gradient.
GRAD_ATOL = 2e-6

B, T, D, N = 2, 72, 64, 4


def _inputs(rng, batch=(B,)):
  return jnp.asarray(rng.standard_normal(batch + (T, D)), jnp.float32)


def _lengths(batch):
  """Per-example lengths of the batch dims' shape: one full, one of 5."""
  return jnp.asarray(np.resize([T, 30, 5, 51], batch), jnp.int32)


def _padding_mask(lengths):
  valid = jnp.arange(T) < lengths[..., None]
  return nn.make_attention_mask(valid, valid)


def _linen(fn, layer_kw=(), **call):
  """apply(params, x) of a linen layer whose attention is ``fn``."""
  layer = nn.MultiHeadDotProductAttention(num_heads=N, attention_fn=fn, **dict(layer_kw))
  return lambda p, x: layer.apply(p, x, **call)


def _nnx_layer(fn, **kw):
  return nnx.MultiHeadAttention(num_heads=N, in_features=D, num_kv_heads=2, decode=False,
                                attention_fn=fn, rngs=nnx.Rngs(0), **kw)


def _nnx(fn, layer_kw=(), **call):
  """apply(state, x) of an NNX layer (GQA) whose attention is ``fn``."""
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: _nnx_layer(fn, **dict(layer_kw))))
  return lambda s, x: nnx.merge(graphdef, s)(x, **call)


@functools.cache
def _params(api):
  """The parameters every layer of ``api`` shares: they depend on neither
  attention_fn nor the batch dims."""
  if api == "linen":
    return jax.jit(nn.MultiHeadDotProductAttention(num_heads=N).init)(
        jax.random.key(0), jax.ShapeDtypeStruct((1, T, D), jnp.float32))
  return nnx.state(_nnx_layer(nnx.dot_product_attention))


#: Each API's layer, and its default attention_fn.
LAYERS = {"linen": (_linen, nn.dot_product_attention), "nnx": (_nnx, nnx.dot_product_attention)}


@functools.partial(jax.jit, static_argnums=0)
def _out_and_grads(apply, params, x, ct):
  out, vjp = jax.vjp(apply, params, x)
  return out, vjp(ct)


def check_matches_flax(applies, apply_flax, params, x, rng):
  """The suite's rule on the output and every gradient (w.r.t. params and x)
  of each of ``applies`` (name -> apply(params, x)) against ``apply_flax``
  (Flax's default attention), float32 inputs."""
  out_shape = jax.eval_shape(apply_flax, params, x).shape
  ct = jnp.asarray(rng.standard_normal(out_shape), jnp.float32)
  flax_same = _out_and_grads(apply_flax, params, x, ct)
  with tu.x64():
    to64 = lambda tree: jax.tree.map(
        lambda a: a.astype(jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)
    ref = jax.tree.map(np.asarray, _out_and_grads(apply_flax, to64(params), to64(x), to64(ct)))
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(ref)]
  assert len(paths) > 2, paths  # the output, the input's gradient and the parameters'
  grad_floor = GRAD_ATOL * max(np.abs(r).max() for r in jax.tree.leaves(ref[1]))
  for variant, apply in applies.items():
    ours = _out_and_grads(apply, params, x, ct)
    for what, a, f, r in zip(paths, *map(jax.tree.leaves, (ours, flax_same, ref)), strict=True):
      assert a.shape == r.shape and a.dtype == jnp.float32, (variant, what, a.shape, a.dtype)
      floor = tu.OUT_ATOL["float32"] if what == "[0]" else grad_floor
      err, err_flax = tu.max_err(a, r), tu.max_err(f, r)
      assert err <= 2 * err_flax + floor, (
          f"{variant} {what}: max|ours - ref64| = {err:.3g} > 2 * max|flax - ref64| "
          f"({err_flax:.3g}) + {floor:.3g}")


class _PaddedSelfAttention(nn.Module):
  """linen's length path: the layer built inside the compact call that has the lengths."""

  @nn.compact
  def __call__(self, x, lengths):
    fn = functools.partial(attention_fn, query_seq_lengths=lengths,
                           key_value_seq_lengths=lengths)
    return nn.MultiHeadDotProductAttention(num_heads=N, attention_fn=fn, name="attention")(x)


def _length_path(api, lengths):
  """apply(params, x) of the module docstring's padding fast path, with the
  parameters of a plain layer: linen builds the layer where the lengths are,
  NNX calls attention_fn between the layer's own projections."""
  if api == "linen":
    return lambda p, x: _PaddedSelfAttention().apply({"params": {"attention": p["params"]}},
                                                     x, lengths)
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: _nnx_layer(attention_fn)))

  def apply(state, x):
    m = nnx.merge(graphdef, state)
    return m.out(attention_fn(m.query(x), m.key(x), m.value(x), query_seq_lengths=lengths,
                              key_value_seq_lengths=lengths))
  return apply


def _case(api, masking, rng):
  """x, params, Flax's default attention and the adapter's ways for ``masking``
  (name -> apply(params, x)): Flax's own float32 0/1 mask (the padding case
  with two batch dims), and the module docstring's fast path without it; with
  no mask, evaluation (deterministic=True) of a layer with dropout."""
  batch = (2, 2) if masking == "padding" else (B,)
  x = _inputs(rng, batch)
  mask = {"causal": nn.make_causal_mask(jnp.ones(batch + (T,))),
          "padding": _padding_mask(_lengths(batch)), "none": None}[masking]
  assert mask is None or mask.dtype == jnp.float32
  layer, default = LAYERS[api]
  ours = {"mask": layer(attention_fn, mask=mask)}
  if masking == "causal" and api == "linen":
    ours["is_causal"] = layer(functools.partial(attention_fn, is_causal=True))
  elif masking == "causal":
    ours["is_causal"] = layer(attention_fn, is_causal=True)
  elif masking == "padding":
    ours["lengths"] = _length_path(api, _lengths(batch))
  else:
    dropout = {"dropout_rate": 0.1, **({"keep_rngs": False} if api == "nnx" else {})}
    ours["evaluation"] = layer(attention_fn, dropout, deterministic=True)
  return x, _params(api), layer(default, mask=mask), ours


@pytest.mark.parametrize("api", LAYERS)
@pytest.mark.parametrize("masking", ["causal", "padding", "none"])
def test_layer_matches_flax_default_attention(api, masking, rng):
  """Padded query rows see no key and give the mean of the values, as Flax's do."""
  x, params, apply_flax, ours = _case(api, masking, rng)
  check_matches_flax(ours, apply_flax, params, x, rng)


@pytest.fixture
def calls(monkeypatch):
  """The arguments of every ``fast_attention`` call the adapter makes, by name."""
  seen, original = [], fa_flax.fast_attention

  def spy(q, k, v, bias, mask, **kwargs):
    seen.append(dict(kwargs, bias=bias, mask=mask))
    return original(q, k, v, bias, mask, **kwargs)

  monkeypatch.setattr(fa_flax, "fast_attention", spy)
  return seen


@pytest.mark.parametrize("api", LAYERS)
@pytest.mark.parametrize("masking, fast", [("causal", "is_causal"), ("padding", "lengths")])
def test_fast_paths_reach_fast_attention_without_a_mask(api, masking, fast, rng, calls):
  """The documented fast paths tell fast_attention by index (is_causal, or
  lengths folded to the 4 examples), never by a mask it would read whole."""
  x, params, _, ours = _case(api, masking, rng)
  jax.eval_shape(ours[fast], params, x)
  assert len(calls) == 1 and calls[0]["mask"] is None, calls
  if fast == "is_causal":
    assert calls[0]["is_causal"] is True, calls
  else:
    assert all(calls[0][k].shape == (4,)
               for k in ("query_seq_lengths", "key_value_seq_lengths")), calls


@pytest.mark.parametrize("api", LAYERS)
def test_dropout_in_training_raises(api, rng):
  """A nonzero dropout rate in training: NotImplementedError naming it (its
  evaluation runs: test_layer_matches_flax_default_attention[none])."""
  x = _inputs(rng)
  if api == "linen":
    train = lambda: nn.MultiHeadDotProductAttention(
        num_heads=N, attention_fn=attention_fn, dropout_rate=0.1).init(
            {"params": jax.random.key(0), "dropout": jax.random.key(1)}, x, deterministic=False)
  else:
    train = lambda: _nnx_layer(attention_fn, dropout_rate=0.1)(x, deterministic=False)
  with pytest.raises(NotImplementedError, match=r"dropout_rate=0\.1 with deterministic=False"):
    train()


def test_direct_call_with_bias_and_float_mask(rng):
  """As flax.linen.dot_product_attention called directly: three batch dims,
  a float 0/1 mask broadcast over two of them, a differentiated bias
  broadcast over all."""
  batch, S, H = (2, 1, 3), 40, 16
  q = jnp.asarray(rng.standard_normal(batch + (T, N, H)), jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal(batch + (S, N, H)), jnp.float32) for _ in "kv")
  mask = jnp.asarray(rng.random((2, 1, 1, 1, T, S)) < 0.8, jnp.float32)
  call = lambda fn: (lambda bias, qkv: fn(*qkv, bias=bias, mask=mask))
  bias = jnp.asarray(rng.standard_normal((N, T, S)), jnp.float32)
  check_matches_flax({"direct": call(attention_fn)}, call(nn.dot_product_attention), bias,
                     (q, k, v), rng)


def test_segment_ids_match_a_segment_mask(rng):
  """Packed sequences over two batch dims: ``segment_ids`` give Flax's
  default attention under the mask of equal ids, a row whose id no key has
  (cross-attention) the mean of the values as there."""
  batch, S, H = (2, 3), 40, 16
  q = jnp.asarray(rng.standard_normal(batch + (T, N, H)), jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal(batch + (S, N, H)), jnp.float32) for _ in "kv")
  q_ids = jnp.asarray(np.sort(rng.integers(0, 4, batch + (T,)), axis=-1), jnp.int32)
  kv_ids = jnp.asarray(np.sort(rng.integers(0, 3, batch + (S,)), axis=-1), jnp.int32)
  mask = nn.make_attention_mask(q_ids, kv_ids, pairwise_fn=jnp.equal)
  ours = lambda bias, qkv: attention_fn(*qkv, bias=bias, segment_ids=(q_ids, kv_ids))
  flax = lambda bias, qkv: nn.dot_product_attention(*qkv, bias=bias, mask=mask)
  bias = jnp.asarray(rng.standard_normal((N, T, S)), jnp.float32)
  check_matches_flax({"segment_ids": ours}, flax, bias, (q, k, v), rng)


def test_dtype_casts_the_computation(rng):
  """Flax's ``dtype``: the inputs cast to it, the output in it; None keeps
  the inputs' promoted dtype. No batch dims."""
  q, k, v = (jnp.asarray(rng.standard_normal((T, N, 16)), jnp.float32) for _ in "qkv")
  mask = nn.make_causal_mask(jnp.ones(T))[0]
  out = attention_fn(q, k, v, mask=mask, dtype=jnp.bfloat16)
  assert out.dtype == jnp.bfloat16 and out.shape == q.shape
  cast = [x.astype(jnp.bfloat16) for x in (q, k, v)]
  np.testing.assert_array_equal(out, attention_fn(*cast, mask=mask))
  assert attention_fn(cast[0], k, v, mask=mask).dtype == jnp.float32


def test_refuses_what_it_cannot_honour(rng):
  """sow_weights (Flax passes module=) and linen's replacement einsums raise,
  naming them, rather than being dropped."""
  x = _inputs(rng)
  with pytest.raises(NotImplementedError, match="sow_weights"):
    _nnx_layer(attention_fn)(x, sow_weights=True)
  layer = nn.MultiHeadDotProductAttention(num_heads=N, attention_fn=attention_fn)
  params = layer.init(jax.random.key(0), x)
  with pytest.raises(NotImplementedError, match="sow_weights"):
    layer.apply(params, x, sow_weights=True, mutable=["intermediates"])
  einsums = layer.clone(qk_attn_weights_einsum_cls=lambda: jnp.einsum,
                        attn_weights_value_einsum_cls=lambda: jnp.einsum)
  with pytest.raises(NotImplementedError, match="qk_attn_weights_einsum"):
    einsums.apply(params, x)


@pytest.mark.parametrize("args, match", [
    (dict(key=(3, T, N, 8)), r"same batch dims.*\(2, 72, 4, 8\).*\(3, 72, 4, 8\)"),
    # Same number of examples, other batch dims: folding alone would not notice.
    (dict(query=(2, 3, T, N, 8), key=(3, 2, T, N, 8), value=(3, 2, T, N, 8)),
     r"same batch dims"),
    (dict(mask=(3, 1, T, T)), r"mask of shape \(3, 1, 72, 72\).*batch dims \(2,\)"),
    (dict(bias=(1, 2, 1, 1, T, T)), r"bias of shape \(1, 2, 1, 1, 72, 72\)"),
    (dict(key_value_seq_lengths=(4,)), r"key_value_seq_lengths.*\(2,\), got \(4,\)"),
])
def test_bad_shapes_raise_naming_them(args, match, rng):
  shapes = dict(query=(2, T, N, 8), key=(2, T, N, 8), value=(2, T, N, 8))
  shapes.update(args)
  arrays = {name: (jnp.full(shape, 3, jnp.int32) if name.endswith("lengths") else
                   jnp.asarray(rng.standard_normal(shape), jnp.float32))
            for name, shape in shapes.items()}
  with pytest.raises(ValueError, match=match):
    attention_fn(arrays.pop("query"), arrays.pop("key"), arrays.pop("value"), **arrays)


def test_traced_dropout_rate_raises_naming_it(rng):
  q = jnp.asarray(rng.standard_normal((2, T, N, 8)), jnp.float32)
  with pytest.raises(TypeError, match="static dropout_rate"):
    jax.jit(lambda q, rate: attention_fn(q, q, q, dropout_rate=rate))(q, 0.1)


def test_importing_the_adapter_does_not_import_flax():
  code = ("import sys, fastattn_jax, fastattn_jax.flax; "
          "print(sorted(m for m in ('flax', 'equinox') if m in sys.modules))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=tu.fresh_process_env(), check=True).stdout
  assert out.strip() == "[]", out
