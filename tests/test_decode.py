"""Decoding over KV caches: ``decode_attention``, ``write``, ``KVCache`` and split-KV.

References: the float64 definition (``fa_testutil.reference64``) with the
end-aligned causal rule written out as a mask, ``jax.nn.dot_product_attention``
with ``key_value_seq_lengths`` for single-token steps, and one full causal
attention for a multi-step decode.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa_testutil as tu
from fastattn_jax import _ffi, cuda, fast_attention
from fastattn_jax.shapes import AttentionConfig
from fastattn_jax.decode import KVCache, decode_attention, write


def _cache(rng, B, S_max, K, H, dtype):
  k = rng.standard_normal((B, S_max, K, H)).astype(np.float32)
  v = rng.standard_normal((B, S_max, K, H)).astype(np.float32)
  return jnp.asarray(k, dtype), jnp.asarray(v, dtype)


def _check(q, k, v, lengths, dtype, got=None, **opts):
  """The path under test (or its result `got`, (out, lse)) against the
  float64 reference, by the suite's acceptance rule (the xla path on inputs
  rounded as the path rounds them)."""
  fast, fast_lse = got or decode_attention(q, k, v, lengths, implementation=tu.IMPL,
                                           return_residual=True, **opts)
  computed = tu.computed_dtype(tu.IMPL, dtype)
  xla, xla_lse = decode_attention(*(x.astype(tu.DTYPES[computed]) for x in (q, k, v)), lengths,
                                  implementation="xla", return_residual=True, **opts)
  ref, ref_lse = _end_aligned_reference(q, k, v, lengths, opts.get("local_window_size"))
  if computed == dtype:
    tu.assert_accepted(fast, xla.astype(q.dtype), ref, tu.OUT_ATOL[dtype], tu.XLA_MAX_ERR[dtype],
                       "out")
    tu.assert_accepted(fast_lse, xla_lse, ref_lse, tu.LSE_ATOL[dtype], tu.LSE_ATOL[dtype], "lse")
  else:
    tu.assert_accepted(fast, xla.astype(q.dtype), ref, max(tu.OUT_ATOL[dtype],
                                                           tu.OUT_ATOL[computed]),
                       max(tu.XLA_MAX_ERR[dtype], 2 * tu.XLA_MAX_ERR[computed]), "out")
    tu.assert_accepted(fast_lse, xla_lse, ref_lse, tu.LSE_ATOL[computed],
                       2 * tu.XLA_MAX_ERR[computed], "lse")
  assert not np.asarray(fast)[~np.isfinite(ref_lse)].any(), "rows that see nothing must be 0"


def _end_aligned_reference(q, k, v, lengths, window=None):
  """float64 (out, lse): query t of sequence b at position lengths[b] - T + t."""
  B, T = q.shape[:2]
  S = k.shape[1]
  pos = np.asarray(lengths)[:, None, None] - T + np.arange(T)[None, :, None]  # (B, T, 1)
  j = np.arange(S)[None, None, :]
  vis = (j <= pos) & (j < np.asarray(lengths)[:, None, None])
  if window is not None:
    vis &= j >= pos - window[0]
  return tu.reference64(q, k, v, mask=vis[:, None])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("N,K", [(8, 2), (4, 4), (6, 1)])
@pytest.mark.parametrize("T", [1, 2, 5])
def test_decode_attention_matches_reference(T, N, K, dtype):
  rng = np.random.default_rng(tu.seed_of(f"decode{T}{N}{K}{dtype}"))
  B, S_max, H = 4, 301, 64
  q = jnp.asarray(rng.standard_normal((B, T, N, H)), tu.DTYPES[dtype])
  k, v = _cache(rng, B, S_max, K, H, tu.DTYPES[dtype])
  # A sequence shorter than T (its first queries see nothing), one exactly T
  # long, one in the middle, one full.
  lengths = jnp.array([max(T - 1, 0), T, 177, S_max], jnp.int32)
  _check(q, k, v, lengths, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_single_token_matches_jax_nn(dtype):
  rng = np.random.default_rng(tu.seed_of(f"jaxnn{dtype}"))
  B, S_max, N, K, H = 3, 257, 8, 2, 64
  q = jnp.asarray(rng.standard_normal((B, 1, N, H)), tu.DTYPES[dtype])
  k, v = _cache(rng, B, S_max, K, H, tu.DTYPES[dtype])
  lengths = jnp.array([1, 100, 257], jnp.int32)
  got = decode_attention(q, k, v, lengths, implementation=tu.IMPL)
  # "highest": GPUs would otherwise run jax.nn's float32 matmuls in TF32.
  with jax.default_matmul_precision("highest"):
    want = jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths)
  err = np.max(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64)))
  assert err <= tu.JAXNN_TOL[tu.computed_dtype(tu.IMPL, dtype)], err


def test_window_end_aligned():
  rng = np.random.default_rng(3)
  B, T, S_max, N, K, H = 2, 3, 200, 4, 2, 32
  q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
  k, v = _cache(rng, B, S_max, K, H, jnp.float32)
  lengths = jnp.array([150, 40], jnp.int32)
  _check(q, k, v, lengths, "float32", local_window_size=(16, 0))


def test_long_cache_split_kv():
  """S long enough for split-KV on the CPU (and on a GPU: batch 1, 2 heads)."""
  rng = np.random.default_rng(4)
  B, S_max, N, K, H = 1, 5000, 8, 2, 64
  q = jnp.asarray(rng.standard_normal((B, 1, N, H)), jnp.bfloat16)
  k, v = _cache(rng, B, S_max, K, H, jnp.bfloat16)
  lengths = jnp.array([4777], jnp.int32)
  assert _h100_launch(B, 1, S_max, N, K, H)["slots"] > 0
  _check(q, k, v, lengths, "bfloat16")


def _calls_in_a_loop(qs, lengths, k, v):
  """decode_attention(qs[i], k, v, lengths[i]) for each i, from one call site
  in a fori_loop: the outputs and LSEs stacked."""
  calls, B, T, N, _ = qs.shape

  def body(i, acc):
    out, lse = decode_attention(qs[i], k, v, lengths[i], implementation=tu.IMPL,
                                return_residual=True)
    return acc[0].at[i].set(out), acc[1].at[i].set(lse)

  acc = (jnp.zeros_like(qs), jnp.zeros((calls, B, T, N), jnp.float32))
  return jax.lax.fori_loop(0, calls, body, acc)


def test_split_kv_calls_in_a_row():
  """Split-KV calls again and again: five from one call site in a jitted loop,
  each with its own queries and lengths, a second site in the same program,
  and the whole program run three times. On CUDA this checks the decode
  kernel's split counters (the call site's state, zeroed once and reset by
  each launch's merging blocks) at every launch: a counter left over would
  leave a head unmerged, with the output of another call or of nothing."""
  rng = np.random.default_rng(12)
  B, S_max, N, K, H, calls = 2, 4096, 8, 2, 64, 5
  k, v = _cache(rng, B, S_max, K, H, jnp.bfloat16)
  qs = jnp.asarray(rng.standard_normal((calls, B, 1, N, H)), jnp.bfloat16)
  lengths = jnp.asarray([[4096, 2900], [17, 4000], [3333, 1], [4095, 4096], [700, 2048]],
                        jnp.int32)
  assert _h100_launch(B, 1, S_max, N, K, H)["slots"] > 0

  @jax.jit
  def run(qs, lengths):
    outs, lses = _calls_in_a_loop(qs, lengths, k, v)
    other = decode_attention(qs[0], k[:, :3000], v[:, :3000], jnp.minimum(lengths[1], 3000),
                             implementation=tu.IMPL, return_residual=True)
    return outs, lses, other

  for _ in range(3):
    outs, lses, other = run(qs, lengths)
    for i in range(calls):
      _check(qs[i], k, v, lengths[i], "bfloat16", got=(outs[i], lses[i]))
    _check(qs[0], k[:, :3000], v[:, :3000], jnp.minimum(lengths[1], 3000), "bfloat16",
           got=other)


@pytest.mark.parametrize("T", [1, 2])
def test_split_kv_in_clusters(T):
  """On sm_90 the plan runs each head's 8 segments as one thread block
  cluster, merged in shared memory, when every sequence has the same number
  of key steps; with other lengths the shares cross heads and the same
  launch merges through the workspace. Both kinds of call from one site in a
  jitted loop, so the split counters, which only the second kind touches,
  must stay right: equal lengths (full, partial, one just short of full),
  ragged lengths, and too few steps for one per block."""
  rng = np.random.default_rng(tu.seed_of(f"cluster{T}"))
  B, S_max, N, K, H = 2, 3000, 32, 8, 128
  assert _h100_launch(B, T, S_max, N, K, H, blocks_per_sm=1)["cluster"] == 8
  k, v = _cache(rng, B, S_max, K, H, jnp.bfloat16)
  lengths = jnp.asarray([[3000, 3000], [2999, 17], [1900, 1900], [3000, 2999], [500, 500]],
                        jnp.int32)
  calls = lengths.shape[0]
  qs = jnp.asarray(rng.standard_normal((calls, B, T, N, H)), jnp.bfloat16)
  run = jax.jit(functools.partial(_calls_in_a_loop, k=k, v=v))
  for _ in range(2):
    outs, lses = run(qs, lengths=lengths)
    for i in range(calls):
      _check(qs[i], k, v, lengths[i], "bfloat16", got=(outs[i], lses[i]))


@pytest.mark.slow
def test_split_kv_long_ragged_caches():
  """Long caches of very different lengths: on CUDA the decode kernel's lean
  partition deals the heads' key steps out in equal shares, so a block's
  share crosses heads and sequences. Three calls (three call sites) in one
  jitted program, each with its own lengths and so its own partition; the
  program runs twice, so each site's split counters must be back at zero
  after its launch."""
  rng = np.random.default_rng(21)
  B, S_max, N, K, H = 2, 90000, 8, 2, 64
  k, v = _cache(rng, B, S_max, K, H, jnp.bfloat16)
  qs = jnp.asarray(rng.standard_normal((3, B, 1, N, H)), jnp.bfloat16)
  lengths = jnp.asarray([[90000, 85001], [90000, 100], [77777, 90000]], jnp.int32)
  assert _h100_launch(B, 1, S_max, N, K, H, blocks_per_sm=1)["slots"] > 0

  @jax.jit
  def run(qs, lengths):
    return [decode_attention(qs[i], k, v, lengths[i], implementation=tu.IMPL,
                             return_residual=True) for i in range(3)]

  for _ in range(2):
    for i, got in enumerate(run(qs, lengths)):
      _check(qs[i], k, v, lengths[i], "bfloat16", got=got)


@pytest.mark.parametrize("T,N,K,H,opts", [
    (1, 32, 8, 128, {}),                               # Llama-3 shapes: 4 rows
    (1, 8, 1, 40, {}),                                 # 8 rows, H not a multiple of 32
    (2, 8, 2, 128, {}),                                # 8 rows: over 48 KB of shared memory
    (3, 2, 2, 36, {}),                                 # H padded to a multiple of 8
    (2, 4, 2, 256, {"logits_soft_cap": 5.0}),
    (3, 2, 1, 64, {"local_window_size": (20, 0)}),
    (1, 16, 1, 64, {}),                                # 16 rows (sm70/sm75: heads folded)
    (1, 96, 1, 64, {}),                                # 96 rows: a prefill kernel, heads folded
])
def test_decode_shapes_and_options(T, N, K, H, opts):
  """Row counts, head dims and options of the CUDA decode kernel (and of the
  CPU path's decode mode), one sequence long enough for split-KV."""
  rng = np.random.default_rng(tu.seed_of(f"dk{T}{N}{K}{H}{opts}"))
  B, S_max = 3, 2111
  q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.bfloat16)
  k, v = _cache(rng, B, S_max, K, H, jnp.bfloat16)
  lengths = jnp.array([2111, 1, 1500], jnp.int32)
  cap = opts.pop("logits_soft_cap", None)
  if cap is None:
    _check(q, k, v, lengths, "bfloat16", **opts)
    return
  got = decode_attention(q, k, v, lengths, implementation=tu.IMPL, logits_soft_cap=cap)
  pos = np.asarray(lengths)[:, None, None] - T + np.arange(T)[None, :, None]
  j = np.arange(S_max)[None, None, :]
  ref, _ = tu.reference64(q, k, v, mask=((j <= pos) & (j >= 0))[:, None], logits_soft_cap=cap)
  assert tu.max_err(got, ref) <= 2 * tu.XLA_MAX_ERR["bfloat16"]


def test_decode_never_reads_past_the_lengths():
  """NaN in the cache past each length changes nothing (those keys are never
  read), with and without split-KV."""
  rng = np.random.default_rng(7)
  B, S_max, N, K, H = 2, 3000, 8, 2, 64
  q = jnp.asarray(rng.standard_normal((B, 1, N, H)), jnp.float16)
  k, v = _cache(rng, B, S_max, K, H, jnp.float16)
  lengths = np.array([2900, 17], np.int32)
  past = np.arange(S_max)[None, :, None, None] >= lengths[:, None, None, None]
  k_nan, v_nan = (jnp.where(past, jnp.nan, x) for x in (k, v))
  got = decode_attention(q, k_nan, v_nan, jnp.asarray(lengths), implementation=tu.IMPL)
  want = decode_attention(q, k, v, jnp.asarray(lengths), implementation=tu.IMPL)
  assert np.isfinite(np.asarray(got, np.float32)).all()
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def _h100_launch(B, T, S, N, K, H, dtype=jnp.bfloat16, blocks_per_sm=0, cc=90, kv_dtype=None,
                 **features):
  """The owner's plan (csrc/cuda/variants.h) for a call on the sm80 kernels of
  an H100 (compute capability 90, 132 multiprocessors), or of compute
  capability `cc` with as many multiprocessors, over a `kv_dtype` cache
  (int8, float8: quantized): no GPU needed."""
  config = AttentionConfig(scale=0.1, has_kv_scales=kv_dtype is not None)
  plan = cuda.plan("cuda_sm80", config, (B, T, N, H), (B, S, K, H), dtype, kv_dtype=kv_dtype,
                   **features)
  return dict(_ffi.cuda_plan_launch(plan["variant"], *cuda.kernel_shape(
      plan, (B, T, N, H), (B, S, K, H)), cc, 132, blocks_per_sm), decode=plan["decode_rows"])


def test_decode_kernel_rules():
  """Which CUDA calls take the decode kernel (at most 64 query rows per
  key/value head on the sm80 path, no bias, mask or query lengths;
  test_decode_rows has the row rules), and its partition: the
  heads' key steps dealt out evenly to a whole number of blocks per head,
  as many as pay for their fixed cost, a workspace slot per (block, head)
  segment; on sm_90, up to 16 blocks per head become 8 in a cluster (not
  for a quantized cache)."""
  assert _h100_launch(1, 1, 4096, 32, 8, 128)["decode"] == 4
  assert _h100_launch(4, 2, 100, 8, 2, 64)["decode"] == 8
  assert _h100_launch(4, 3, 100, 8, 2, 64)["decode"] == 16
  assert not _h100_launch(4, 17, 100, 8, 2, 64)["decode"]  # 68 rows: the forward kernels
  assert not _h100_launch(1, 1, 4096, 32, 8, 128, bias=True)["decode"]
  assert not _h100_launch(1, 1, 0, 32, 8, 128)["decode"]
  # One sequence, 8 heads: 16 blocks each, one wave of 128 on 132
  # multiprocessors; on sm_90, 8 each in clusters of 8.
  for S in (4096, 1 << 18):
    for cc, per_head, cluster in ((80, 16, 1), (90, 8, 8)):
      plan = _h100_launch(1, 1, S, 32, 8, 128, blocks_per_sm=1, cc=cc)
      assert plan["units"] == 8 and plan["blocks"] == 8 * per_head
      assert plan["cluster"] == cluster
      # The workspace stays for ragged lengths (the shares then cross heads).
      assert plan["slots"] == 8 * per_head + 8 - 1 and plan["counters"] == 8
      assert plan["workspace_floats"] == plan["slots"] * 4 * (128 + 1)
  # Eight sequences: two blocks per head (in pairs on sm_90).
  for cc, cluster in ((80, 1), (90, 2)):
    plan = _h100_launch(8, 1, 1 << 16, 32, 8, 128, blocks_per_sm=1, cc=cc)
    assert plan["blocks"] == 128 and plan["cluster"] == cluster
  # A quantized cache's walk runs at its issue rate: every block the cost
  # model asks for (16 per head), none folded into clusters.
  plan = _h100_launch(1, 1, 1 << 15, 32, 8, 128, blocks_per_sm=1, kv_dtype=jnp.int8)
  assert plan["blocks"] == 128 and plan["cluster"] == 1
  # One head: more blocks than a cluster holds.
  plan = _h100_launch(1, 1, 1 << 16, 8, 1, 128, blocks_per_sm=1)
  assert plan["blocks"] == 128 and plan["cluster"] == 1
  # Few keys: one block per key step.
  short = _h100_launch(1, 1, 300, 8, 8, 128, blocks_per_sm=1)
  assert short["blocks"] == 8 * -(-300 // short["Bc"])
  # Every head in one step: nothing to split.
  whole = _h100_launch(132, 1, 64, 8, 1, 128, blocks_per_sm=1)
  assert whole["blocks"] == 132 and whole["slots"] == 0 and whole["counters"] == 0


def test_forward_split_rule():
  """The forward kernels split each unit (a row block of one head) when the
  units leave a wave of blocks idle: enough for every block to get one, each
  over at least 256 keys, at most 64; merged by a second launch (no counters).
  (80 rows per key/value head: past the decode kernel's 64.)"""
  assert _h100_launch(8, 1024, 4096, 32, 8, 128, blocks_per_sm=2)["parts"] == 1
  # One row block, 8 heads, 64K keys, 264 resident blocks: 33 splits.
  split = _h100_launch(1, 80, 65536, 8, 8, 128, blocks_per_sm=2)
  assert split["units"] == 8 and split["parts"] == 33 and split["blocks"] == 8 * 33
  assert split["slots"] == 8 * 33 and split["counters"] == 0
  assert split["workspace_floats"] == 8 * 33 * split["Br"] * (128 + 1)
  assert _h100_launch(1, 80, 4096, 8, 8, 128, blocks_per_sm=2)["parts"] == 4096 // 256
  assert _h100_launch(1, 80, 10 ** 7, 1, 1, 128, blocks_per_sm=2)["parts"] == 64
  assert _h100_launch(1, 80, 100, 1, 1, 128, blocks_per_sm=2)["parts"] == 1


def test_multistep_decode_equals_full_attention():
  """Prefill, then single-token steps in a jitted scan and one 3-token step,
  through KVCache: every row equals one causal attention over the sequence."""
  rng = np.random.default_rng(6)
  B, N, K, H, L, S_max = 2, 8, 2, 32, 3, 64
  P, steps = 9, 6
  total = P + steps + 3
  q_all = jnp.asarray(rng.standard_normal((B, total, N, H)), jnp.float32)
  k_all = jnp.asarray(rng.standard_normal((L, B, total, K, H)), jnp.float32)
  v_all = jnp.asarray(rng.standard_normal((L, B, total, K, H)), jnp.float32)

  cache = KVCache.create(L, B, S_max, K, H, jnp.float32)
  outs = []
  for layer in range(L):  # prefill: all layers see the same q for simplicity
    out, cache = cache.attend(layer, q_all[:, :P], k_all[layer, :, :P], v_all[layer, :, :P],
                              implementation=tu.IMPL)
  outs.append(out)
  cache = cache.advance(P)

  @functools.partial(jax.jit, donate_argnums=0)
  def decode(cache, xs):
    def step(cache, x):
      q, k, v = x
      for layer in range(L):
        out, cache = cache.attend(layer, q[:, None], k[layer][:, None], v[layer][:, None],
                                  implementation=tu.IMPL)
      return cache.advance(1), out[:, 0]
    return jax.lax.scan(step, cache, xs)

  xs = (q_all[:, P:P + steps].swapaxes(0, 1),
        k_all[:, :, P:P + steps].transpose(2, 0, 1, 3, 4),
        v_all[:, :, P:P + steps].transpose(2, 0, 1, 3, 4))
  cache, step_outs = decode(cache, xs)
  outs.append(step_outs.swapaxes(0, 1))
  for layer in range(L):
    out, cache = cache.attend(layer, q_all[:, P + steps:], k_all[layer, :, P + steps:],
                              v_all[layer, :, P + steps:], implementation=tu.IMPL)
  outs.append(out)
  cache = cache.advance(3)
  assert np.array_equal(np.asarray(cache.lengths), [total, total])

  got = jnp.concatenate(outs, axis=1)
  want = fast_attention(q_all, k_all[-1], v_all[-1], is_causal=True, implementation="xla")
  assert tu.max_err(got, np.asarray(want, np.float64)) <= tu.ref_atol()


def test_write_updates_in_place_under_donation():
  B, S_max, K, H = 2, 32, 2, 16
  k = jnp.zeros((B, S_max, K, H))
  new = jnp.ones((B, 2, K, H))
  lengths = jnp.array([3, 30], jnp.int32)
  fn = jax.jit(write, donate_argnums=(0, 1))
  assert "input_output_alias" in fn.lower(k, k, lengths, new, new).compile().as_text()
  k2, _ = fn(k, jnp.zeros_like(k), lengths, new, 2 * new)
  k2 = np.asarray(k2)
  assert k2[0, 3:5].all() and k2[1, 30:32].all()
  assert k2.sum() == 2 * 2 * K * H
  # bf16: no copy and no float32 pass over the cache (XLA:CPU upcasts 16-bit
  # float updates).
  kb = jnp.zeros((B, S_max, K, H), jnp.bfloat16)
  text = fn.lower(kb, kb, lengths, new.astype(jnp.bfloat16),
                  new.astype(jnp.bfloat16)).compile().as_text()
  assert f"f32[{B},{S_max}" not in text
  assert not re.search(rf"= \w+\[{B},{S_max},{K},{H}\]\S* copy\(", text), "a copy of the cache"


def test_write_compiles_to_a_program_of_constant_size():
  """On GPUs (lowered for CUDA without a GPU) no per-sequence unrolling: one
  scatter per cache; on the CPU one slice update per sequence."""
  S_max, K, H = 64, 2, 16

  def lowered(B, platform):
    args = (jax.ShapeDtypeStruct((B, S_max, K, H), jnp.bfloat16),) * 2 + (
        jax.ShapeDtypeStruct((B,), jnp.int32),) + (
        jax.ShapeDtypeStruct((B, 3, K, H), jnp.bfloat16),) * 2
    exported = jax.export.export(jax.jit(write), platforms=[platform])(*args)
    return exported.mlir_module()

  texts = [lowered(B, "cuda") for B in (2, 64)]
  assert len(texts[1]) < 1.2 * len(texts[0])

  def ops(text, op):
    return len(re.findall(rf'= "?stablehlo\.{op}\b', text))

  assert ops(texts[1], "scatter") == 2 and ops(texts[1], "dynamic_update_slice") == 0
  cpu_text = lowered(64, "cpu")
  assert ops(cpu_text, "dynamic_update_slice") == 2 * 64 and ops(cpu_text, "scatter") == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_write_puts_each_sequence_at_its_length(dtype):
  """Random new rows over a NaN cache with ragged lengths (T = 3): exactly
  the positions [lengths[b], lengths[b] + 3) change, traced lengths past
  the end land on the last 3 positions (the documented clamp)."""
  rng = np.random.default_rng(tu.seed_of(f"write{dtype}"))
  B, S_max, K, H, T = 5, 40, 2, 8, 3
  cache = jnp.full((B, S_max, K, H), jnp.nan, tu.DTYPES[dtype])
  new = jnp.asarray(rng.standard_normal((B, T, K, H)), tu.DTYPES[dtype])
  lengths = np.array([0, 7, 36, 39, 20], np.int32)   # 39: past the end, traced
  got, _ = jax.jit(write)(cache, cache, jnp.asarray(lengths), new, new)
  want = np.full(cache.shape, np.nan, np.float32)
  for b, n in enumerate(lengths):
    start = min(n, S_max - T)
    want[b, start:start + T] = np.asarray(new[b], np.float32)
  np.testing.assert_array_equal(np.asarray(got, np.float32), want)


def test_write_past_the_end_raises():
  B, S_max, K, H = 2, 16, 1, 8
  k = jnp.zeros((B, S_max, K, H))
  new = jnp.ones((B, 3, K, H))
  lengths = jnp.array([2, 14], jnp.int32)
  with pytest.raises(ValueError, match=r"KV cache overflow.*S_max=16"):
    write(k, k, lengths, new, new)
  cache = KVCache(k=(k,), v=(k,), lengths=lengths)
  with pytest.raises(ValueError, match=r"KV cache overflow"):
    cache.advance(3)
  try:
    has_cpu = bool(jax.devices("cpu"))
  except RuntimeError:
    has_cpu = False
  if has_cpu:  # traced lengths: reported through a host callback when the step runs
    with pytest.raises(Exception, match=r"KV cache overflow"):
      jax.block_until_ready(jax.jit(lambda c: c.advance(3).lengths)(cache))
  # Within bounds under jit: no error.
  jax.block_until_ready(jax.jit(lambda c: c.advance(2).lengths)(cache))


def test_check_room_on_the_host():
  """check_room reads the lengths before a step; traced lengths it leaves to advance."""
  k = jnp.zeros((2, 16, 1, 8))
  cache = KVCache(k=(k,), v=(k,), lengths=jnp.array([2, 14], jnp.int32))
  assert cache.check_room(2)
  with pytest.raises(ValueError, match=r"KV cache overflow.*S_max=16"):
    cache.check_room(3)
  answers = []
  jax.jit(lambda c: answers.append(c.check_room(3)) or c.lengths)(cache)
  assert answers == [False]


def test_bad_shapes_name_the_argument():
  k = jnp.zeros((2, 16, 2, 8))
  q = jnp.zeros((2, 1, 4, 8))
  with pytest.raises(ValueError, match="lengths"):
    decode_attention(q, k, k, jnp.zeros((3,), jnp.int32))
  with pytest.raises(ValueError, match=r"\(2, 16, 2, 8\)"):
    decode_attention(q, k, k[:, :8], jnp.zeros((2,), jnp.int32))
  with pytest.raises(ValueError, match="k_new"):
    write(k, k, jnp.zeros((2,), jnp.int32), jnp.zeros((2, 1, 3, 8)), jnp.zeros((2, 1, 3, 8)))
  with pytest.raises(ValueError, match="max_len"):
    KVCache.create(2, 1, 0, 2, 8)


@pytest.mark.parametrize("fn", ["decode_attention", "write"])
def test_lengths_of_a_wrong_dtype_or_shape(fn):
  """As in fast_attention's sequence lengths: TypeError for the dtype, ValueError for the shape."""
  k = jnp.zeros((2, 16, 2, 8))
  run = {"decode_attention": lambda lengths: decode_attention(jnp.zeros((2, 1, 4, 8)), k, k,
                                                              lengths),
         "write": lambda lengths: write(k, k, lengths, k[:, :1], k[:, :1])}[fn]
  with pytest.raises(TypeError, match="lengths must be an integer array"):
    run(jnp.zeros((2,), jnp.float32))
  with pytest.raises(ValueError, match=r"lengths must have shape \(B,\) = \(2,\), got \(3,\)"):
    run(jnp.zeros((3,), jnp.int32))
