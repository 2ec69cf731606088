"""The persistent compilation cache: a program with the fused kernel is
written to the cache by one process and loaded by a fresh one (which must
register the FFI target before running the deserialized executable)."""

import json
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np

import fa_testutil as tu
from fastattn_jax import resolve_implementation

SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    cache_dir, out_path, impl, dtype = sys.argv[1], sys.argv[2], sys.argv[3] or None, sys.argv[4]
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    hits = []
    jax.monitoring.register_event_listener(
        lambda name, **kw: hits.append(name) if name == "/jax/compilation_cache/cache_hits" else None)
    import fastattn_jax
    from fastattn_jax import fast_attention
    rng = np.random.default_rng(0)
    q, k, v = (jax.numpy.asarray(rng.standard_normal(s), dtype)
               for s in [(2, 33, 4, 40), (2, 50, 2, 40), (2, 50, 2, 40)])
    f = jax.jit(lambda q, k, v: fast_attention(q, k, v, is_causal=True, return_residual=True,
                                               implementation=impl))
    hlo = f.lower(q, k, v).as_text()
    out, lse = f(q, k, v)
    np.savez(out_path, out=np.asarray(out, np.float32), lse=np.asarray(lse))
    print(json.dumps({"hits": len(hits), "kernel_in_hlo": "fastattn_attention_" in hlo,
                      "module": fastattn_jax.__file__}))
""")


def _dtype() -> str:
  """float32 where the path under test takes it fused, else bfloat16 (GPUs
  give float32 to the xla path by default)."""
  path = resolve_implementation(tu.IMPL, dtype=jnp.float32)
  return "float32" if path != "xla" or tu.IMPL == "xla" else "bfloat16"


def _run(tmp_path, cache, name):
  env = {k: v for k, v in tu.fresh_process_env().items() if k != "XLA_FLAGS"}
  out = tmp_path / f"{name}.npz"
  proc = subprocess.run(
      [sys.executable, "-c", SCRIPT, str(cache), str(out), tu.IMPL or "", _dtype()],
      cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  info = json.loads(proc.stdout.strip().splitlines()[-1])
  return info, np.load(out)


def test_persistent_compilation_cache(tmp_path):
  cache = tmp_path / "cache"
  cache.mkdir()
  first, r1 = _run(tmp_path, cache, "first")
  entries = [p for p in cache.rglob("*") if p.is_file()]
  assert entries, "the first run wrote nothing to the compilation cache"
  assert first["hits"] == 0
  dtype = _dtype()
  if resolve_implementation(tu.IMPL, dtype=dtype) != "xla":
    assert first["kernel_in_hlo"], "the cached program should hold the fused kernel"
  second, r2 = _run(tmp_path, cache, "second")
  assert second["hits"] >= 1, f"the second run did not load from the cache: {second}"
  np.testing.assert_array_equal(r1["out"], r2["out"])
  np.testing.assert_array_equal(r1["lse"], r2["lse"])
  rng = np.random.default_rng(0)  # the script's inputs
  q, k, v = (jnp.asarray(rng.standard_normal(s), dtype)
             for s in [(2, 33, 4, 40), (2, 50, 2, 40), (2, 50, 2, 40)])
  # A forced CUDA path multiplies float32 in float16: hold it to the reference
  # of the inputs it actually sees.
  computed = tu.DTYPES[tu.computed_dtype(tu.IMPL, dtype)]
  q, k, v = (np.asarray(x.astype(computed), np.float32) for x in (q, k, v))
  ref, ref_lse = tu.reference64(q, k, v, is_causal=True)
  np.testing.assert_allclose(r2["out"], ref, atol=tu.ref_atol(dtype))
  np.testing.assert_allclose(r2["lse"], ref_lse, atol=2 * tu.LSE_ATOL[dtype])
