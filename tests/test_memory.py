"""The fused path never materializes a T x S buffer (checked on the optimized
HLO), nor does its gradient where the path has a fused backward; the same scan
of the xla path finds one, so the check can fail."""

import math

import jax
import jax.numpy as jnp
import pytest

import fa_testutil as tu
from fastattn_jax import backends, fast_attention, resolve_implementation
from fastattn_jax.reference import attention_grads
from fastattn_jax.shapes import AttentionConfig

T, S = 4096, 4032  # distinct, so a dim of either size can be told apart
B, N, K, H = 1, 2, 1, 64

OPTIONS = {
    "plain": {},
    "causal_window_softcap": dict(is_causal=True, local_window_size=(512, 0),
                                  logits_soft_cap=20.0),
    "lengths": dict(query_seq_lengths=jnp.asarray([3000], jnp.int32),
                    key_value_seq_lengths=jnp.asarray([4000], jnp.int32)),
    "small_bias_and_mask": dict(bias=(1, N, 1, S), mask=(B, 1, T, 1)),
}


def _big_shapes(hlo):
  """Shapes with >= T*S elements or both a T and an S dim."""
  big = []
  for shape in tu.hlo_shapes(hlo):
    if math.prod(shape) >= T * S or (T in shape and S in shape):
      big.append(shape)
  return big


def _fused_dtype(impl):
  """float32, or bfloat16 where the default path gives float32 to the xla path
  (GPUs: the kernels multiply in 16 bits)."""
  fused = impl == "xla" or resolve_implementation(impl, dtype=jnp.float32) != "xla"
  return jnp.float32 if fused else jnp.bfloat16


def _compiled_hlo(impl, opts, grad=False):
  dtype = _fused_dtype(impl)
  q = jax.ShapeDtypeStruct((B, T, N, H), dtype)
  kv = jax.ShapeDtypeStruct((B, S, K, H), dtype)
  opts = dict(opts)
  arrays = {}
  if "bias" in opts:
    arrays["bias"] = jax.ShapeDtypeStruct(opts.pop("bias"), jnp.float32)
  if "mask" in opts:
    arrays["mask"] = jax.ShapeDtypeStruct(opts.pop("mask"), jnp.bool_)
  for name in ("query_seq_lengths", "key_value_seq_lengths"):
    if name in opts:
      arrays[name] = opts.pop(name)
  attend = lambda q, k, v, arrays: fast_attention(
      q, k, v, return_residual=True, implementation=impl, **arrays, **opts)
  f = attend
  if grad:  # of q, k and v; the bias, if any, is not differentiated
    f = jax.grad(lambda q, k, v, arrays: jnp.sum(
        jnp.sin(attend(q, k, v, arrays)[0].astype(jnp.float32))), argnums=(0, 1, 2))
  return jax.jit(f).lower(q, kv, kv, arrays).compile().as_text()


@pytest.mark.parametrize("name", list(OPTIONS))
def test_fused_path_has_no_t_by_s_buffer(name, impl):
  if tu.IMPL == "xla":
    pytest.skip("the xla path materializes T x S by design")
  hlo = _compiled_hlo(impl, OPTIONS[name])
  assert tu.hlo_shapes(hlo), "could not parse any shape from the HLO"
  assert _big_shapes(hlo) == [], f"T x S-sized buffers: {_big_shapes(hlo)}"


@pytest.mark.parametrize("name", list(OPTIONS))
def test_fused_gradient_has_no_t_by_s_buffer(name, impl):
  dtype = _fused_dtype(impl)
  path = resolve_implementation(impl, dtype=dtype, head_dim=H)
  opts = OPTIONS[name]
  config = AttentionConfig(scale=H ** -0.5, softcap=opts.get("logits_soft_cap"),
                           has_bias="bias" in opts, has_mask="mask" in opts)
  if backends.choose_backward(path, config, (B, T, N, H), (B, S, K, H), dtype)[0] != path:
    pytest.skip(f"{path!r} has no fused backward for this call (its gradient is "
                "reference.attention_grads, tested below)")
  hlo = _compiled_hlo(impl, OPTIONS[name], grad=True)
  assert _big_shapes(hlo) == [], f"T x S-sized buffers: {_big_shapes(hlo)}"


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("name", ["plain", "lengths"])
def test_xla_path_does_have_one(name, grad):
  """Control: the scan finds the (B, N, T, S) logits of the xla path."""
  assert _big_shapes(_compiled_hlo("xla", OPTIONS[name], grad))


def test_blockwise_backward_holds_one_block_of_logits():
  """The backward of paths with no fused one (``reference.attention_grads``)
  holds B * N * rows * S logits at a time, rows set by its block budget."""
  config = AttentionConfig(scale=0.125, is_causal=True)
  q = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((B, S, K, H), jnp.bfloat16)
  lse = jax.ShapeDtypeStruct((B, T, N), jnp.float32)
  grads = jax.jit(lambda q, k, v, d_out, d_lse: attention_grads(
      config, q, k, v, None, None, None, None, d_out, d_lse, block_elems=B * N * S * 256))
  hlo = grads.lower(q, kv, kv, q, lse).compile().as_text()
  assert _big_shapes(hlo) == [], f"T x S-sized buffers: {_big_shapes(hlo)}"
  assert (B, N, 256, S) in tu.hlo_shapes(hlo) or (B, K, N // K, 256, S) in tu.hlo_shapes(hlo)
