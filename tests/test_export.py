"""jax.export: a function calling fast_attention exports with a symbolic batch
dimension, serializes, deserializes and runs at several batch sizes, forward
and gradient; the safety checks to disable come from
``fastattn_jax.export_disabled_checks``; exporting for CUDA without a GPU says
what is needed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import fa_testutil as tu
import fastattn_jax
from fastattn_jax import cuda, fast_attention

T, S, N, K, H = 12, 20, 4, 2, 16


def _args(rng, B, dtype=jnp.float32):
  q, k, v = tu.qkv(rng, B, T, S, N, K, H, dtype)
  return q, k, v, jnp.asarray(rng.integers(1, S + 1, B), jnp.int32)


def _loss(q, k, v, lengths, impl):
  out = fast_attention(q, k, v, is_causal=True, key_value_seq_lengths=lengths,
                       implementation=impl)
  return jnp.sum(out.astype(jnp.float32) ** 2)


def _symbolic(dtype):
  b, = export.symbolic_shape("b")
  return (jax.ShapeDtypeStruct((b, T, N, H), dtype), jax.ShapeDtypeStruct((b, S, K, H), dtype),
          jax.ShapeDtypeStruct((b, S, K, H), dtype), jax.ShapeDtypeStruct((b,), jnp.int32))


@pytest.mark.parametrize("impl", [tu.IMPL, "xla"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_symbolic_batch_round_trip(impl, dtype, rng):
  dt = tu.DTYPES[dtype]
  path = fastattn_jax.resolve_implementation(impl, dtype=dt, head_dim=H)
  if path in cuda.IMPLEMENTATIONS:  # a launch is planned for concrete sizes
    fn = jax.jit(lambda *a: _loss(*a, impl))
    with pytest.raises(ValueError, match="concrete sizes.*implementation='xla'"):
      export.export(fn, disabled_checks=fastattn_jax.export_disabled_checks())(*_symbolic(dt))
    return
  forward = jax.jit(lambda q, k, v, lengths: fast_attention(
      q, k, v, is_causal=True, key_value_seq_lengths=lengths, implementation=impl))
  grad = jax.jit(jax.grad(lambda *a: _loss(*a, impl), argnums=(0, 1, 2)))
  for fn in (forward, grad):
    exported = export.export(fn, disabled_checks=fastattn_jax.export_disabled_checks())(
        *_symbolic(dt))
    restored = export.deserialize(exported.serialize())
    for B in (1, 3):
      args = _args(rng, B, dt)
      for got, want in zip(jax.tree.leaves(restored.call(*args)), jax.tree.leaves(fn(*args))):
        assert got.shape == want.shape and got.dtype == want.dtype
        # The same computation compiled for a symbolic batch: XLA may fuse it differently.
        tol = 1e-5 if dtype == "float32" else 2e-2
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   rtol=tol, atol=tol)


def test_fused_paths_need_the_disabled_checks(rng):
  """Without them JAX refuses the library's custom calls; the checks name every target."""
  fn = jax.jit(lambda *a: _loss(*a, None))
  if fastattn_jax.resolve_implementation(None, dtype=jnp.float32, head_dim=H) == "xla":
    pytest.skip("the default path here is XLA: no custom call to refuse")
  with pytest.raises(ValueError, match="custom call"):
    export.export(fn)(*_symbolic(jnp.float32))
  checks = fastattn_jax.export_disabled_checks()
  names = {str(c) for c in checks}
  assert any("fastattn_attention_cpu" in n for n in names), names
  assert all(isinstance(c, export.DisabledSafetyCheck) for c in checks)


def test_export_for_cuda_without_a_gpu_says_what_is_needed():
  if tu.has_gpu():
    pytest.skip("this process has a GPU")
  fn = jax.jit(lambda q, k, v: fast_attention(q, k, v))
  q = jax.ShapeDtypeStruct((1, T, N, H), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, S, K, H), jnp.bfloat16)
  with pytest.raises(ValueError, match="needs a CUDA GPU in this process.*implementation='xla'"):
    export.export(fn, platforms=["cuda"],
                  disabled_checks=fastattn_jax.export_disabled_checks())(q, k, k)
  # the xla path exports for CUDA from here
  fn = jax.jit(lambda q, k, v: fast_attention(q, k, v, implementation="xla"))
  export.export(fn, platforms=["cuda"])(q, k, k)
