"""``fastattn_jax.explain``: which forward and backward path a call takes and
why, the same choice the lowering makes (it logs it once per process); and
the one-time warning when a fused forward's gradient falls back to the
blockwise reference math."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa_testutil as tu
import fastattn_jax
from fastattn_jax import backends


def _struct(*shape, dtype=jnp.float32):
  return jax.ShapeDtypeStruct(shape, dtype)


def test_explains_the_default_path_from_shapes_alone():
  q, k = _struct(2, 100, 8, 64, dtype=jnp.bfloat16), _struct(2, 90, 2, 64, dtype=jnp.bfloat16)
  paths = fastattn_jax.explain(q, k, k, is_causal=True)
  platform = backends.platform_of()
  forward = fastattn_jax.resolve_implementation(dtype=jnp.bfloat16, head_dim=64)
  assert (paths.platform, paths.forward) == (platform, forward)
  assert paths.forward_reason and paths.backward_reason
  assert str(paths).splitlines()[1].split()[1].rstrip(":") == forward
  if forward == "cpu":
    assert paths.backward == "cpu" and paths.kernel is None
  if forward.startswith("cuda_"):
    assert paths.kernel.startswith(f"sm{forward.removeprefix('cuda_sm')}")


def test_requested_paths_and_float64():
  q = _struct(1, 16, 2, 32)
  xla = fastattn_jax.explain(q, q, q, implementation="xla")
  assert (xla.forward, xla.backward) == ("xla", "xla")
  assert "requested" in xla.forward_reason
  with jax.enable_x64(True):
    q64 = _struct(1, 16, 2, 32, dtype=jnp.float64)
    f64 = fastattn_jax.explain(q64, q64, q64)
  assert (f64.forward, f64.backward) == ("xla", "xla") and "float64" in f64.forward_reason


def test_a_differentiated_bias_is_named():
  q = _struct(1, 16, 2, 32)
  paths = fastattn_jax.explain(q, q, q, _struct(1, 2, 16, 16))
  assert "bias" in paths.backward_reason


def test_cuda_paths_without_a_backward_kernel_fall_back_blockwise():
  """sm70 and sm75 have backward kernels up to H = 128 (the owner's plan)."""
  config = fastattn_jax.attention.AttentionConfig(scale=0.1)
  for path in ("cuda_sm70", "cuda_sm75"):
    chosen, why = backends.choose_backward(path, config, (1, 64, 4, 160), (1, 64, 4, 160),
                                           jnp.float16)
    assert chosen == backends.BLOCKWISE and path in why
    chosen, _ = backends.choose_backward(path, config, (1, 64, 4, 128), (1, 64, 4, 128),
                                         jnp.float16)
    assert chosen == path
  assert backends.choose_backward("ascend_sim", config, (1, 64, 4, 64), (1, 64, 4, 64),
                                  jnp.float16)[0] == backends.BLOCKWISE


def test_bad_arguments_raise_as_fast_attention_does():
  q = _struct(1, 16, 2, 32)
  with pytest.raises(TypeError, match="unexpected keyword arguments \\['causal'\\]"):
    fastattn_jax.explain(q, q, q, causal=True)
  with pytest.raises(ValueError, match="multiple of the key/value heads"):
    fastattn_jax.explain(_struct(1, 16, 3, 32), q, q)
  with pytest.raises(ValueError, match="implementation must be None or one of"):
    fastattn_jax.explain(q, q, q, implementation="flash")


def test_the_lowering_logs_each_path_once(rng, caplog, monkeypatch):
  """The forward's path at INFO, once per process; a gradient that falls back
  to the blockwise reference under a fused forward at WARNING, naming why."""
  monkeypatch.setattr(backends, "_logged_paths", set())
  cpu = jax.devices("cpu")[0]  # the "cpu" path runs on the host, whatever the default device
  q, k, v = (jax.device_put(x, cpu) for x in tu.qkv(rng, 1, 40, 40, 2, 2, 32))
  loss = lambda q: jnp.sum(fastattn_jax.fast_attention(q, k, v, implementation="cpu"))
  with caplog.at_level(logging.INFO, logger="fastattn_jax"):
    jax.jit(jax.grad(loss)).lower(q)
    jax.jit(jax.grad(lambda q: 2 * loss(q))).lower(q)
  lines = [r.getMessage() for r in caplog.records if r.name == "fastattn_jax"]
  assert sum("forward on cpu: the 'cpu' path" in line for line in lines) == 1, lines
  assert sum("backward on cpu: the 'cpu' path" in line for line in lines) == 1, lines

  caplog.clear()
  monkeypatch.setattr(backends, "choose_backward",
                      lambda *args: (backends.BLOCKWISE, "a reason the test gives"))
  with caplog.at_level(logging.INFO, logger="fastattn_jax"):
    grads = jax.jit(jax.grad(loss))(q)
  (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
  assert "'blockwise' path, a reason the test gives" in warning.getMessage()
  want = jax.grad(lambda q: jnp.sum(fastattn_jax.fast_attention(
      q, k, v, implementation="xla")))(q)
  np.testing.assert_allclose(grads, want, atol=1e-5)
