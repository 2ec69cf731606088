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
