"""Decode steps of several new tokens: T * N / K query rows per key/value
head up to the decode kernel's most (fa_decode_max_rows: 64 on the sm80 and
sm90 paths, 8 on sm70 and sm75), reading each cache head once.

References: the float64 definition with the end-aligned causal rule
(test_decode's ``_check``); the plan rules from the owner (variants.cc), no
GPU needed.
"""

import jax.numpy as jnp
import numpy as np
import pytest

import fa_testutil as tu
from fastattn_jax import _ffi, cuda
from fastattn_jax.decode import decode_attention
from fastattn_jax.shapes import AttentionConfig
from test_decode import _cache, _check


@pytest.mark.parametrize("T,N,K,H,opts", [
    (4, 8, 2, 64, {}),                                  # 16 rows
    (3, 8, 2, 128, {}),                                 # 12 rows in a 16-row block
    (16, 2, 1, 64, {}),                                 # 32 rows, two row groups
    (5, 12, 1, 64, {"local_window_size": (40, 0)}),     # 60 rows in 64, a window
    (16, 4, 1, 128, {}),                                # 64 rows, four row groups
    (8, 8, 1, 256, {}),                                 # 64 rows at H = 256
    (7, 4, 1, 40, {}),                                  # 28 rows, H padded to 64
    (9, 8, 1, 64, {}),                                  # 72 rows: the forward kernels
])
def test_multi_token_decode(T, N, K, H, opts):
  """Ragged caches (one shorter than T, one of one key, one long enough for
  split-KV), the T new queries end-aligned and causal among themselves."""
  rng = np.random.default_rng(tu.seed_of(f"rows{T}{N}{K}{H}{opts}"))
  B, S_max = 4, 3001
  q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.bfloat16)
  k, v = _cache(rng, B, S_max, K, H, jnp.bfloat16)
  lengths = jnp.array([3001, 1, T - 1, 1777], jnp.int32)
  _check(q, k, v, lengths, "bfloat16", **opts)


@pytest.mark.parametrize("T", [2, 8, 16])
def test_multi_token_decode_soft_cap_float16(T):
  rng = np.random.default_rng(tu.seed_of(f"rowscap{T}"))
  B, S_max, N, K, H, cap = 2, 1200, 8, 2, 64, 6.0
  q = jnp.asarray(2 * rng.standard_normal((B, T, N, H)), jnp.float16)
  k, v = _cache(rng, B, S_max, K, H, jnp.float16)
  lengths = jnp.array([1200, 450], jnp.int32)
  got = decode_attention(q, k, v, lengths, implementation=tu.IMPL, logits_soft_cap=cap)
  pos = np.asarray(lengths)[:, None, None] - T + np.arange(T)[None, :, None]
  j = np.arange(S_max)[None, None, :]
  vis = (j <= pos) & (j < np.asarray(lengths)[:, None, None])
  ref, _ = tu.reference64(q, k, v, mask=vis[:, None], logits_soft_cap=cap)
  assert tu.max_err(got, ref) <= 2 * tu.XLA_MAX_ERR["float16"]


def _plan(path, T, N, K, H, S=32768, cc=90):
  plan = cuda.plan(path, AttentionConfig(scale=0.1, is_causal=True, end_aligned=True),
                   (1, T, N, H), (1, S, K, H), jnp.bfloat16)
  launch = _ffi.cuda_plan_launch(plan["variant"], *cuda.kernel_shape(
      plan, (1, T, N, H), (1, S, K, H)), cc, 132, 1)
  return plan["decode_rows"], launch


def test_decode_rows_rule():
  """Which steps the decode kernel takes, and its block at 16 to 64 rows."""
  for path in ("cuda_sm80", "cuda_sm90"):
    assert _plan(path, 1, 32, 8, 128)[0] == 4
    assert _plan(path, 3, 32, 8, 128)[0] == 16
    assert _plan(path, 8, 32, 8, 128)[0] == 32
    assert _plan(path, 16, 32, 8, 128)[0] == 64
    assert _plan(path, 17, 32, 8, 128)[0] == 0      # 68 rows: the forward kernels
  for path in ("cuda_sm70", "cuda_sm75"):            # CUDA cores: 8 rows
    assert _plan(path, 2, 32, 8, 128)[0] == 8
    assert _plan(path, 3, 32, 8, 128)[0] == 0
  # 16 rows: one warp each, 8 warps on 8 rings, clusters on sm_90.
  rows, launch = _plan("cuda_sm80", 4, 32, 8, 128)
  assert (rows, launch["threads"], launch["Bc"], launch["cluster"]) == (16, 256, 128, 8)
  # 64 rows: four row groups of 16 rows, two key groups sharing a ring each,
  # no clusters (eight segments' slots would not fit beside the rows).
  rows, launch = _plan("cuda_sm80", 16, 32, 8, 128)
  assert (rows, launch["threads"], launch["Bc"], launch["cluster"]) == (64, 256, 32, 1)
  assert launch["smem_bytes"] <= 227 * 1024
  # Where shared memory holds only two one-warp rings (sm_86, H = 256),
  # 64 rows still get a warp per row group (one key group).
  rows, launch = _plan("cuda_sm80", 16, 32, 8, 256, cc=86)
  assert (rows, launch["threads"], launch["Bc"]) == (64, 128, 16)
  assert launch["smem_bytes"] <= 99 * 1024


def test_decode_build_90_plan():
  """Build 90 (the sm90 path above 16 rows): two warpgroups, each a key group
  of 64 rows walking tiles of 64 keys (32 at H = 256); one sequence's 8 heads
  at 64 rows split 8 ways in clusters of 8 (merged over the ranks) while a
  block's share is at most 8192 keys, else 16 ways through the workspace, as
  at 32 rows; 8 sequences in clusters of 2 at any length."""
  for T, rows, blocks, cluster in ((8, 32, 128, 1), (16, 64, 64, 8)):
    got, launch = _plan("cuda_sm90", T, 32, 8, 128)
    assert (got, launch["threads"], launch["Bc"]) == (rows, 256, 128)
    assert (launch["blocks"], launch["cluster"]) == (blocks, cluster)
    assert launch["smem_bytes"] <= 227 * 1024
  _, launch = _plan("cuda_sm90", 16, 32, 8, 128, S=1 << 17)
  assert (launch["blocks"], launch["cluster"], launch["counters"]) == (128, 1, 8)
  _, launch = _plan("cuda_sm90", 16, 32, 8, 256)
  assert (launch["Bc"], launch["cluster"]) == (64, 8) and launch["smem_bytes"] <= 227 * 1024
  for S in (1 << 15, 1 << 17):
    plan = cuda.plan("cuda_sm90", AttentionConfig(scale=0.1, is_causal=True, end_aligned=True),
                     (8, 16, 32, 128), (8, S, 8, 128), jnp.bfloat16)
    launch = _ffi.cuda_plan_launch(plan["variant"], *cuda.kernel_shape(
        plan, (8, 16, 32, 128), (8, S, 8, 128)), 90, 132, 1)
    assert (plan["kernel_sm"], launch["blocks"], launch["cluster"]) == (90, 128, 2)
