"""Gradients of ``fast_attention`` (the fused backward where the path has one
for the call, ``backends.choose_backward``; ``reference.attention_grads``
elsewhere) against the
backward written out in float64 (``fa_testutil.reference64_grads``).

The FlashAttention-2 rule, per gradient (dQ, dK, dV, dBias):

  max|grad - ref64| <= 2 * max|grad_xla - ref64| + GRAD_ATOL[dtype] * max|ref64|

where grad_xla is the xla path's gradient in the same dtype (jax.grad of the
reference math: what jax.nn.dot_product_attention's XLA path computes). Random
normal inputs; T and S off every tile size; H in {40, 64, 80, 96, 128, 256};
GQA ratios 1, 4, 8; every feature alone and all combined; every dtype.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa_testutil as tu
import fastattn_jax
from fastattn_jax import (_ffi, attention, backends, cuda, fast_attention, primitive,
                          reference, resolve_implementation)
from fastattn_jax.shapes import DTYPE_CODES

GRAD_ATOL = tu.GRAD_ATOL
_floor = tu.grad_floor


def fused_backward(impl, q, k, **opts) -> bool:
  """Whether the path ``impl`` resolves to has a fused backward for the call."""
  paths = fastattn_jax.explain(q, k, k, implementation=impl, **opts)
  return paths.backward == paths.forward


@dataclasses.dataclass(frozen=True)
class Case:
  B: int = 2
  T: int = 97
  S: int = 130
  N: int = 4
  K: int = 2
  H: int = 64
  dtype: str = "float32"
  opts: tuple = ()          # fast_attention keyword options, as (name, value) pairs
  bias: tuple | None = None  # bias shape; differentiated
  mask: tuple | None = None  # mask shape
  three_d: bool = False


CASES = {
    # GQA ratios 1, 4, 8 across the head dims.
    "mha_H40": Case(N=4, K=4, H=40),
    "gqa4_H80": Case(N=8, K=2, H=80),
    "mqa8_H96": Case(N=8, K=1, H=96, T=65, S=200),
    "mha_H128": Case(N=2, K=2, H=128, T=130, S=97),
    "gqa4_H256": Case(B=1, N=4, K=1, H=256, T=70, S=90),
    "tiny": Case(B=1, T=1, S=1, N=1, K=1, H=8),
    "three_d": Case(T=33, S=65, N=2, K=1, H=64, three_d=True),
    # Each feature alone.
    "causal": Case(opts=(("is_causal", True),)),
    "causal_t_gt_s": Case(T=200, S=70, N=8, K=1, opts=(("is_causal", True),)),
    "window": Case(S=300, opts=(("local_window_size", (20, 5)),)),
    "softcap": Case(H=96, opts=(("logits_soft_cap", 5.0),)),
    "scale": Case(opts=(("scale", 0.3),)),
    "lengths": Case(opts=(("query_seq_lengths", (50, 0)),
                          ("key_value_seq_lengths", (120, 7)))),
    "mask": Case(mask=(2, 1, 97, 130)),
    "bias_full": Case(bias=(2, 4, 97, 130)),
    "bias_broadcast": Case(bias=(1, 4, 1, 130)),
    # Everything at once.
    "combined": Case(N=8, K=2, H=80, opts=(("is_causal", True), ("local_window_size", (40, 0)),
                                           ("logits_soft_cap", 7.0),
                                           ("query_seq_lengths", (97, 60)),
                                           ("key_value_seq_lengths", (100, 130))),
                     bias=(2, 1, 97, 130), mask=(1, 8, 97, 130)),
    # 16-bit inputs.
    "f16_gqa": Case(N=8, K=2, H=128, dtype="float16", opts=(("is_causal", True),)),
    "bf16_combined": Case(dtype="bfloat16", opts=(("local_window_size", (30, 30)),
                                                  ("logits_soft_cap", 20.0)),
                          bias=(2, 4, 97, 130)),
    # The fixed-order backward (sm90: dQ in a pass of its own, not by
    # atomics; the same kernels elsewhere).
    "deterministic_gqa": Case(N=8, K=2, H=128, dtype="bfloat16",
                              opts=(("is_causal", True), ("deterministic", True))),
    "deterministic_f16": Case(H=64, dtype="float16", opts=(("deterministic", True),)),
}


def _inputs(case, rng):
  dtype = tu.DTYPES[case.dtype]
  q, k, v = tu.qkv(rng, case.B, case.T, case.S, case.N, case.K, case.H, dtype=dtype,
                   batch=not case.three_d)
  d_out = jnp.asarray(rng.standard_normal(q.shape), dtype)
  bias = None if case.bias is None else tu.random_bias(rng, case.bias)
  mask = None if case.mask is None else tu.random_mask(rng, case.mask)
  opts = {k_: (tu.lengths(v_) if k_.endswith("lengths") else v_) for k_, v_ in case.opts}
  return q, k, v, d_out, bias, mask, opts


def _grads(impl, q, k, v, d_out, bias, mask, opts):
  argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)

  def loss(q, k, v, bias):
    out = fast_attention(q, k, v, bias, mask, implementation=impl, **opts)
    return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32))

  return jax.jit(jax.grad(loss, argnums=argnums))(q, k, v, bias)


@pytest.mark.parametrize("name", list(CASES))
def test_gradients_by_the_flash_attention_rule(name, rng, impl):
  case = CASES[name]
  q, k, v, d_out, bias, mask, opts = _inputs(case, rng)
  ours = _grads(impl, q, k, v, d_out, bias, mask, opts)
  # A path that multiplies in a narrower dtype (CUDA: float32 -> float16) is
  # held to the xla path's gradients of inputs rounded the same way, as the
  # forward is (fa_testutil.check_call).
  computed = tu.DTYPES[tu.computed_dtype(impl, case.dtype)]
  rounded = (None if x is None else x.astype(computed) for x in (q, k, v, d_out, bias))
  xla = [g.astype(q.dtype) for g in _grads("xla", *rounded, mask, opts)]
  four_d = (lambda x: x[None]) if case.three_d else (lambda x: x)
  ref = tu.reference64_grads(*(four_d(x) for x in (q, k, v, d_out)), bias, mask,
                             **{k_: v_ for k_, v_ in opts.items() if k_ != "deterministic"})
  for what, g, x, r, like in zip(("dQ", "dK", "dV", "dBias"), ours, xla, ref,
                                 (q, k, v, bias)):
    assert g.shape == like.shape and g.dtype == like.dtype, (what, g.shape, g.dtype)
    r = r.reshape(like.shape)
    err, err_xla = tu.max_err(g, r), tu.max_err(x, r)
    floor = _floor(impl, case.dtype) * max(float(np.abs(r).max()), 1.0)
    assert err <= 2 * err_xla + floor, (
        f"{what}: max|ours - ref64| = {err:.3g} > 2 * max|xla - ref64| ({err_xla:.3g}) "
        f"+ {floor:.3g}")


def test_padding_rows_and_unread_keys_get_zero_gradients(rng, impl):
  """Rows at or past the query length get dQ = 0, keys at or past the key
  length dK = dV = 0, a row that sees no key (length 0) zeros everywhere."""
  q, k, v = tu.qkv(rng, 3, 50, 70, 4, 2, 64)
  d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  q_lens, kv_lens = tu.lengths((50, 20, 0)), tu.lengths((70, 33, 70))
  loss = lambda q, k, v: jnp.sum(fast_attention(
      q, k, v, query_seq_lengths=q_lens, key_value_seq_lengths=kv_lens,
      implementation=impl) * d_out)
  dq, dk, dv = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  dq, dk, dv = (np.asarray(x) for x in (dq, dk, dv))
  assert np.all(dq[1, 20:] == 0) and np.all(dq[2] == 0)
  assert np.all(dk[1, 33:] == 0) and np.all(dv[1, 33:] == 0)
  assert np.all(dk[2] == 0) and np.all(dv[2] == 0)
  assert np.abs(dq[1, :20]).min() > 0 and np.abs(dv[1, :33]).min() > 0


def test_gradient_through_the_lse(rng, impl):
  """A loss of out and the LSE (the internal entry, as decode_attention uses
  it; the public one stops the LSE's gradient): dS gains d_lse * P. Checked
  against float64 autodiff of the reference math."""
  config = attention.AttentionConfig(scale=0.125, is_causal=True)
  q, k, v = tu.qkv(rng, 2, 45, 70, 4, 2, 64)
  d_out = rng.standard_normal(q.shape)
  d_lse = rng.standard_normal(q.shape[:-1])

  def loss(run, q, k, v):
    out, lse = run(q, k, v)
    lse = jnp.where(jnp.isfinite(lse), lse, 0)
    return jnp.sum(out * d_out.astype(out.dtype)) + jnp.sum(lse * d_lse.astype(lse.dtype))

  config = dataclasses.replace(config, implementation="auto" if impl is None else impl)
  ours = jax.jit(jax.grad(functools.partial(loss, functools.partial(
      attention.run_config, config)), argnums=(0, 1, 2)))(q, k, v)
  with tu.x64():
    ref64 = jax.grad(functools.partial(loss, functools.partial(
        attention.attention_reference, config)), argnums=(0, 1, 2))(
            *(np.asarray(x, np.float64) for x in (q, k, v)))
    xla = jax.grad(functools.partial(loss, functools.partial(
        attention.attention_reference, config)), argnums=(0, 1, 2))(q, k, v)
  for what, g, x, r in zip(("dQ", "dK", "dV"), ours, xla, ref64):
    r = np.asarray(r)
    err, err_xla = tu.max_err(g, r), tu.max_err(x, r)
    assert err <= 2 * err_xla + _floor(impl, "float32") * np.abs(r).max(), (what, err, err_xla)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_backward_is_deterministic(dtype, rng, impl):
  """With deterministic=True two runs give the same bits (no atomics, a fixed
  order of every sum)."""
  q, k, v = tu.qkv(rng, 2, 300, 333, 8, 2, 64, dtype=tu.DTYPES[dtype])
  if not fused_backward(impl, q, k, is_causal=True, deterministic=True):
    pytest.skip(f"{resolve_implementation(impl, dtype=q.dtype, head_dim=64)!r} has no fused "
                "backward (it differentiates the reference math)")
  d_out = jnp.asarray(rng.standard_normal(q.shape), q.dtype)
  grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fast_attention(
      q, k, v, is_causal=True, implementation=impl, deterministic=True) * d_out).astype(
          jnp.float32), argnums=(0, 1, 2)))
  first = [np.asarray(x) for x in grad(q, k, v)]
  for _ in range(3):
    again = [np.asarray(x) for x in grad(q, k, v)]
    assert all(np.array_equal(a, b) for a, b in zip(first, again))


POISON_CASES = {
    "odd_shapes": dict(B=3, T=97, S=1025, N=6, K=3, H=20),
    "q_padding": dict(B=3, T=67, S=129, N=4, K=2, H=64,
                      opts=dict(query_seq_lengths=(0, 5, 67),
                                key_value_seq_lengths=(129, 0, 60))),
    "masked_rows": dict(B=2, T=300, S=40, N=2, K=2, H=32,
                        opts=dict(is_causal=True, local_window_size=(5, 0))),
    "bf16": dict(B=1, T=3, S=300, N=4, K=1, H=128, dtype="bfloat16"),
}


@pytest.mark.parametrize("name", list(POISON_CASES))
def test_every_gradient_element_is_written(name, rng, impl):
  """The backward kernel called on NaN-filled donated buffers (as in
  test_poison.py: XLA aliases them with its results, checked): any element it
  does not write stays NaN and fails the comparison with the float64
  reference."""
  spec = dict(POISON_CASES[name])
  opts = {k_: (tu.lengths(v_) if k_.endswith("lengths") else v_)
          for k_, v_ in spec.pop("opts", {}).items()}
  dtype = tu.DTYPES[spec.pop("dtype", "float32")]
  B = spec.pop("B")
  if impl in cuda.IMPLEMENTATIONS:
    # As in test_poison.py: shapes and dtypes the kernels take as they are, so
    # that their results are the call's (no padding or conversion after them).
    spec["H"] = -(-spec["H"] // cuda.ROW_ALIGN) * cuda.ROW_ALIGN
    dtype = tu.DTYPES[cuda.operand_dtype(impl, dtype)]
  q, k, v = tu.qkv(rng, B, dtype=dtype, **spec)
  if not fused_backward(impl, q, k):
    pytest.skip("the path has no fused backward: no kernel writes the gradients")
  d_out = jnp.asarray(rng.standard_normal(q.shape), dtype)
  config = attention.AttentionConfig(
      scale=1 / np.sqrt(q.shape[-1]), is_causal=opts.get("is_causal", False),
      window=opts.get("local_window_size"),
      has_q_lens="query_seq_lengths" in opts, has_kv_lens="key_value_seq_lengths" in opts,
      implementation="auto" if impl is None else impl)
  lengths = [opts[n] for n in ("query_seq_lengths", "key_value_seq_lengths") if n in opts]
  out, lse = primitive.bind(config, q, k, v, *lengths)

  def backward(poison, q, k, v, lengths, out, lse, d_out):
    del poison  # donated: its buffers become the results'
    return primitive.bind_backward(config, q, k, v, *lengths, out, lse, d_out,
                                   jnp.zeros_like(lse))

  poisoned = jax.jit(backward, donate_argnums=0, keep_unused=True)
  poison = tuple(jnp.full(x.shape, jnp.nan, x.dtype) for x in (q, k, v))
  hlo = poisoned.lower(poison, q, k, v, lengths, out, lse, d_out).compile().as_text()
  assert "input_output_alias" in hlo, "premise: donated buffers alias the results"
  pointers = [x.unsafe_buffer_pointer() for x in poison]
  grads = poisoned(poison, q, k, v, lengths, out, lse, d_out)
  assert [g.unsafe_buffer_pointer() for g in grads] == pointers, (
      "premise broken: the results are not the poisoned buffers")
  ref = tu.reference64_grads(q, k, v, d_out, **opts)
  for what, g, r in zip(("dQ", "dK", "dV"), grads, ref):
    g64 = np.asarray(g, np.float64)
    assert not np.isnan(g64).any(), f"{what}: {np.isnan(g64).sum()} elements never written"
    assert tu.max_err(g64, r) <= 20 * GRAD_ATOL[tu.dtype_name(q)] * max(np.abs(r).max(), 1)


@pytest.mark.parametrize("name", ["combined", "lengths", "causal_t_gt_s", "bf16_combined",
                                  "gqa4_H80", "tiny"])
def test_blockwise_reference_backward(name, rng):
  """``reference.attention_grads``, the backward of paths with no fused one,
  with blocks of a few rows (T not a multiple of them), by the same rule."""
  case = CASES[name]
  q, k, v, d_out, bias, mask, opts = _inputs(case, rng)
  config = attention.AttentionConfig(
      scale=opts.get("scale", 1 / np.sqrt(case.H)), is_causal=opts.get("is_causal", False),
      window=opts.get("local_window_size"), softcap=opts.get("logits_soft_cap"),
      has_bias=bias is not None, has_mask=mask is not None,
      has_q_lens="query_seq_lengths" in opts, has_kv_lens="key_value_seq_lengths" in opts,
      implementation="xla")
  bias4, mask4 = (None if x is None else x.reshape((1,) * (4 - x.ndim) + x.shape)
                  for x in (bias, mask))
  lens = (opts.get("query_seq_lengths"), opts.get("key_value_seq_lengths"))
  grads = jax.jit(functools.partial(reference.attention_grads, config,
                                    block_elems=7 * case.B * case.N * case.S))(
      q, k, v, bias4, mask4, *lens, d_out, jnp.zeros(q.shape[:-1], jnp.float32))
  xla = _grads("xla", q, k, v, d_out, bias, mask, opts)[:3]
  ref = tu.reference64_grads(q, k, v, d_out, bias, mask, **opts)
  for what, g, x, r in zip(("dQ", "dK", "dV"), grads, xla, ref):
    err, err_xla = tu.max_err(g, r), tu.max_err(x, r)
    floor = GRAD_ATOL[case.dtype] * max(float(np.abs(r).max()), 1.0)
    assert err <= 2 * err_xla + floor, (what, err, err_xla, floor)


def test_cuda_backward_plan_rules():
  """Which calls the CUDA backward kernels take (no GPU needed): every CUDA
  path, H up to 128 (bias, mask and soft cap in the extras build), each on
  its own kernel: sm90 on the wgmma build, sm80 on kernel 80's (which serves
  sm80 and sm90 up to H = 256, each block holding half the columns of dK
  and dV: twice the dK/dV blocks), sm75 on
  kernel 75's (float16 operands, bfloat16 inputs converted), sm70 on the
  Volta kernel's; for dK and dV one launch of ceil(S / Bc) * K * B blocks
  (Bc = 64; Volta: 128 keys up to H = 64; wgmma: 128), for dQ one of
  ceil(T / Br) * N * B (Br = 64; Volta and wgmma: 128). Every build's shared
  memory fits its oldest GPU: 64 KB on a T4, 96 KB on a V100, 227 KB on an
  H100."""
  config = attention.AttentionConfig(scale=0.125, is_causal=True)
  q, k = (2, 1000, 8, 64), (2, 999, 2, 64)
  fixed = dataclasses.replace(config, deterministic=True)
  for path, kernel, Bc, Br in (("cuda_sm70", 70, 128, 128), ("cuda_sm75", 75, 64, 64),
                               ("cuda_sm80", 80, 64, 64), ("cuda_sm90", 90, 128, 128)):
    plan = cuda.plan(path, fixed, q, k, jnp.bfloat16, backward=True)
    assert plan["backward"] == 1 and plan["kernel_sm"] == kernel and plan["head_dim"] == 64
    assert plan["operand_dtype"] == DTYPE_CODES["bfloat16" if kernel >= 80 else "float16"]
    launch = _ffi_launch(plan, q, k)
    assert launch["blocks"] == -(-999 // Bc) * 2 * 2 and launch["units"] == -(-1000 // Br) * 8 * 2
    assert launch["workspace_floats"] == 0
    # By default the wgmma dK/dV kernel adds dQ by atomics: no dQ launch.
    fast = cuda.plan(path, config, q, k, jnp.bfloat16, backward=True)
    assert fast["backward"] == (2 if kernel == 90 else 1)
    assert _ffi_launch(fast, q, k)["units"] == (0 if kernel == 90 else launch["units"])
  for path, cc, smem in (("cuda_sm70", 70, 96), ("cuda_sm75", 75, 64), ("cuda_sm90", 90, 227)):
    for h in range(32, 129, 32):
      qh, kh = (1, 100, 2, h), (1, 100, 2, h)
      plan = cuda.plan(path, config, qh, kh, jnp.float16, True, backward=True)
      assert _ffi.cuda_plan_launch(plan["variant"], *cuda.kernel_shape(plan, qh, kh), cc, 40,
                                   1)["smem_bytes"] <= smem * 1024, (path, h)
  assert cuda.plan("cuda_sm80", config, q, k, jnp.float32, backward=True)["operand_dtype"] == (
      DTYPE_CODES["float16"])
  for cfg, bias, mask in ((config, True, False), (config, False, True),
                          (dataclasses.replace(config, softcap=5.0), False, False)):
    assert cuda.plan("cuda_sm80", cfg, q, k, jnp.float16, bias, mask, backward=True)["extras"]
  qs, ks = (2, 1000, 8, 136), (2, 999, 2, 136)
  for path in ("cuda_sm70", "cuda_sm75"):  # H > 128: no backward kernel
    assert backends.choose_backward(path, config, qs, ks, jnp.float16)[0] == backends.BLOCKWISE
    with pytest.raises(ValueError):
      cuda.plan(path, config, qs, ks, jnp.float16, backward=True)
  for path in ("cuda_sm80", "cuda_sm90"):  # kernel 80's column parts, up to H = 256
    plan = cuda.plan(path, config, qs, ks, jnp.float16, backward=True)
    assert plan["kernel_sm"] == 80 and plan["head_dim"] == 160
    launch = _ffi_launch(plan, qs, ks)
    assert launch["blocks"] == -(-999 // 64) * 2 * 2 * 2 and launch["units"] == -(-1000 // 64) * 8 * 2
    assert launch["smem_bytes"] <= 163 * 1024  # an A100's
    big = (2, 10, 2, 264)
    assert backends.choose_backward(path, config, big, big, jnp.float16)[0] == backends.BLOCKWISE


def _ffi_launch(plan, q_shape, k_shape):
  return _ffi.cuda_plan_launch(plan["variant"], *cuda.kernel_shape(plan, q_shape, k_shape),
                               90, 132, 1)
