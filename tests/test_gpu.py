"""GPU paths. Skipped (with the reason) without a GPU; on a GPU machine run
the whole suite with JAX's default platforms (CUDA and the CPU) and, to force
a path, ``FASTATTN_TEST_IMPLEMENTATION=<name>`` (every other test file then exercises
that path through the ``impl`` fixture). This file checks what is specific to
the GPU: the path choice, every CUDA path on the device at hand, command
buffers, and kernels found again by a fresh process that loads its executable
from JAX's persistent compilation cache."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa_testutil as tu
from fastattn_jax import cuda, fast_attention, implementations, resolve_implementation

pytestmark = pytest.mark.gpu

CUDA_PATHS = list(cuda.IMPLEMENTATIONS)


def _runnable(implementation):
  cc = cuda.compute_capability()
  if not cuda.runs_on(implementation, cc):
    pytest.skip(f"{implementation} does not run on compute capability {cc}")


def test_default_path_on_gpu(rng):
  cc = cuda.compute_capability()
  older = "cuda_sm80" if cc >= 80 else "cuda_sm75" if cc >= 75 else "cuda_sm70"
  expected = "cuda_sm90" if cc == 90 else older
  assert resolve_implementation(None, backend="cuda", dtype=jnp.bfloat16) == expected
  assert resolve_implementation(None, backend="cuda", dtype=jnp.float16, head_dim=64) == expected
  # sm90 needs H (rounded to 32) a multiple of 64; other head dims keep the older path.
  assert resolve_implementation(None, backend="cuda", dtype=jnp.float16, head_dim=96) == older
  assert resolve_implementation(None, backend="cuda", dtype=jnp.float32) == "xla"
  assert resolve_implementation(None, backend="cuda", dtype=jnp.float16, head_dim=288) == "xla"
  q, k, v = tu.qkv(rng, 2, 97, 128, 4, 2, 64, jnp.float16)
  tu.check_call(q, k, v, is_causal=True, implementation=None)
  assert expected in implementations()


@pytest.mark.parametrize("implementation", CUDA_PATHS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("case", tu.PATH_GRID)
def test_cuda_path(rng, implementation, dtype, case):
  _runnable(implementation)
  tu.check_case(rng, case, dtype, implementation)


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


def test_head_dim_over_256_refused_on_cuda_path(rng):
  q = jnp.zeros((1, 4, 1, 288), jnp.float16)
  with pytest.raises(ValueError, match="H=288"):
    jax.jit(lambda q: fast_attention(q, q, q, implementation="cuda_sm75")).lower(q)


#: Kernel 90's persistent blocks each walk several work blocks here (over 132
#: on an H100, whose grid is one wave), so the K/V ring, the Q tile and their
#: phases carry from one work block to the next. Work blocks with no keys
#: (rows past a query length, a zero length) sit between others; float32
#: inputs take the float32-out build. ``check_case``'s grid cases, with
#: ``dtype``.
WALK_CASES = {
    "causal-lengths": dict(B=3, T=1100, S=1100, N=16, K=4, H=64, dtype="bfloat16",
                           opts=dict(is_causal=True, query_seq_lengths=(1100, 300, 0),
                                     key_value_seq_lengths=(1100, 1000, 517))),
    "plain": dict(B=2, T=1000, S=1300, N=16, K=16, H=128, dtype="float16", opts={}),
    "window-bias": dict(B=2, T=600, S=700, N=16, K=8, H=64, dtype="bfloat16",
                        opts=dict(local_window_size=(200, 0), bias=True)),
    "float32": dict(B=2, T=700, S=700, N=16, K=2, H=128, dtype="float32",
                    opts=dict(is_causal=True)),
    "h256": dict(B=2, T=900, S=900, N=16, K=16, H=256, dtype="bfloat16",
                 opts=dict(is_causal=True, query_seq_lengths=(900, 250))),
}


@pytest.mark.parametrize("case", list(WALK_CASES))
def test_cuda_sm90_blocks_walk_several_work_blocks(rng, case):
  _runnable("cuda_sm90")
  tu.check_case(rng, WALK_CASES[case], WALK_CASES[case]["dtype"], "cuda_sm90")


def test_many_calls_in_one_loop(rng):
  """A scan of attention calls (command buffers / CUDA graphs capture the
  execute stage; kernels are loaded in the initialize stage)."""
  q, k, v = tu.qkv(rng, 1, 64, 256, 4, 2, 64, jnp.float16)

  def step(x, _):
    return fast_attention(x, k, v, is_causal=True).astype(x.dtype), None

  out, _ = jax.jit(lambda x: jax.lax.scan(step, x, None, length=8))(q)
  expected = q
  for _ in range(8):
    expected = fast_attention(expected, k, v, is_causal=True, implementation="xla")
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32),
                             atol=2e-2)


_FRESH_PROCESS = """
import sys, jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
hits = []
jax.monitoring.register_event_listener(
    lambda name, **kw: hits.append(name) if name.endswith("cache_hits") else None)
from fastattn_jax import fast_attention
rng = np.random.default_rng(0)
q, k, v = (jnp.asarray(rng.standard_normal((2, 80, 4, 64)), jnp.float16) for _ in range(3))
out = jax.jit(lambda q, k, v: fast_attention(q, k, v, is_causal=True))(q, k, v)
np.save(sys.argv[2], np.asarray(out, np.float32))
print("HITS", len(hits))
"""


def test_fresh_process_from_persistent_compilation_cache(tmp_path):
  """The second process loads the executable from JAX's cache and has an empty
  kernel cache: the FFI handler must rebuild the kernel on its own."""
  jax_cache = tmp_path / "jax_cache"
  outs, hits = [], []
  for run in range(2):
    env = tu.fresh_process_env(FASTATTN_CACHE_DIR=str(tmp_path / f"kernels{run}"))
    r = subprocess.run([sys.executable, "-c", _FRESH_PROCESS, str(jax_cache),
                        str(tmp_path / f"out{run}.npy")],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    hits.append(int(r.stdout.split("HITS")[1]))
    outs.append(np.load(tmp_path / f"out{run}.npy"))
    assert os.listdir(tmp_path / f"kernels{run}"), "the kernel was not built into the cache"
  assert hits[1] >= 1, "premise: the second process loads from the persistent cache"
  np.testing.assert_array_equal(outs[0], outs[1])
