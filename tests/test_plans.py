"""The kernels' facts have one owner: what a handler launched is what the
owner planned, and what the lowering allocated for it.

Each test runs a call, then compares the plan the FFI handler recorded for it
(``_ffi.recorded_plans()``: the variant, kernel head dim, rows per block, grid,
split and workspace it launched with) with the answers of the owner the
lowering asked (``csrc/cuda/variants.h`` through ``fastattn_jax.cuda``; the CPU
kernel's own planner) and with the buffer sizes in the compiled program.
"""

import os
import platform
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa_testutil as tu
from fastattn_jax import _ffi, cuda, fast_attention
from fastattn_jax.decode import decode_attention
from fastattn_jax.shapes import AttentionConfig


def _workspace_floats(hlo: str) -> int:
  """The split-KV workspace the lowering gave the CUDA custom call (its third result)."""
  call = next(line for line in hlo.splitlines() if "fastattn_attention_cuda" in line)
  shapes = re.findall(r"f32\[(\d*)\]", call.split("custom-call(")[0])
  return int(shapes[-1] or 0)


def _check_cuda_launch(q_shape, k_shape, dtype, config, hlo, **features):
  record = _ffi.recorded_plans()["cuda"]
  implementation = cuda.default_implementation(cuda.compute_capability(), q_shape[-1])
  plan = cuda.plan(implementation, config, q_shape, k_shape, dtype, **features)
  assert record["variant"] == plan["variant"], (_ffi.cuda_variant(record["variant"]), plan)
  assert record["kernel_head_dim"] == plan["head_dim"]
  assert record["H"] == plan["row_elements"] == q_shape[-1], "rows read in place, not padded"
  assert record["decode_rows"] == plan["decode_rows"]
  launched = cuda.launch(plan, q_shape, k_shape, blocks_per_sm=record["blocks_per_sm"])
  for fact in ("Br", "Bc", "threads", "smem_bytes", "units", "blocks", "parts",
               "slots", "workspace_floats", "counters", "cluster"):
    assert record[fact] == launched[fact], (fact, record, launched)
  bound = cuda.launch(plan, q_shape, k_shape)
  assert _workspace_floats(hlo) == bound["workspace_floats"] >= record["workspace_floats"]
  return record


@pytest.mark.gpu
def test_cuda_prefill_runs_what_the_owner_planned(rng):
  """A short prefill over long keys (split-KV) at H = 72: not a multiple of
  32, read in place."""
  B, T, S, N, K, H = 1, 40, 3000, 4, 2, 72
  q, k, v = tu.qkv(rng, B, T, S, N, K, H, jnp.bfloat16)
  f = jax.jit(lambda q, k, v: fast_attention(q, k, v, is_causal=True))
  hlo = f.lower(q, k, v).compile().as_text()
  jax.block_until_ready(f(q, k, v))
  config = AttentionConfig(scale=1 / np.sqrt(H), is_causal=True)
  record = _check_cuda_launch(q.shape, k.shape, q.dtype, config, hlo)
  assert record["decode_rows"] == 0 and record["parts"] > 1


@pytest.mark.gpu
def test_cuda_decode_step_runs_what_the_owner_planned(rng):
  """One decode step of Llama-3-8B's heads over a long cache: the decode
  kernel and its partition of the heads' keys."""
  B, S, N, K, H = 2, 20000, 32, 8, 128
  q, k, v = tu.qkv(rng, B, 1, S, N, K, H, jnp.bfloat16)
  lengths = jnp.asarray([20000, 9000], jnp.int32)
  f = jax.jit(decode_attention)
  hlo = f.lower(q, k, v, lengths).compile().as_text()
  jax.block_until_ready(f(q, k, v, lengths))
  config = AttentionConfig(scale=1 / np.sqrt(H), end_aligned=True, has_kv_lens=True)
  record = _check_cuda_launch(q.shape, k.shape, q.dtype, config, hlo)
  assert record["decode_rows"] == 4
  # A whole number of blocks per head, within one wave.
  assert record["blocks"] % record["units"] == 0
  assert record["blocks"] <= record["multiprocessors"] * record["blocks_per_sm"]


def _schedule(causal, num_m, work, grid):
  """Each block's work blocks, in order, under kernel 90's persistent schedule."""
  out = []
  for block in range(grid):
    taken, step = [], 0
    while (i := _ffi.cuda_persistent_index(causal, num_m, work, grid, block, step)) < work:
      if i >= 0:
        taken.append(i)
      step += 1
    out.append(taken)
  return out


@pytest.mark.parametrize("num_m, heads, grid", [
    (4, 256, 132), (16, 64, 132), (128, 16, 132), (7, 9, 132), (5, 3, 132), (1, 40, 7),
    (33, 5, 16)])
def test_cuda_persistent_schedule_takes_each_work_block_once_and_evens_out_causal_work(
    num_m, heads, grid):
  """Kernel 90's persistent blocks (fa_persistent_index) take every work
  block exactly once, causal or not; under causal masking, where row block j
  of a head (heaviest first) costs num_m - j key tiles, the busiest block
  takes no more keys than its share of pairs (num_m + 1 tiles each) rounded
  up: a plain stride on 16 heads of 128 row blocks gives it 1.57x the mean."""
  work = num_m * heads
  for causal in (False, True):
    schedule = _schedule(causal, num_m, work, grid)
    taken = sorted(i for blocks in schedule for i in blocks)
    assert taken == list(range(work)), (causal, num_m, heads, grid)
    if causal:
      loads = [sum(num_m - i % num_m for i in blocks) for blocks in schedule]
      pairs = heads * ((num_m + 1) // 2)
      assert max(loads) <= -(-pairs // grid) * (num_m + 1), (num_m, heads, grid, loads)
      # A pair's heavier row block j (< num_m - 1 - j) comes first, its
      # partner right after.
      for blocks in schedule:
        for a, b in zip(blocks, blocks[1:]):
          j = a % num_m
          if 2 * j < num_m - 1:
            assert b == a - j + num_m - 1 - j, (num_m, blocks)


def test_cuda_forward_kernel_90_launches_at_most_a_wave():
  """Kernel 90's forward is persistent: its grid is at most one wave of
  resident blocks, however many units and splits; the workspace still has a
  slot per (unit, split). The other forward kernels launch one block per
  unit and split."""
  shape = (1, 8192, 16, 128), (1, 8192, 16, 128)
  config = AttentionConfig(scale=0.1, is_causal=True)
  for implementation, grid in (("cuda_sm90", 132), ("cuda_sm80", 64 * 16)):
    plan = cuda.plan(implementation, config, *shape, jnp.bfloat16)
    launch = _ffi.cuda_plan_launch(plan["variant"], *cuda.kernel_shape(plan, *shape), 90, 132, 1)
    assert launch["units"] == 64 * 16 and launch["blocks"] == grid, (implementation, launch)
  # Split-KV: 4 units of up to 128 rows over 60000 keys.
  shape = (1, 200, 2, 128), (1, 60000, 2, 128)
  plan = cuda.plan("cuda_sm90", AttentionConfig(scale=0.1), *shape, jnp.bfloat16)
  launch = _ffi.cuda_plan_launch(plan["variant"], *cuda.kernel_shape(plan, *shape), 90, 132, 1)
  assert launch["units"] == 4 and launch["parts"] > 1 and launch["threads"] == 384
  assert launch["blocks"] == min(132, 4 * launch["parts"])
  assert launch["slots"] == 4 * launch["parts"]



def test_cuda_forward_kernel_90_tiles_fit_an_h100():
  """Kernel 90's forward tile fits an H100's 227 KB of shared memory at every
  kernel head dim, with and without the extras; at H = 256 the plain build
  takes Bc = 64 keys in two stages (the wider S product measured 1.3-1.4x
  the 32 of three stages), the extras build 32 (64 spills there)."""
  config = AttentionConfig(scale=0.1)
  for h in (64, 128, 192, 256):
    shape = (1, 1024, 4, h), (1, 1024, 4, h)
    for extras in (False, True):
      plan = cuda.plan("cuda_sm90", config, *shape, jnp.bfloat16, extras)
      assert plan["kernel_sm"] == 90 and bool(plan["extras"]) == extras, (h, plan)
      launch = _ffi.cuda_plan_launch(plan["variant"], *cuda.kernel_shape(plan, *shape), 90,
                                     132, 1)
      assert launch["smem_bytes"] <= 227 * 1024, (h, extras, launch)
      if h == 256:
        assert launch["Bc"] == (32 if extras else 64), (extras, launch)

def _check_cpu_plan(B, T, S, N, K, H):
  record = _ffi.recorded_plans()["cpu"]
  assert (record["B"], record["T"], record["S"], record["N"], record["K"], record["H"]) == (
      B, T, S, N, K, H)
  planned = _ffi.cpu_plan(B, T, S, N, K, H, record["pool_threads"])
  for fact, value in planned.items():
    assert record[fact] == value, (fact, record, planned)
  return record


def test_cpu_prefill_and_decode_run_what_the_planner_planned(rng):
  """The CPU handler runs the kernel on XLA's thread pool with the plan
  ``_ffi.cpu_plan`` gives for its shapes and the pool's size: a prefill in
  row tiles, and a decode step split over the keys of one sequence. On a
  GPU machine the arrays are placed on the CPU, as a user of ``"cpu"`` must."""
  with jax.default_device(jax.devices("cpu")[0]):
    q, k, v = tu.qkv(rng, 2, 300, 500, 4, 2, 40)
    jax.block_until_ready(jax.jit(
        lambda q, k, v: fast_attention(q, k, v, is_causal=True, implementation="cpu"))(q, k, v))
    record = _check_cpu_plan(2, 300, 500, 4, 2, 40)
    assert not record["decode"] and record["Br"] > 0 and record["workers"] >= 1

    q, k, v = tu.qkv(rng, 1, 1, 20000, 8, 2, 64, jnp.bfloat16)
    lengths = jnp.asarray([19000], jnp.int32)
    jax.block_until_ready(jax.jit(
        lambda q, k, v: decode_attention(q, k, v, lengths, implementation="cpu"))(q, k, v))
    record = _check_cpu_plan(1, 1, 20000, 8, 2, 64)
    assert record["decode"] and record["items"] == record["splits"]
    assert record["splits"] == min(record["pool_threads"], 20000 // 1024)


def _cpu_flags() -> set[str]:
  with open("/proc/cpuinfo") as f:
    return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")),
                set())


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or
                    not os.path.exists("/proc/cpuinfo"), reason="reads x86 Linux's CPU flags")
def test_cpu_kernel_uses_the_widest_vectors_the_cpu_has(rng):
  """The instruction set the CPU kernel picks at run time is the widest the
  CPU reports: a build whose feature detection fails (zig's runtime leaves
  __builtin_cpu_supports empty) falls back to SSE2, 4-5x slower."""
  flags = _cpu_flags()
  if {"avx512f", "avx512vl", "avx512bw", "avx512dq"} <= flags:
    expected = 16
  elif {"avx2", "fma"} <= flags:
    expected = 8
  else:
    expected = 4
  with jax.default_device(jax.devices("cpu")[0]):
    q, k, v = tu.qkv(rng, 1, 70, 90, 2, 2, 32)
    jax.block_until_ready(fast_attention(q, k, v, implementation="cpu"))
  assert _ffi.recorded_plans()["cpu"]["lanes"] == expected
