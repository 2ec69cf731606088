"""The decode benchmark's harness (``benchmarks.bench_decode``): the calls
take turns over the K/V sets, in order, a case runs end to end, and the table
compares fastattn with the fastest competitor."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import bench_decode


def test_kv_sets_reach_the_footprint():
  assert bench_decode.kv_sets(16 << 20, 256 << 20) == 16
  assert bench_decode.kv_sets(100 << 20, 256 << 20) == 3
  assert bench_decode.kv_sets(512 << 20, 256 << 20) == 1


def test_loop_takes_turns_over_the_sets():
  """Call i reads set i % sets, each call's output is the next one's query."""

  def attention(x, k, v, lengths, mask):
    del mask
    return x * 2 + k[0] + 10 * v[0] + lengths[0]

  ks = tuple(jnp.full((1,), float(i)) for i in range(3))
  vs = tuple(jnp.full((1,), float(10 + i)) for i in range(3))
  lengths = jnp.array([1000.0])
  got = bench_decode._loop(attention, 6)(jnp.zeros((1,)), ks, vs, lengths, None)
  want = 0.0
  for i in range(6):
    want = want * 2 + i % 3 + 10 * (10 + i % 3) + 1000
  np.testing.assert_allclose(np.asarray(got), [want])


@pytest.mark.parametrize("T", [1, 3])
def test_run_case_on_the_host(T):
  comps = bench_decode.competitors("cpu")
  row = bench_decode.run_case(B=1, T=T, S=256, N=4, K=2, H=32, dtype=jnp.dtype(jnp.float32),
                              comps=comps, calls=4, repeats=1, footprint_bytes=1 << 20)
  assert row["kv_bytes"] == 2 * 256 * 2 * 32 * 4
  assert row["kv_sets"] == 8
  for name in comps:
    assert row[name]["us"] > 0 and row[name]["GB/s"] > 0, row[name]
  table = bench_decode.format_table([row], list(comps), copy_gbs=1.0)
  assert f"| 1 | {T} | 256 |" in table


def test_competitors_agree_on_several_new_tokens():
  """jax.nn with the mask computes what decode_attention does for T > 1 (in
  float32 on the host CPU)."""
  comps = bench_decode.competitors("cpu")
  B, T, S, N, K, H = 2, 3, 40, 4, 2, 16
  with jax.default_device(jax.devices("cpu")[0]):
    q, k, v = (jax.random.normal(jax.random.key(i), shape) for i, shape in
               enumerate([(B, T, N, H), (B, S, K, H), (B, S, K, H)]))
    lengths = jnp.full((B,), S, jnp.int32)
    mask = (jnp.arange(S)[None, :] <= S - T + jnp.arange(T)[:, None])[None, None]
    got, want = (comps[n](q, k, v, lengths, mask) for n in ("fastattn", "xla"))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)


def test_table_ratio_to_the_fastest_competitor():
  row = {"B": 8, "T": 1, "S": 4096, "fastattn": {"us": 50.0, "GB/s": 2000.0},
         "xla": {"us": 65.0, "GB/s": 1500.0}, "cudnn": {"us": 60.0, "GB/s": 1600.0}}
  slow_cudnn = dict(row, S=8192, cudnn={"error": "XlaRuntimeError: no"})
  lines = bench_decode.format_table([row, slow_cudnn], ["fastattn", "xla", "cudnn"],
                                    copy_gbs=4000.0).splitlines()
  assert lines[0].endswith("| fastattn GB/s | fastattn % copy | "
                           "fastattn vs fastest of xla, cudnn |")
  assert lines[2] == "| 8 | 1 | 4096 | 50.0 | 65.0 | 60.0 | 2000 | 50% | 1.20x (cudnn) |"
  assert lines[3] == "| 8 | 1 | 8192 | 50.0 | 65.0 | err | 2000 | 50% | 1.30x (xla) |"


def test_quantized_entries_run_and_report_their_speedup():
  """``--kv-dtypes``: each entry quantizes the sets before the timed loop and
  the table gives its speed over the 16-bit cache's."""
  comps = bench_decode.competitors("cpu")
  comps.update({f"{bench_decode.QUANT}{d}": bench_decode.quantized_competitor(d)
                for d in ("int8", "float8_e4m3fn")})
  row = bench_decode.run_case(B=1, T=1, S=256, N=4, K=2, H=32, dtype=jnp.dtype(jnp.bfloat16),
                              comps=comps, calls=4, repeats=1, footprint_bytes=1 << 18)
  for name in comps:
    assert row[name]["us"] > 0, row[name]
  line = bench_decode.format_table([row], list(comps), copy_gbs=1.0).splitlines()
  assert line[0].endswith("| kv int8 us (speed over fastattn's) | "
                          "kv float8_e4m3fn us (speed over fastattn's) |")
  ratio = row["fastattn"]["us"] / row["kv int8"]["us"]
  assert f"{row['kv int8']['us']:.1f} ({ratio:.2f}x)" in line[2]
