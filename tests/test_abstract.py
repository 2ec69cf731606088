"""Abstract evaluation: shapes and dtypes from ShapeDtypeStructs /
``jax.core.ShapedArray``s, and the shape rules of ``fastattn_jax.shapes`` on
abstract values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.core import ShapedArray

import fa_testutil as tu
from fastattn_jax import fast_attention, shapes
from fastattn_jax.primitive import fast_attention_p
from fastattn_jax.shapes import AttentionConfig

sds = jax.ShapeDtypeStruct

CASES = {
    "mha": ((2, 5, 4, 8), (2, 7, 4, 8), {}),
    "gqa": ((2, 5, 8, 16), (2, 7, 2, 16), {}),
    "mqa": ((1, 1, 8, 20), (1, 4096, 1, 20), {}),
    "three_d": ((5, 4, 8), (7, 2, 8), {}),
    "bias_mask_lengths": ((3, 5, 4, 8), (3, 7, 2, 8),
                          dict(bias=sds((1, 4, 5, 7), jnp.float32),
                               mask=sds((3, 1, 1, 7), jnp.bool_),
                               query_seq_lengths=sds((3,), jnp.int32),
                               key_value_seq_lengths=sds((3,), jnp.int32))),
    "low_rank_bias": ((3, 5, 4, 8), (3, 7, 2, 8), dict(bias=sds((5, 7), jnp.bfloat16))),
    "zero_length": ((2, 0, 4, 8), (2, 7, 2, 8), {}),
}


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("name", list(CASES))
def test_eval_shape(name, dtype, impl):
  q_shape, kv_shape, arrays = CASES[name]
  dt = tu.DTYPES[dtype]
  q, kv = sds(q_shape, dt), sds(kv_shape, dt)
  f = lambda q, k, v, arrays: fast_attention(q, k, v, return_residual=True,
                                             is_causal=True, implementation=impl, **arrays)
  out, lse = jax.eval_shape(f, q, kv, kv, arrays)
  assert (out.shape, out.dtype) == (q_shape, np.dtype(dt))
  assert (lse.shape, lse.dtype) == (q_shape[:-1], np.dtype(np.float32))
  plain = jax.eval_shape(lambda q, k, v: fast_attention(q, k, v, implementation=impl), q, kv, kv)
  assert (plain.shape, plain.dtype) == (q_shape, np.dtype(dt))


def test_eval_shape_float64():
  with tu.x64():
    q = sds((2, 5, 4, 8), jnp.float64)
    out, lse = jax.eval_shape(lambda q: fast_attention(q, q, q, return_residual=True), q)
    assert out.dtype == jnp.float64 and lse.dtype == jnp.float64 and lse.shape == (2, 5, 4)


def test_primitive_abstract_eval():
  config = AttentionConfig(scale=0.5, has_bias=True, has_kv_lens=True)
  avals = [ShapedArray((2, 5, 4, 8), jnp.bfloat16), ShapedArray((2, 7, 2, 8), jnp.bfloat16),
           ShapedArray((2, 7, 2, 8), jnp.bfloat16), ShapedArray((2, 1, 5, 7), jnp.float32),
           ShapedArray((2,), jnp.int32)]
  (out, lse), _ = fast_attention_p.abstract_eval(*avals, config=config)
  assert out == ShapedArray((2, 5, 4, 8), jnp.bfloat16)
  assert lse == ShapedArray((2, 5, 4), jnp.float32)
  with pytest.raises(ValueError, match="expected 5 operands, got 4"):
    fast_attention_p.abstract_eval(*avals[:4], config=config)
  with pytest.raises(TypeError, match="float64"):
    fast_attention_p.abstract_eval(
        *[ShapedArray(a.shape, jnp.float64) for a in avals[:3]],
        config=AttentionConfig(scale=0.5))


def _sa(shape, dtype=jnp.float32):
  return ShapedArray(shape, dtype)


def test_check_qkv_on_shaped_arrays():
  dims = shapes.check_qkv(_sa((2, 5, 8, 16)), _sa((2, 7, 2, 16)), _sa((2, 7, 2, 16)))
  assert dims == shapes.Dims(B=2, T=5, S=7, N=8, K=2, H=16)


BAD_QKV = {
    "rank": ((_sa((5, 8, 16)), _sa((2, 7, 2, 16)), _sa((2, 7, 2, 16))), ValueError,
             r"query.*\(5, 8, 16\)"),
    "value": ((_sa((2, 5, 8, 16)), _sa((2, 7, 2, 16)), _sa((2, 7, 1, 16))), ValueError,
              r"value.*\(2, 7, 2, 16\).*\(2, 7, 1, 16\)"),
    "heads": ((_sa((2, 5, 6, 16)), _sa((2, 7, 4, 16)), _sa((2, 7, 4, 16))), ValueError,
              r"N=6.*K=4"),
    "zero_kv_heads": ((_sa((2, 5, 6, 16)), _sa((2, 7, 0, 16)), _sa((2, 7, 0, 16))),
                      ValueError, r"K=0"),
    "batch": ((_sa((3, 5, 8, 16)), _sa((2, 7, 2, 16)), _sa((2, 7, 2, 16))), ValueError,
              r"\(3, 5, 8, 16\).*\(2, 7, 2, 16\)"),
    "dtype": ((_sa((2, 5, 8, 16), jnp.float16), _sa((2, 7, 2, 16)), _sa((2, 7, 2, 16))),
              TypeError, r"float16.*float32"),
    "int": ((_sa((2, 5, 8, 16), jnp.int8),) * 3, TypeError, r"int8"),
}


@pytest.mark.parametrize("name", list(BAD_QKV))
def test_check_qkv_raises_on_bad_shaped_arrays(name):
  args, exc, pattern = BAD_QKV[name]
  with pytest.raises(exc, match=pattern):
    shapes.check_qkv(*args)


DIMS = shapes.Dims(B=2, T=5, S=7, N=4, K=2, H=8)


@pytest.mark.parametrize("name,x,exc,pattern", [
    ("bias", _sa((2, 4, 5, 6)), ValueError, r"bias.*\(2, 4, 5, 6\).*\(2, 4, 5, 7\)"),
    ("bias", _sa((4, 5, 7)), ValueError, r"bias.*\(4, 5, 7\)"),
    ("bias", _sa((1, 1, 5, 7), jnp.int32), TypeError, r"bias.*int32"),
    ("mask", _sa((2, 3, 5, 7), jnp.bool_), ValueError, r"mask.*\(2, 3, 5, 7\)"),
    ("mask", _sa((1, 1, 5, 7)), TypeError, r"mask.*bool.*float32"),
])
def test_check_broadcast_operand_raises(name, x, exc, pattern):
  with pytest.raises(exc, match=pattern):
    shapes.check_broadcast_operand(name, x, DIMS)


def test_check_broadcast_operand_accepts_all_16_shapes():
  import itertools
  for dims in itertools.product(*((1, d) for d in (2, 4, 5, 7))):
    shapes.check_broadcast_operand("bias", _sa(dims), DIMS)
    shapes.check_broadcast_operand("mask", _sa(dims, jnp.bool_), DIMS)


@pytest.mark.parametrize("x,exc,pattern", [
    (_sa((3,), jnp.int32), ValueError, r"\(2,\).*\(3,\)"),
    (_sa((2, 1), jnp.int32), ValueError, r"\(2, 1\)"),
    (_sa((2,), jnp.int64), TypeError, r"int32.*int64"),
])
def test_check_seq_lengths_raises(x, exc, pattern):
  with pytest.raises(exc, match=pattern):
    shapes.check_seq_lengths("query_seq_lengths", x, DIMS.B)


@pytest.mark.parametrize("window,expected", [
    (None, None), (3, (3, 3)), ((2, 0), (2, 0)), ([0, 5], (0, 5)), (np.int32(4), (4, 4))])
def test_normalize_window(window, expected):
  assert shapes.normalize_window(window) == expected


def test_static_float():
  assert shapes.static_float("scale", np.float32(0.5)) == 0.5
  with pytest.raises(ValueError, match="scale.*inf"):
    shapes.static_float("scale", float("inf"))
  with pytest.raises(TypeError, match="scale"):
    jax.jit(lambda x: shapes.static_float("scale", x))(1.0)
