"""The kernel writes every element of its outputs (no padded row, tile or
head left unwritten).

How the outputs are poisoned: ``jax.jit(..., donate_argnums=0,
keep_unused=True)`` of a function that takes NaN-filled arrays of the
output's shape and dtype (out and LSE) and returns ``fast_attention(...)``.
XLA aliases each donated input with the result of the same shape
(``input_output_alias`` in the HLO), and since the custom call is the root of
the computation it writes straight into the donated NaN buffers. The test
checks this premise instead of assuming it: the result buffers must be the
poisoned buffers (``unsafe_buffer_pointer``) and the HLO must alias them.
Any element the kernel does not write stays NaN and fails the check that
out and LSE match the float64 reference everywhere (zeros / -inf in rows
with no visible key included).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa_testutil as tu
from fastattn_jax import ascend, cuda, fast_attention

CASES = {
    # Shapes off every plausible tile size, 3-D, head dim not a multiple of 8.
    "odd_shapes": dict(B=3, T=97, S=1025, N=6, K=3, H=20),
    "three_d": dict(B=None, T=130, S=7, N=2, K=1, H=100),
    "tiny": dict(B=1, T=1, S=1, N=1, K=1, H=8),
    # Padded query rows (0 < len < T and len = 0) and empty key sets.
    "q_padding": dict(B=3, T=67, S=129, N=4, K=2, H=64,
                      opts=dict(query_seq_lengths=(0, 5, 67),
                                key_value_seq_lengths=(129, 0, 60))),
    # Rows fully masked by the window / causal mask (T > S, right=0 window).
    "masked_rows": dict(B=2, T=300, S=40, N=2, K=2, H=32,
                        opts=dict(is_causal=True, local_window_size=(5, 0),
                                  query_seq_lengths=(300, 250))),
    "bf16_long_kv": dict(B=1, T=3, S=4096, N=4, K=1, H=128, dtype="bfloat16"),
    "f16_mask": dict(B=2, T=33, S=65, N=2, K=1, H=40, dtype="float16",
                     mask=True),
    # Few rows per key/value head: the CUDA decode kernel, split-KV merged in
    # its launch (B=1, long S), and 8 rows per block with empty key sets.
    "decode_split_kv": dict(B=1, T=1, S=4099, N=8, K=2, H=128, dtype="bfloat16",
                            opts=dict(key_value_seq_lengths=(3001,))),
    "decode_rows": dict(B=3, T=2, S=700, N=4, K=1, H=64, dtype="float16",
                        opts=dict(is_causal=True, key_value_seq_lengths=(700, 0, 1))),
    # 32 and 64 rows per key/value head: the decode kernel's row groups (two
    # and four warps share a ring) on build 80, the forward kernels on sm70/75.
    "decode_32_rows": dict(B=1, T=4, S=4099, N=8, K=1, H=128, dtype="bfloat16"),
    "decode_64_rows": dict(B=2, T=16, S=1500, N=8, K=2, H=64, dtype="bfloat16",
                           opts=dict(is_causal=True, key_value_seq_lengths=(1500, 9))),
    # Segment ids (rows of an id no key has see nothing), sinks and ALiBi.
    "features": dict(B=2, T=97, S=131, N=4, K=2, H=40, features=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_every_output_element_is_written(name, rng, impl):
  spec = dict(CASES[name])
  opts = {k: (tu.lengths(v) if k.endswith("lengths") else v)
          for k, v in spec.pop("opts", {}).items()}
  dtype = tu.DTYPES[spec.pop("dtype", "float32")]
  B = spec.pop("B")
  with_mask = spec.pop("mask", False)
  with_features = spec.pop("features", False)
  if impl in ascend.IMPLEMENTATIONS:
    pytest.skip("the Ascend targets take operands padded to whole tiles, so the outputs here "
                "are slices of the kernel's; test_ascend.py::test_outputs_fully_written "
                "poisons the target's own outputs")
  if impl in cuda.IMPLEMENTATIONS:
    # The CUDA paths read rows of any multiple of 8 elements in place, but pad
    # other H and convert float32 (and, before sm_80, bfloat16) to float16
    # around the kernel, which would then write an intermediate buffer instead
    # of the donated one: use shapes and dtypes the kernel takes as they are
    # (T, S, B, N and H / 32 stay odd).
    align = cuda.ROW_ALIGN
    spec["H"] = -(-spec["H"] // align) * align
    dtype = tu.DTYPES[cuda.operand_dtype(impl, dtype)]
  q, k, v = tu.qkv(rng, B or 1, dtype=dtype, batch=B is not None, **spec)
  mask = None
  if with_mask:  # half the keys of every row masked (some rows fully)
    mask = tu.random_mask(rng, (q.shape[0], 1, q.shape[-3], k.shape[-3]), 0.5)
  features, ref_mask, ref_bias, ref_sinks = {}, mask, None, None
  if with_features:
    (B_, T, N), S = q.shape[:3], k.shape[1]
    q_ids = np.sort(rng.integers(0, 4, (B_, T)), axis=1).astype(np.int32)
    kv_ids = np.sort(rng.integers(0, 3, (B_, S)), axis=1).astype(np.int32)
    ref_sinks = rng.normal(size=(1, N)).astype(np.float32)
    slopes = rng.uniform(0.01, 0.2, N).astype(np.float32)
    features = dict(segment_ids=(q_ids, kv_ids), sinks=ref_sinks[0], alibi_slopes=slopes)
    ref_mask = q_ids[:, None, :, None] == kv_ids[:, None, None, :]
    ref_bias = -slopes[None, :, None, None] * np.abs(np.arange(T)[:, None] - np.arange(S))

  def attention(poison, q, k, v, mask):
    del poison  # donated: its buffers become the outputs'
    return fast_attention(q, k, v, mask=mask, return_residual=True,
                          implementation=impl, **opts, **features)

  poisoned = jax.jit(attention, donate_argnums=0, keep_unused=True)
  poison = (jnp.full(q.shape, jnp.nan, q.dtype),
            jnp.full(q.shape[:-1], jnp.nan, jnp.float32))
  hlo = poisoned.lower(poison, q, k, v, mask).compile().as_text()
  assert "input_output_alias" in hlo, "premise: donated buffers alias the outputs"
  pointers = [x.unsafe_buffer_pointer() for x in poison]
  out, lse = poisoned(poison, q, k, v, mask)
  assert [out.unsafe_buffer_pointer(), lse.unsafe_buffer_pointer()] == pointers, (
      "premise broken: the outputs are not the poisoned buffers")

  out64, lse64 = np.asarray(out, np.float64), np.asarray(lse, np.float64)
  assert not np.isnan(out64).any(), f"{np.isnan(out64).sum()} output elements never written"
  assert not np.isnan(lse64).any(), f"{np.isnan(lse64).sum()} LSE elements never written"
  ref_out, ref_lse = tu.reference64(q, k, v, ref_bias, ref_mask, sinks=ref_sinks, **opts)
  name_ = tu.dtype_name(q)
  assert tu.max_err(out, ref_out) <= 2 * tu.XLA_MAX_ERR[name_]
  assert np.array_equal(np.isneginf(lse64), np.isneginf(ref_lse))
  assert tu.max_err(lse, ref_lse) <= tu.LSE_ATOL[name_]
  empty = np.isneginf(ref_lse)
  assert np.all(out64[empty] == 0)
