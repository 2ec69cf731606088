"""Bad inputs: each raises ValueError/TypeError at trace time, naming the
argument and showing the offending shapes/values, eagerly and under jit."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa_testutil as tu
from fastattn_jax import fast_attention, resolve_implementation

B, T, S, N, K, H = 2, 5, 6, 4, 2, 8


def sds(shape, dtype=jnp.float32):
  return jax.ShapeDtypeStruct(shape, dtype)


Q, KV = (B, T, N, H), (B, S, K, H)

# name -> (args, kwargs, exception, regexes the message must match). Args are
# ShapeDtypeStructs; concrete arrays of the same shapes are made per test.
CASES = {
    "query_rank": ((sds((T, H)), sds(KV), sds(KV)), {}, ValueError,
                   [r"query", r"\(5, 8\)"]),
    "query_rank_5": ((sds((1, *Q)), sds(KV), sds(KV)), {}, ValueError,
                     [r"query", r"\(1, 2, 5, 4, 8\)"]),
    "key_rank": ((sds(Q), sds((S, H)), sds(KV)), {}, ValueError,
                 [r"key", r"\(6, 8\)"]),
    "value_shape": ((sds(Q), sds(KV), sds((B, S + 1, K, H))), {}, ValueError,
                    [r"value", r"\(2, 6, 2, 8\)", r"\(2, 7, 2, 8\)"]),
    "n_not_multiple_of_k": ((sds((B, T, 3, H)), sds(KV), sds(KV)), {}, ValueError,
                            [r"heads", r"N=3", r"K=2"]),
    "batch_mismatch": ((sds((3, T, N, H)), sds(KV), sds(KV)), {}, ValueError,
                       [r"B", r"\(3, 5, 4, 8\)", r"\(2, 6, 2, 8\)"]),
    "head_dim_mismatch": ((sds((B, T, N, 16)), sds(KV), sds(KV)), {}, ValueError,
                          [r"H", r"\(2, 5, 4, 16\)", r"\(2, 6, 2, 8\)"]),
    "dtype_mismatch": ((sds(Q), sds(KV, jnp.bfloat16), sds(KV)), {}, TypeError,
                       [r"dtype", r"bfloat16", r"float32"]),
    "int_inputs": ((sds(Q, jnp.int32), sds(KV, jnp.int32), sds(KV, jnp.int32)), {},
                   TypeError, [r"float", r"int32"]),
    "bias_not_broadcastable": ((sds(Q), sds(KV), sds(KV), sds((B, N, T, S + 1))), {},
                               ValueError, [r"bias", r"\(2, 4, 5, 7\)", r"\(2, 4, 5, 6\)"]),
    "bias_wrong_batch": ((sds(Q), sds(KV), sds(KV), sds((3, 1, 1, S))), {},
                         ValueError, [r"bias", r"\(3, 1, 1, 6\)"]),
    "bias_rank_5": ((sds(Q), sds(KV), sds(KV), sds((1, B, N, T, S))), {},
                    ValueError, [r"bias", r"\(1, 2, 4, 5, 6\)"]),
    "bias_int": ((sds(Q), sds(KV), sds(KV), sds((T, S), jnp.int32)), {},
                 TypeError, [r"bias", r"int32"]),
    "mask_not_broadcastable": ((sds(Q), sds(KV), sds(KV), None, sds((T, T), bool)), {},
                               ValueError, [r"mask", r"\(1, 1, 5, 5\)", r"\(2, 4, 5, 6\)"]),
    "mask_not_bool": ((sds(Q), sds(KV), sds(KV), None, sds((T, S), jnp.float32)), {},
                      TypeError, [r"mask", r"bool", r"float32"]),
    "mask_int": ((sds(Q), sds(KV), sds(KV), None, sds((T, S), jnp.int32)), {},
                 TypeError, [r"mask", r"bool", r"int32"]),
    "q_lengths_shape": ((sds(Q), sds(KV), sds(KV)),
                        dict(query_seq_lengths=sds((B, 1), jnp.int32)), ValueError,
                        [r"query_seq_lengths", r"\(2,\)", r"\(2, 1\)"]),
    "kv_lengths_shape": ((sds(Q), sds(KV), sds(KV)),
                         dict(key_value_seq_lengths=sds((B + 1,), jnp.int32)), ValueError,
                         [r"key_value_seq_lengths", r"\(2,\)", r"\(3,\)"]),
    "q_lengths_float": ((sds(Q), sds(KV), sds(KV)),
                        dict(query_seq_lengths=sds((B,), jnp.float32)), TypeError,
                        [r"query_seq_lengths", r"float32"]),
    "kv_lengths_bool": ((sds(Q), sds(KV), sds(KV)),
                        dict(key_value_seq_lengths=sds((B,), bool)), TypeError,
                        [r"key_value_seq_lengths", r"bool"]),
    "window_negative": ((sds(Q), sds(KV), sds(KV)), dict(local_window_size=-1),
                        ValueError, [r"local_window_size", r"-1"]),
    "window_negative_pair": ((sds(Q), sds(KV), sds(KV)), dict(local_window_size=(2, -3)),
                             ValueError, [r"local_window_size", r"-3"]),
    "window_float": ((sds(Q), sds(KV), sds(KV)), dict(local_window_size=2.5),
                     TypeError, [r"local_window_size", r"2\.5"]),
    "window_triple": ((sds(Q), sds(KV), sds(KV)), dict(local_window_size=(1, 2, 3)),
                      TypeError, [r"local_window_size", r"\(1, 2, 3\)"]),
    "window_bool": ((sds(Q), sds(KV), sds(KV)), dict(local_window_size=True),
                    TypeError, [r"local_window_size"]),
    "softcap_zero": ((sds(Q), sds(KV), sds(KV)), dict(logits_soft_cap=0.0),
                     ValueError, [r"logits_soft_cap", r"0\.0"]),
    "softcap_negative": ((sds(Q), sds(KV), sds(KV)), dict(logits_soft_cap=-1.0),
                         ValueError, [r"logits_soft_cap", r"-1\.0"]),
    "softcap_nan": ((sds(Q), sds(KV), sds(KV)), dict(logits_soft_cap=float("nan")),
                    ValueError, [r"logits_soft_cap"]),
    "scale_string": ((sds(Q), sds(KV), sds(KV)), dict(scale="big"),
                     TypeError, [r"scale"]),
    # Outside float32's range the kernels would apply inf or 0.
    "softcap_above_float32": ((sds(Q), sds(KV), sds(KV)), dict(logits_soft_cap=1e39),
                              ValueError, [r"logits_soft_cap", r"1e\+39", r"float32"]),
    "softcap_flushing_logits": ((sds(Q), sds(KV), sds(KV)), dict(logits_soft_cap=1e31),
                                ValueError, [r"logits_soft_cap", r"1e\+31", r"1.27e\+30"]),
    "softcap_below_float32": ((sds(Q), sds(KV), sds(KV)), dict(logits_soft_cap=1e-46),
                              ValueError, [r"logits_soft_cap", r"1e-46", r"float32"]),
    "scale_above_float32": ((sds(Q), sds(KV), sds(KV)), dict(scale=-1e39),
                            ValueError, [r"scale", r"-1e\+39", r"float32"]),
    "scale_below_float32": ((sds(Q), sds(KV), sds(KV)), dict(scale=1e-40),
                            ValueError, [r"scale", r"1e-40", r"float32"]),
    "unknown_implementation": ((sds(Q), sds(KV), sds(KV)), dict(implementation="triton"),
                               ValueError, [r"implementation", r"triton"]),
}


def _concrete(x, rng):
  if x is None or not isinstance(x, jax.ShapeDtypeStruct):
    return x
  if x.dtype == bool:
    return jnp.asarray(rng.random(x.shape) < 0.5)
  if jnp.issubdtype(x.dtype, jnp.integer):
    return jnp.asarray(rng.integers(0, 5, x.shape), x.dtype)
  return jnp.asarray(rng.standard_normal(x.shape), x.dtype)


def _check_message(err, patterns):
  msg = str(err.value)
  for pattern in patterns:
    assert re.search(pattern, msg), f"{pattern!r} not in the message: {msg!r}"


@pytest.mark.parametrize("how", ["eager", "jit", "eval_shape"])
@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_raises_clear_error(name, how, rng):
  args, kwargs, exc, patterns = CASES[name]
  if how == "eval_shape":  # abstract values only: raised while tracing
    call = lambda: jax.eval_shape(lambda *a, **kw: fast_attention(*a, **kw, **static),
                                  *args, **arrays)
    static = {k: v for k, v in kwargs.items() if not isinstance(v, jax.ShapeDtypeStruct)}
    arrays = {k: v for k, v in kwargs.items() if isinstance(v, jax.ShapeDtypeStruct)}
  else:
    cargs = [_concrete(a, rng) for a in args]
    ckw = {k: _concrete(v, rng) for k, v in kwargs.items()}
    arrays = {k: v for k, v in ckw.items() if isinstance(v, jax.Array)}
    static = {k: v for k, v in ckw.items() if k not in arrays}
    f = lambda *a, **kw: fast_attention(*a, **kw, **static)
    if how == "jit":
      f = jax.jit(f)
    call = lambda: f(*cargs, **arrays)
  with pytest.raises(exc) as err:
    call()
  _check_message(err, patterns)


@pytest.mark.parametrize("what", ["scale", "logits_soft_cap", "local_window_size",
                                  "deterministic", "is_causal"])
def test_traced_static_option_raises(what, rng):
  q = jnp.asarray(rng.standard_normal(Q), jnp.float32)
  k = jnp.asarray(rng.standard_normal(KV), jnp.float32)
  value = {"local_window_size": 2, "deterministic": True, "is_causal": True}.get(what, 0.5)
  f = jax.jit(lambda q, k, x: fast_attention(q, k, k, **{what: x}))
  with pytest.raises(TypeError) as err:
    f(q, k, value)
  _check_message(err, [what])


def test_scale_zero_and_float32_extremes_are_accepted(rng):
  q = jnp.asarray(rng.standard_normal(Q), jnp.float32)
  k = jnp.asarray(rng.standard_normal(KV), jnp.float32)
  uniform = jnp.broadcast_to(jnp.repeat(k.mean(axis=1, keepdims=True), N // K, axis=2), Q)
  np.testing.assert_allclose(fast_attention(q, k, k, scale=0.0), uniform, atol=1e-6)
  # The largest cap taken: tanh's argument stays normal for logits exp can tell from 0.
  np.testing.assert_allclose(fast_attention(q, k, k, logits_soft_cap=2.0**100),
                             fast_attention(q, k, k), atol=1e-6)


@pytest.mark.parametrize("name,limit", [("query_seq_lengths", T),
                                        ("key_value_seq_lengths", S)])
@pytest.mark.parametrize("bad", ["above", "negative"])
def test_concrete_lengths_out_of_range_raise(name, limit, bad, rng):
  """Concrete lengths past T or S (or negative) raise, naming the argument;
  traced ones are clamped (documented), as the kernels and the xla path agree."""
  q = jnp.asarray(rng.standard_normal(Q), jnp.float32)
  k = jnp.asarray(rng.standard_normal(KV), jnp.float32)
  lengths = jnp.asarray([limit + 1, 2] if bad == "above" else [-1, 2], jnp.int32)
  with pytest.raises(ValueError) as err:
    fast_attention(q, k, k, **{name: lengths})
  _check_message(err, [name, rf"\[0, {limit}\]", str(lengths.tolist()[0])])
  clamped = jnp.clip(lengths, 0, limit)
  for impl in (tu.IMPL, "xla"):
    f = jax.jit(lambda q, k, lengths: fast_attention(q, k, k, implementation=impl,
                                                     **{name: lengths}))
    np.testing.assert_allclose(f(q, k, lengths), f(q, k, clamped), atol=0)


def test_implementation_cpu_rejects_float64(rng):
  with tu.x64():
    q = jnp.asarray(rng.standard_normal(Q), jnp.float64)
    k = jnp.asarray(rng.standard_normal(KV), jnp.float64)
    assert q.dtype == jnp.float64
    for f in (fast_attention, jax.jit(fast_attention, static_argnames="implementation")):
      with pytest.raises(TypeError) as err:
        f(q, k, k, implementation="cpu")
      _check_message(err, [r"implementation='cpu'", r"float64"])
    # float64 is served by the reference math on the default and xla paths.
    for impl in (None, "xla"):
      out = fast_attention(q, k, k, implementation=impl)
      assert out.dtype == jnp.float64 and np.isfinite(np.asarray(out)).all()


def test_resolve_implementation():
  assert resolve_implementation("xla") == "xla"
  with pytest.raises(ValueError, match="implementation.*'nope'"):
    resolve_implementation("nope")
  if jax.default_backend() == "cpu":
    assert resolve_implementation() == "cpu"
    with pytest.raises(ValueError, match="'cpu'.*'cuda'"):
      resolve_implementation("cpu", backend="cuda")


def test_fused_path_on_wrong_platform_raises_at_lowering(rng):
  """implementation='cpu' for a computation placed on a GPU is refused."""
  if not tu.has_gpu():
    pytest.skip(f"no GPU: jax.devices() = {jax.devices()!r}")
  q = jnp.asarray(rng.standard_normal(Q), jnp.float32)
  with pytest.raises(ValueError, match="implementation='cpu'"):
    jax.jit(lambda q: fast_attention(q, q, q, implementation="cpu")).lower(q)
