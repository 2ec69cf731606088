"""fastattn_jax.parallel: the tensor-parallel attention block on 1, 2 and 4
devices (host CPUs here, conftest's --xla_force_host_platform_device_count=4;
GPUs when present) against a float64 reference of the single-device block; the
tiled schedule's compiled order; the tile-count model; the Llama model and
``generate --tensor-parallel``."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa_testutil as tu
from benchmarks.bench_parallel import schedule_events
from fastattn_jax import generate, parallel
from fastattn_jax.decode import KVCache
from fastattn_jax.models import gguf, llama

B, D, N, H = 2, 64, 8, 16
#: atol of a float32 block against the float64 one: 2e-5 where the path
#: multiplies in float32, its product dtype's where narrower (a CUDA path
#: forced onto float32 inputs rounds them to float16).
OUT_ATOL = max(2e-5, tu.ref_atol("float32"))


def _mesh(P):
  if len(jax.devices()) < P:
    pytest.skip(f"needs {P} devices, have {len(jax.devices())}")
  return jax.make_mesh((P,), ("model",), devices=jax.devices()[:P])


def _weights(rng, K, dtype=jnp.float32):
  shapes = {"wq": (D, N * H), "wk": (D, K * H), "wv": (D, K * H), "wo": (N * H, D)}
  return {name: jnp.asarray(rng.standard_normal(shape) * shape[0] ** -0.5, dtype)
          for name, shape in shapes.items()}


def _reference64(x, w, K, *, is_causal, lengths=None):
  """The single-device block in float64: (B, T, D) numpy."""
  x64 = np.asarray(x, np.float64)
  T = x64.shape[1]
  proj = {name: np.asarray(value, np.float64) for name, value in w.items()}
  q = (x64 @ proj["wq"]).reshape(B, T, N, H)
  k = (x64 @ proj["wk"]).reshape(B, T, K, H)
  v = (x64 @ proj["wv"]).reshape(B, T, K, H)
  out, _ = tu.reference64(q, k, v, is_causal=is_causal, query_seq_lengths=lengths,
                          key_value_seq_lengths=lengths)
  return out.reshape(B, T, N * H) @ proj["wo"]


def _block(tp, **kw):
  return jax.jit(functools.partial(parallel.attention_block, tp=tp, implementation=tu.IMPL,
                                   **kw))


@pytest.mark.parametrize("P", [1, 2, 4])
@pytest.mark.parametrize("K", [2, 8])
@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("with_lengths", [False, True])
@pytest.mark.parametrize("schedule", ["plain", "tiled"])
def test_block_matches_single_device(P, K, is_causal, with_lengths, schedule, rng):
  T = 200  # tiles of 64 rows: 64, 64, 64, 8
  tp = parallel.TensorParallel(_mesh(P), "model", N, K, H)
  x = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
  w = _weights(rng, K)
  lengths = tu.lengths([T - 13, 37]) if with_lengths else None
  kw = {"num_tiles": 4} if schedule == "tiled" else {}
  with jax.default_matmul_precision("highest"):
    out, k, v = _block(tp, is_causal=is_causal, schedule=schedule, **kw)(
        x, parallel.shard_attention_weights(tp, **w), lengths=lengths)
  ref = _reference64(x, w, K, is_causal=is_causal, lengths=lengths)
  np.testing.assert_allclose(np.asarray(out, np.float64), ref, atol=OUT_ATOL, rtol=1e-5)
  assert out.sharding.is_fully_replicated
  assert k.shape == v.shape == (B, T, max(K, P), H)
  assert k.sharding.spec == tp.heads_spec
  # The returned keys are the layout's: head j is key head kv_head_sources()[j].
  k_ref = (np.asarray(x, np.float64) @ np.asarray(w["wk"], np.float64)).reshape(B, T, K, H)
  np.testing.assert_allclose(np.asarray(k), k_ref[:, :, tp.kv_head_sources()], atol=2e-5)


@pytest.mark.parametrize("P", [2, 4])
def test_bfloat16_within_flashattention_rule(P, rng):
  """The all-reduce sums P bfloat16 partial products: the error against
  float64 stays within twice the single-device bfloat16 block's."""
  T, K = 256, 2
  x = jnp.asarray(rng.standard_normal((B, T, D)), jnp.bfloat16)
  w = _weights(rng, K, jnp.bfloat16)
  ref = _reference64(x, w, K, is_causal=True)
  single = parallel.TensorParallel(_mesh(1), "model", N, K, H)
  tp = parallel.TensorParallel(_mesh(P), "model", N, K, H)
  one = _block(single, is_causal=True, schedule="plain")(
      x, parallel.shard_attention_weights(single, **w))[0]
  many = _block(tp, is_causal=True, num_tiles=4)(x, parallel.shard_attention_weights(tp, **w))[0]
  err_one = np.abs(np.asarray(one, np.float64) - ref).max()
  err_many = np.abs(np.asarray(many, np.float64) - ref).max()
  assert err_many <= 2 * err_one + tu.OUT_ATOL["bfloat16"], (err_many, err_one)


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("T", [1, 3])
def test_decode_over_a_head_split_cache(P, T, rng):
  """Prefill S0 rows, then T new rows over the cache: the rows equal the last
  T of the causal block over all S0 + T rows."""
  S0, K, S_max = 70, 2, 96
  tp = parallel.TensorParallel(_mesh(P), "model", N, K, H)
  x = jnp.asarray(rng.standard_normal((B, S0 + T, D)), jnp.float32)
  w = _weights(rng, K)
  ws = parallel.shard_attention_weights(tp, **w)
  with jax.default_matmul_precision("highest"):
    _, k, v = _block(tp, is_causal=True, num_tiles=2)(x[:, :S0], ws)
    cache = KVCache.from_prefill(k[None], v[None], [S0, S0], S_max)
    out, cache_k, _ = _block(tp)(x[:, S0:], ws, cache=(cache.k[0], cache.v[0], cache.lengths))
  ref = _reference64(x, w, K, is_causal=True)[:, S0:]
  np.testing.assert_allclose(np.asarray(out, np.float64), ref, atol=OUT_ATOL, rtol=1e-5)
  assert cache_k.shape == (B, S_max, max(K, P), H) and cache_k.sharding.spec == tp.heads_spec


def test_under_jit_with_named_shardings(rng):
  T, K = 128, 2
  tp = parallel.TensorParallel(_mesh(4), "model", N, K, H)
  ws = parallel.shard_attention_weights(tp, **_weights(rng, K))
  x = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
  weight_shardings = {name: tp.sharding(*spec) for name, spec in tp.weight_specs.items()}
  fn = jax.jit(lambda x, w: parallel.attention_block(x, w, tp, is_causal=True, num_tiles=2)[0],
               in_shardings=(tp.sharding(), weight_shardings), out_shardings=tp.sharding())
  out = fn(x, ws)
  assert out.sharding == tp.sharding()
  np.testing.assert_allclose(
      np.asarray(out), np.asarray(_block(tp, is_causal=True, schedule="plain")(x, ws)[0]),
      atol=1e-5)


def test_tiled_schedule_interleaves_all_reduces(rng):
  """From the compiled module's schedule: each tile's all-reduce is issued
  before the attention of the tile after next, and where all-reduces are
  asynchronous (GPUs, with ``compiler_options``) a tile's attention runs
  while one is in flight (the plain schedule: one all-reduce after all
  attention)."""
  T, K, tiles = 512, 2, 4
  tp = parallel.TensorParallel(_mesh(2), "model", N, K, H)
  # bfloat16: float32 attention takes the "xla" path on GPUs (no custom call).
  ws = parallel.shard_attention_weights(tp, **_weights(rng, K, jnp.bfloat16))
  x = jnp.ones((B, T, D), jnp.bfloat16)

  def events(**kw):
    compiled = _block(tp, is_causal=True, **kw).lower(x, ws).compile(
        compiler_options=parallel.compiler_options(jax.devices()[0].platform))
    return schedule_events(compiled.as_text())

  plain = events(schedule="plain")
  assert plain.count("A") == 1 and plain.replace("S", "R").count("R") == 1
  assert plain.index("A") < plain.replace("S", "R").index("R")
  tiled = events(num_tiles=tiles)
  assert tiled.count("A") == tiles, tiled
  starts = [i for i, e in enumerate(tiled) if e in "RS"]
  attends = [i for i, e in enumerate(tiled) if e == "A"]
  assert len(starts) == tiles, tiled
  for i in range(tiles - 2):
    assert starts[i] < attends[i + 2], tiled
  if "S" in tiled:  # asynchronous (GPUs): an attention runs between a start and its done
    assert re.search("S[^D]*A[^S]*D", tiled), tiled


def test_plan_tiles_follows_the_rates():
  tp = parallel.TensorParallel(_mesh(2), "model", 32, 8, 128)
  fast_link = parallel.Rates(1e15, 0.0, 5e14, 1e-6, 3e14, 1e-6)
  slow_link = parallel.Rates(1e11, 1e-5, 5e14, 1e-6, 3e14, 1e-6)
  plan = parallel.plan_tiles(8192, batch=1, d_model=4096, tp=tp, rates=fast_link)
  assert plan.num_tiles == 1  # nothing to hide: each tile only costs
  plan = parallel.plan_tiles(8192, batch=1, d_model=4096, tp=tp, rates=slow_link)
  assert plan.num_tiles > 1
  assert plan.predicted_s[plan.num_tiles] < plan.predicted_s[1]
  assert plan.predicted_s[1] == pytest.approx(plan.compute_s + plan.reduce_s)
  decode = parallel.plan_tiles(1, batch=8, d_model=4096, tp=tp, rates=slow_link, min_tiles=2)
  assert decode.bounds == (0, 1)
  assert parallel.tile_bounds(200, 4) == (0, 64, 128, 192, 200)
  assert parallel.tile_bounds(1000, 2) == (0, 512, 1000)
  assert parallel.tile_bounds(64, 8) == (0, 64)
  # Two tiles of 1 s compute and 1 s all-reduce after a 1 s prologue: 4 s.
  assert parallel.pipeline_seconds(1.0, [1.0, 1.0], [1.0, 1.0]) == 4.0
  # Tile 2 waits for tile 0's all-reduce (done at 5 s): computes until 6, reduces until 6.5.
  assert parallel.pipeline_seconds(0.0, [1.0, 1.0, 1.0], [4.0, 0.5, 0.5]) == 6.5
  # Half of tile 0's all-reduce slows tile 1: 1 + (1 + 0.5) + 1.
  assert parallel.pipeline_seconds(0.0, [1.0, 1.0], [1.0, 1.0], overlap=0.5) == 3.5
  # All-reduces that hide nothing: the tiles cost their fixed costs and win nothing.
  serial = dataclasses.replace(slow_link, overlap=0.0)
  assert parallel.plan_tiles(8192, batch=1, d_model=4096, tp=tp, rates=serial).num_tiles == 1


def test_measure_rates_and_auto_schedule(rng):
  tp = parallel.TensorParallel(_mesh(2), "model", N, 2, H)
  rates = parallel.measure_rates(tp, D, jnp.float32, rows=(64, 256), repeats=1, calls=1)
  for value in (rates.reduce_bytes_per_s, rates.matmul_flops_per_s,
                rates.attention_flops_per_s):
    assert value > 0
  assert 0.0 <= rates.overlap <= 1.0 and "all-reduce" in rates.describe()
  x = jnp.asarray(rng.standard_normal((B, 256, D)), jnp.float32)
  w = _weights(rng, 2)
  with jax.default_matmul_precision("highest"):
    out = _block(tp, is_causal=True, schedule="tiled", rates=rates)(
        x, parallel.shard_attention_weights(tp, **w))[0]
  np.testing.assert_allclose(np.asarray(out, np.float64),
                             _reference64(x, w, 2, is_causal=True), atol=OUT_ATOL, rtol=1e-5)


def test_errors(rng):
  mesh2 = _mesh(2)
  with pytest.raises(ValueError, match="num_heads=9 does not split"):
    parallel.TensorParallel(mesh2, "model", 9, 3, H)
  with pytest.raises(ValueError, match="num_kv_heads=3"):
    parallel.TensorParallel(_mesh(4), "model", 12, 3, H)
  with pytest.raises(ValueError, match="axis 'heads'"):
    parallel.TensorParallel(mesh2, "heads", N, 2, H)
  tp = parallel.TensorParallel(_mesh(4), "model", N, 2, H)
  w = _weights(rng, 2)
  x = jnp.ones((B, 64, D), jnp.float32)
  with pytest.raises(ValueError, match=r"weights\['wk'\] must be \(64, 64\)"):
    parallel.attention_block(x, w, tp)  # K < P: not in the layout's (replicated) form
  ws = parallel.shard_attention_weights(tp, **w)
  with pytest.raises(ValueError, match="schedule must be one of"):
    parallel.attention_block(x, ws, tp, schedule="fast")
  with pytest.raises(ValueError, match="num_tiles=2"):
    parallel.attention_block(x, ws, tp, schedule="plain", num_tiles=2)
  with pytest.raises(ValueError, match="rotary and positions"):
    parallel.attention_block(x, ws, tp, positions=jnp.zeros((B, 64), jnp.int32))
  with pytest.raises(ValueError, match=r"x must be a floating \(B, T, D\)"):
    parallel.attention_block(x[0], ws, tp)
  cache = (jnp.zeros((B, 80, 4, H)), jnp.zeros((B, 80, 4, H)), jnp.zeros((B,), jnp.int32))
  with pytest.raises(ValueError, match="lengths applies without a cache"):
    parallel.attention_block(x, ws, tp, cache=cache, lengths=jnp.ones((B,), jnp.int32))
  with pytest.raises(ValueError, match="shard_attention_weights: wq must be"):
    parallel.shard_attention_weights(tp, w["wk"], w["wk"], w["wv"], w["wo"])


@pytest.mark.parametrize("P", [2, 4])
def test_llama_tensor_parallel_generates_the_same_tokens(P):
  config = llama.preset("tiny", dtype="float32")
  params = llama.init_params(config, 0)
  prompts = [list(range(1, 90)), [7, 3, 9]]  # 89 rows: two tiles in the prefill
  tp = llama.tensor_parallel(config, _mesh(P))
  sharded = llama.shard_params(params, config, tp)
  with jax.default_matmul_precision("highest"):
    one = llama.generate(params, prompts, config=config, new_tokens=5, implementation=tu.IMPL)
    many = llama.generate(sharded, prompts, config=config, new_tokens=5, implementation=tu.IMPL,
                          tp=tp)
    tokens = jnp.asarray([prompts[0]])
    logits = llama.prefill(params, tokens, config=config, implementation=tu.IMPL)[0]
    tiled = llama.prefill(sharded, tokens, config=config, implementation=tu.IMPL, tp=tp,
                          num_tiles=2)[0]
  assert many.tokens == one.tokens
  np.testing.assert_allclose(np.asarray(tiled), np.asarray(logits), atol=1e-4)


def test_generate_cli_tensor_parallel(capsys):
  try:
    gguf.model_path("smollm2")
  except gguf.GGUFError as err:
    pytest.skip(f"no SmolLM2: {err}")
  _mesh(3)
  argv = ["--model", "smollm2", "--prompt", "The capital of France is", "--new-tokens", "3"]
  one = generate.main(argv)
  three = generate.main(argv + ["--tensor-parallel", "3"])
  assert three["tokens"] == one["tokens"] and three["tensor_parallel"] == 3
  with pytest.raises(SystemExit):
    generate.main(["--tensor-parallel", "2"])
  assert "--tensor-parallel applies only with --model" in capsys.readouterr().err
  with pytest.raises(SystemExit, match="num_heads=9 does not split over the 2 devices"):
    generate.main(argv + ["--tensor-parallel", "2"])


@pytest.mark.parametrize("P", [2, 4])
def test_block_on_a_mesh_of_auto_axes(P, rng):
  """``jax.sharding.Mesh(devices, names)`` (Auto axes, the constructor's
  default) serves as ``jax.make_mesh``'s Explicit axes do, eagerly and under jit."""
  if len(jax.devices()) < P:
    pytest.skip(f"needs {P} devices, have {len(jax.devices())}")
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:P]), ("model",))
  assert mesh.axis_types == (jax.sharding.AxisType.Auto,)
  K, T = 2, 40
  tp = parallel.TensorParallel(mesh, "model", N, K, H)
  x = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
  w = _weights(rng, K)
  ref = _reference64(x, w, K, is_causal=True)
  with jax.default_matmul_precision("highest"):
    for block in (functools.partial(parallel.attention_block, tp=tp, implementation=tu.IMPL,
                                    is_causal=True), _block(tp, is_causal=True)):
      out, _, _ = block(x, parallel.shard_attention_weights(tp, **w))
      np.testing.assert_allclose(np.asarray(out, np.float64), ref, atol=OUT_ATOL, rtol=1e-5)
