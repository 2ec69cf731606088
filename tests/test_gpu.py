"""GPU paths. Skipped (with the reason) without a GPU; on a GPU machine run
the whole suite with ``JAX_PLATFORMS=cuda`` and, to force a path,
``FASTATTN_TEST_IMPLEMENTATION=<name>`` (every other test file then exercises
that path through the ``impl`` fixture)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa_testutil as tu
from fastattn_jax import fast_attention, implementations, resolve_implementation

pytestmark = pytest.mark.gpu


def test_default_path_on_gpu(rng):
  path = resolve_implementation(None, backend="cuda")
  q, k, v = tu.qkv(rng, 2, 97, 128, 4, 2, 64)
  tu.check_call(q, k, v, is_causal=True, implementation=None)
  assert path in implementations() and path != "cpu"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cudnn_path(rng, dtype):
  q, k, v = tu.qkv(rng, 2, 128, 128, 4, 4, 64, tu.DTYPES[dtype])
  try:
    out = fast_attention(q, k, v, is_causal=True, implementation="cudnn")
  except Exception as err:  # cuDNN missing or the GPU too old
    pytest.skip(f"cuDNN attention unavailable: {err}")
  ref, _ = tu.reference64(q, k, v, is_causal=True)
  xla = fast_attention(q, k, v, is_causal=True, implementation="xla")
  err_fast = tu.max_err(out, ref)
  assert err_fast <= 2 * tu.max_err(xla, ref) + tu.OUT_ATOL[dtype]


def test_cpu_path_refused_on_gpu(rng):
  q, k, v = (jax.device_put(x, jax.devices("gpu")[0]) for x in tu.qkv(rng, 1, 8, 8, 2, 2, 16))
  with pytest.raises(ValueError, match="implementation='cpu'"):
    jax.jit(lambda q, k, v: fast_attention(q, k, v, implementation="cpu")).lower(q, k, v)
