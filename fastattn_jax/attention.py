"""``fast_attention``, a drop-in for ``jax.nn.dot_product_attention``, and ``explain``,
which says which paths serve a call."""

from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np

from fastattn_jax import backends, primitive, shapes
from fastattn_jax.reference import attention_reference, plain_kv
from fastattn_jax.shapes import AttentionConfig


def fast_attention(query, key, value, bias=None, mask=None, *, scale=None,
                   is_causal=False, query_seq_lengths=None,
                   key_value_seq_lengths=None, local_window_size=None,
                   logits_soft_cap=None, segment_ids=None, sinks=None, alibi_slopes=None,
                   return_residual=False, implementation=None, deterministic=False):
  r"""Scaled dot-product attention, fused: a drop-in for ``jax.nn.dot_product_attention``.

  Computes, per batch b and query head n (reading key/value head
  ``n // (N // K)``)::

    logits = scale * Q K^T              (float32 accumulation)
    logits = c * tanh(logits / c)       if logits_soft_cap = c
    logits = logits + bias              if bias is given
    logits = logits - slope |i - j|     if alibi_slopes is given
    out    = softmax(logits over the visible keys [and the sink]) V

  without ever forming the T x S logits: the fused paths follow FastAttention
  (Lin et al., "FastAttention: Extend FlashAttention2 to NPUs and Low-resource
  GPUs for Efficient Inference", 2024): two-level tiling (Br x Bc tiles for
  the matrix products, Bb-row slices for the online-softmax update,
  FlashAttention-2's Algorithm 1) and the tiling-mask (causal, window and
  length masks computed per tile from indices; fully masked tiles skipped).

  Args:
    query: (B, T, N, H) or (T, N, H); float32, float16, bfloat16 (or float64,
      served by the reference math).
    key: (B, S, K, H) or (S, K, H), query's dtype; N must be a multiple of K
      (K = N: multi-head, 1 < K < N: grouped-query, K = 1: multi-query).
    value: key's shape and dtype.
    bias: optional additive bias, any floating dtype, broadcastable to
      (B, N, T, S) (missing leading dims are added, as in jax.nn).
    mask: optional bool array broadcastable to (B, N, T, S); True = attend.
    scale: static float multiplying ``Q K^T``; default ``1 / sqrt(H)``; zero
      or of magnitude within float32's normal range.
    is_causal: static bool: key j is visible to query i only if ``j <= i``.
    query_seq_lengths: optional (B,) integer array in [0, T]: rows ``i >=
      length`` are padding and return zeros.
    key_value_seq_lengths: optional (B,) integer array in [0, S]: keys ``j >=
      length`` are never read. Concrete lengths outside their range raise;
      traced ones (under jit) are clamped to it.
    local_window_size: ``w`` or ``(left, right)``, static ints >= 0: key j is
      visible to query i only if ``i - left <= j <= i + right``.
    logits_soft_cap: optional static float c > 0 within float32's normal
      range, applied to the scaled logits before the bias and the masks.
    segment_ids: packed sequences (Splash attention's and MaxText's
      convention): an integer (B, T) array (T = S: self-attention), or a pair
      ``(q_segment_ids (B, T), kv_segment_ids (B, S))`` ((T,) and (S,) for 3-D
      inputs). Query i sees key j only where the two ids are equal (and every
      other rule lets it). Ids are any int32 values in any order: rows or keys
      of one id that are not adjacent (an id that reappears later in the row)
      form one segment, which sees itself wherever it is. The fused paths skip
      key tiles whose ids no row of the tile has and test ids per pair only on
      tiles that hold more than one (FastAttention's tiling-mask).
    sinks: optional (N,) float array, attention sinks (StreamingLLM;
      gpt-oss): a logit per query head that joins every row's softmax
      denominator and has no value row, so a row's weights sum to less than
      1. A row that sees no key then gets out 0 and LSE = sink. Gets its
      gradient (-sum over rows of exp(sink - LSE) D, D = dO . O - dLSE).
    alibi_slopes: optional (N,) or (B, N) float array (ALiBi, Press et al.
      2022): adds ``-slope * |i - j|`` to the logit of query i and key j,
      after the soft cap, computed per tile. For T != S this is top-left
      aligned, as ``is_causal`` is (FlashAttention aligns it bottom-right:
      shift the rows with ``i + S - T``, e.g. through a window or the decode
      API, to match). Differentiable (from the reference math, as a bias).
    return_residual: also return the log-sum-exp of the visible logits,
      under ``stop_gradient`` as jax.nn returns it: no gradient flows from it.
    implementation: None (the best path for the platform and inputs: "cpu"
      on CPUs; on NVIDIA GPUs the kernel of the compute capability, "cuda_sm70"
      (7.x below 7.5), "cuda_sm75" (7.5), "cuda_sm80" (8.0 and newer) or
      "cuda_sm90" (9.0, when H rounded up to a multiple of 32 is a multiple of 64),
      for float16 and bfloat16 inputs with H <= 256, else "xla"), "xla" (plain
      JAX, materializes T x S), "cpu" (the fused CPU kernel), "cuda_sm70" /
      "cuda_sm75" / "cuda_sm80" / "cuda_sm90" (force one CUDA kernel:
      mma.m8n8k4, mma.m16n8k8, mma.m16n8k16 with cp.async, or Hopper's wgmma;
      a GPU runs its own path and the older ones, cuda_sm90 runs on 9.0 only)
      or "cudnn" (delegates to ``jax.nn.dot_product_attention``).
      The CUDA kernels multiply in float16 or bfloat16 with float32
      accumulation and softmax: float32 inputs (and bfloat16 inputs on the
      sm70 / sm75 paths, whose tensor cores lack bfloat16) are rounded to
      float16 for the products, so magnitudes above 65504 overflow there; the
      output keeps the input dtype. They are compiled at first use by NVRTC
      for the GPU at hand and cached on disk (``fastattn_jax.cuda``).
      A NaN in a value row reaches, on the CUDA and xla paths, the rows that
      share its key tile (0 * NaN inside the product), not only the rows that
      see it. A non-finite key reaches only the rows that see it, forward and
      gradients: the others' dQ stays what it is without that key.
    deterministic: static bool; the backward then sums every gradient in a
      fixed order, so two runs give the same bits. Only the "cuda_sm90"
      backward up to H = 128 depends on it: by default its dK/dV kernel also
      adds dQ into a float32 buffer by atomics (FlashAttention-2's choice;
      the order of the additions varies from run to run, within float32
      rounding); with True, dQ takes a kernel of its own that computes S and
      dP again (7 products instead of 5). Every other path is deterministic
      either way.

  Returns:
    out, query's shape and dtype; with ``return_residual`` also the LSE, shape
    (B, T, N) or (T, N), float32 (float64 for float64 inputs). A query row
    with no visible key (all masked, or padding) gives out = 0 and LSE = -inf,
    never NaN; jax.nn's XLA path gives the mean of the values there instead.

  Raises:
    ValueError: on shapes that do not fit (named with their shapes: segment
      ids, sinks and slopes too), segment ids given as one array when T !=
      S, the training features with implementation "cudnn", negative
      window sizes, non-positive soft caps, a scale or soft cap that float32
      does not represent, concrete sequence lengths out of range, an unknown
      implementation or one that cannot run on the current platform or GPU,
      or H > 256 on a CUDA path.
    RuntimeError: (at the first run on a GPU) when no NVRTC can compile the
      kernel; the message says what to install.
    TypeError: on dtypes that do not fit (segment ids must be integers,
      sinks and slopes floating point), or traced values where static ones
      are needed (scale, is_causal, local_window_size, logits_soft_cap,
      deterministic).

  Differentiable (``jax.grad``). The "cpu" path has a fused backward
  (FlashAttention-2's, Dao 2023, Algorithm 2: from the saved out and LSE it
  recomputes P and dS tile by tile; dK and dV per key tile, dQ in a separate
  pass per query block, so every sum has a fixed order: deterministic, no
  atomics, no T x S buffer). Every CUDA path has backward kernels of the
  same algorithm for H <= 128, and "cuda_sm80" and "cuda_sm90" up to H = 256
  (``attention_backward.cu``; on "cuda_sm90" up to H = 128
  ``attention_backward_wgmma.cu``, on "cuda_sm70"
  ``attention_backward_volta.cu``: dK and dV per block of keys, dQ per block
  of query rows; on "cuda_sm90" up to H = 128 dQ is added by the dK/dV
  kernel through float32 atomics unless ``deterministic``), multiplying in
  the forward's 16-bit dtype. Beyond those head dims the gradient runs in
  jax.numpy over blocks of whole query rows (``reference.attention_grads``:
  each block's softmax recomputed in the inputs' precision, XLA's matrix
  products, at most 2^25 logits at a time). A differentiated bias gets its
  gradient (dS summed over its broadcast dims) from the reference math on
  every path (under jit XLA drops it when the bias is not differentiated;
  eager ``jax.grad`` computes it whenever a bias is given). For float16 and
  bfloat16 inputs the forward under differentiation writes out in float32
  (2 more bytes per output element kept for the backward), from which
  FlashAttention-2's D = rowsum(dO o O) is taken: from the rounded out, D's
  error times the scale would dominate dS once the logits are not small.
  Works under jit, vmap, scan, checkpoint, ``jax.disable_jit``,
  ``jax.export`` (``export_disabled_checks``; symbolic batch dims too),
  inside ``shard_map`` and with inputs sharded along batch or heads.
  """
  config, operands = _prepare(
      query, key, value, bias, mask, scale=scale, is_causal=is_causal,
      query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
      local_window_size=local_window_size, logits_soft_cap=logits_soft_cap,
      segment_ids=segment_ids, sinks=sinks, alibi_slopes=alibi_slopes,
      implementation=implementation, deterministic=deterministic)
  out_shape = jnp.shape(query)
  if config.implementation == "cudnn":
    if config.softcap is not None or config.has_features:
      raise ValueError("implementation='cudnn' does not support logits_soft_cap, "
                       "segment_ids, sinks or alibi_slopes")
    q_lens, kv_lens = operands[5:7]
    return jax.nn.dot_product_attention(
        query, key, value, bias, mask, scale=config.scale, is_causal=config.is_causal,
        query_seq_lengths=q_lens, key_value_seq_lengths=kv_lens,
        local_window_size=config.window, implementation="cudnn",
        return_residual=return_residual)
  out, lse = run_config(config, *operands)
  out = out.reshape(out_shape)
  return (out, jax.lax.stop_gradient(lse.reshape(out_shape[:-1]))) if return_residual else out


def _prepare(query, key, value, bias, mask, *, scale, is_causal, query_seq_lengths,
             key_value_seq_lengths, local_window_size, logits_soft_cap, segment_ids=None,
             sinks=None, alibi_slopes=None, implementation, deterministic):
  """Checks ``fast_attention``'s arguments; returns its ``AttentionConfig`` and
  the operands (q, k, v 4-D; bias and mask 4-D; lengths (B,) int32; the
  training features as a ``shapes.Features``; absent ones None)."""
  query, key, value = (jnp.asarray(x) for x in (query, key, value))
  unbatched = query.ndim == 3
  q, k, v = (x[None] if x.ndim == 3 else x for x in (query, key, value))
  dims = shapes.check_qkv(q, k, v)
  bias = _broadcast_operand("bias", bias, dims)
  mask = _broadcast_operand("mask", mask, dims)
  q_lens = seq_lengths("query_seq_lengths", query_seq_lengths, dims.B, dims.T)
  kv_lens = seq_lengths("key_value_seq_lengths", key_value_seq_lengths, dims.B, dims.S)
  features = _features(segment_ids, sinks, alibi_slopes, dims, unbatched)
  config = AttentionConfig(
      scale=(shapes.default_scale(dims.H) if scale is None
             else shapes.static_float("scale", scale)),
      is_causal=shapes.static_bool("is_causal", is_causal),
      window=shapes.normalize_window(local_window_size),
      softcap=(None if logits_soft_cap is None else
               shapes.static_float("logits_soft_cap", logits_soft_cap,
                                   positive=True, max_value=shapes.MAX_SOFTCAP)),
      has_bias=bias is not None, has_mask=mask is not None,
      has_q_lens=q_lens is not None, has_kv_lens=kv_lens is not None,
      has_segment_ids=features.q_segment_ids is not None,
      has_sinks=features.sinks is not None, has_alibi=features.alibi_slopes is not None,
      implementation=requested_implementation(implementation, q.dtype),
      deterministic=shapes.static_bool("deterministic", deterministic))
  return config, (q, k, v, bias, mask, q_lens, kv_lens,
                  features if config.has_features else None)


def _features(segment_ids, sinks, alibi_slopes, dims, unbatched) -> shapes.Features:
  """The training features' arguments as the primitive takes them: segment
  ids (B, T) and (B, S) int32, sinks and slopes (B|1, N) float32.

  Raises:
    ValueError: a shape that does not fit, or one array of ids with T != S.
    TypeError: ids that are not integers, sinks or slopes not floating point.
  """
  def ids(name, x, length):
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise TypeError(f"{name} must be an integer array, got {x.dtype}")
    want = (length,) if unbatched else (dims.B, length)
    if x.shape != want:
      raise ValueError(f"{name} must have shape {want} (query {(dims.B, dims.T, dims.N, dims.H)},"
                       f" key {(dims.B, dims.S, dims.K, dims.H)}), got {x.shape}")
    return x.astype(jnp.int32).reshape(dims.B, length)

  q_ids = kv_ids = None
  if segment_ids is not None:
    if isinstance(segment_ids, (tuple, list)):
      if len(segment_ids) != 2:
        raise ValueError("segment_ids must be one array or a pair (q_segment_ids, "
                         f"kv_segment_ids), got {len(segment_ids)} items")
      q_ids = ids("q_segment_ids", segment_ids[0], dims.T)
      kv_ids = ids("kv_segment_ids", segment_ids[1], dims.S)
    else:
      if dims.T != dims.S:
        raise ValueError(f"segment_ids as one array needs T == S, got T={dims.T}, S={dims.S}: "
                         "pass a pair (q_segment_ids, kv_segment_ids)")
      q_ids = kv_ids = ids("segment_ids", segment_ids, dims.T)

  def per_head(name, x, allow_batch):
    if x is None:
      return None
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{name} must be a floating-point array, got {x.dtype}")
    shapes_ok = [(dims.N,)] + ([] if not allow_batch or unbatched else [(dims.B, dims.N)])
    if x.shape not in shapes_ok:
      raise ValueError(f"{name} must have shape {' or '.join(map(str, shapes_ok))} (N = "
                       f"{dims.N} query heads), got {x.shape}")
    return x.astype(jnp.float32).reshape(-1, dims.N)

  return shapes.Features(q_ids, kv_ids, per_head("sinks", sinks, False),
                         per_head("alibi_slopes", alibi_slopes, True))


def run_config(config: AttentionConfig, q, k, v, bias=None, mask=None, q_lens=None,
               kv_lens=None, features=None, block_table=None, k_scale=None, v_scale=None):
  """Attention on checked 4-D operands by ``config`` (any path but "cudnn"); (out, lse).

  With ``block_table`` (and ``config.has_block_table``), k and v are pools of
  pages (``shapes.check_paged``); with ``k_scale`` and ``v_scale`` (and
  ``config.has_kv_scales``) a quantized cache (``shapes.check_kv_scales``);
  no bias, mask or query lengths then.
  """
  if block_table is not None or k_scale is not None:
    if config.implementation == "xla" or q.dtype == jnp.float64:
      k, v = plain_kv(k, v, block_table, k_scale, v_scale, q.dtype)
      return attention_reference(config, q, k, v, None, None, None, kv_lens)
    return _fused_cache(config, q, k, v, kv_lens, block_table, k_scale, v_scale)
  if config.implementation == "xla":
    return attention_reference(config, q, k, v, bias, mask, q_lens, kv_lens, features)
  if bias is not None and bias.dtype == jnp.float64 and q.dtype != jnp.float64:
    bias = bias.astype(jnp.float32)
  return _fused(config, q, k, v, bias, mask, q_lens, kv_lens, features)


def _broadcast_operand(name, x, dims):
  """A bias or mask as 4-D (B|1, N|1, T|1, S|1); missing leading dims become 1 (as in jax.nn)."""
  if x is None:
    return None
  x = jnp.asarray(x)
  x = x.reshape((1,) * (4 - x.ndim) + x.shape)
  shapes.check_broadcast_operand(name, x, dims)
  return x


def seq_lengths(name, lengths, B, limit=None):
  """``lengths`` as a (B,) int32 array (None stays None).

  Concrete values must lie in [0, ``limit``] (the sequence's length, T or
  S); traced ones (under jit) cannot be checked at trace time, and the
  kernels clamp them to that range.

  Raises:
    TypeError: not an integer dtype. ValueError: not of shape (B,), or
      concrete values outside [0, limit].
  """
  if lengths is None:
    return None
  lengths = jnp.asarray(lengths)
  if not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise TypeError(f"{name} must be an integer array of shape (B,), got {lengths.dtype}")
  lengths = lengths.astype(jnp.int32)
  shapes.check_seq_lengths(name, lengths, B)
  if limit is not None and not isinstance(lengths, jax.core.Tracer):
    values = np.asarray(lengths)
    if values.size and (values.min() < 0 or values.max() > limit):
      raise ValueError(f"{name} must lie in [0, {limit}], got {values.tolist()}")
  return lengths


def requested_implementation(implementation, dtype) -> str:
  """Checks ``implementation``; returns it, or "auto" for None.

  Whether a fused path fits the platform is checked when the computation is
  lowered: only then is its platform known (arrays may sit on the CPU of a GPU
  host).
  """
  if implementation is None:
    return "auto"
  backends.check_name(implementation)
  if implementation in backends.FUSED_PATHS and dtype == jnp.float64:
    raise TypeError(
        f"implementation={implementation!r} computes in float32, float16 or "
        f"bfloat16, got float64 inputs; use implementation=None or 'xla'")
  return implementation


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(config, q, k, v, bias, mask, q_lens, kv_lens, features):
  """The fused path; float64 inputs take the reference math under the same VJP."""
  if q.dtype == jnp.float64:
    return attention_reference(config, q, k, v, bias, mask, q_lens, kv_lens, features)
  return primitive.bind(config, *_operands(q, k, v, bias, mask, q_lens, kv_lens, features))


def _operands(q, k, v, bias, mask, q_lens, kv_lens, features):
  """The primitive's operands: the present ones, in ``AttentionConfig``'s order."""
  present = [x for x in (q, k, v, bias, mask, q_lens, kv_lens) if x is not None]
  return present + ([] if features is None else features.operands())


def _fused_fwd(config, q, k, v, bias, mask, q_lens, kv_lens, features):
  """FlashAttention-2's residuals: the operands, out and lse, from a forward
  whose logits the backward recomputes (``AttentionConfig.for_backward``).
  For 16-bit inputs the kernel writes out in float32
  (``AttentionConfig.float32_out``): the primal is rounded from it and the
  backward's D reduced from it."""
  args = (q, k, v, bias, mask, q_lens, kv_lens, features)
  if q.dtype == jnp.float64:
    out, lse = _fused(config, *args)
    return (out, lse), (args, out, lse)
  out, lse = primitive.bind(dataclasses.replace(config, for_backward=True,
                                                float32_out=q.dtype != jnp.float32),
                            *_operands(*args))
  return (out.astype(q.dtype), lse), (args, out, lse)


def _fused_bwd(config, residuals, cotangents):
  """dq, dk, dv from the path's backward; the bias's and ALiBi slopes'
  gradients (dS summed over their broadcast dims) from the reference math,
  which materializes B x N x T x S: under jit, XLA drops it where they are
  not differentiated. The sinks' from the LSE: dsink = -sum over rows of
  exp(sink - LSE) D, D = rowsum(dO o O) - dLSE (the sink's probability
  times the cotangent of its logit, which feeds only the denominator)."""
  args, out, lse = residuals
  q, k, v, bias, mask, q_lens, kv_lens, features = args
  d_out, d_lse = cotangents
  sinks = None if features is None else features.sinks
  slopes = None if features is None else features.alibi_slopes

  def with_terms(sinks, slopes):
    return None if features is None else features._replace(sinks=sinks, alibi_slopes=slopes)

  if q.dtype == jnp.float64:
    forward = lambda q, k, v, bias, sinks, slopes: attention_reference(
        config, q, k, v, bias, mask, q_lens, kv_lens, with_terms(sinks, slopes))
    _, vjp = jax.vjp(forward, q, k, v, bias, sinks, slopes)
    dq, dk, dv, d_bias, d_sinks, d_slopes = vjp((d_out, d_lse))
    return (dq, dk, dv, d_bias, None, None, None, with_terms(d_sinks, d_slopes))
  dq, dk, dv = primitive.bind_backward(config, *_operands(*args), out, lse, d_out,
                                       d_lse.astype(jnp.float32))
  d_bias = d_slopes = None
  if bias is not None or slopes is not None:
    forward = lambda bias, slopes: attention_reference(
        config, q, k, v, bias, mask, q_lens, kv_lens, with_terms(sinks, slopes))
    _, vjp = jax.vjp(forward, bias, slopes)
    d_bias, d_slopes = vjp((d_out, d_lse.astype(lse.dtype)))
  d_sinks = None
  if sinks is not None:
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1) - d_lse
    d_sinks = -jnp.sum(jnp.exp(sinks[:, None, :] - lse) * delta, axis=1)  # (B, N)
    d_sinks = jnp.sum(d_sinks, axis=0, keepdims=True) if sinks.shape[0] == 1 else d_sinks
  return dq, dk, dv, d_bias, None, None, None, with_terms(d_sinks, d_slopes)


_fused.defvjp(_fused_fwd, _fused_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused_cache(config, q, k, v, kv_lens, block_table, k_scale, v_scale):
  """The fused path over a paged and/or quantized cache (read in place where
  the path's kernel can)."""
  operands = (q, k, v, kv_lens, block_table, k_scale, v_scale)
  return primitive.bind(config, *(x for x in operands if x is not None))


def _fused_cache_fwd(config, *operands):
  return _fused_cache(config, *operands), operands


def _fused_cache_bwd(config, residuals, cotangents):
  """The gradients of the same attention over the gathered and dequantized
  cache (the contiguous path's backward): a page's are the gathered ones
  added back into it; a quantized cache's go to its scales (its integer or
  float8 values get none)."""
  q, k, v, kv_lens, block_table, k_scale, v_scale = residuals
  contiguous = dataclasses.replace(config, has_block_table=False, has_kv_scales=False)
  quantized = k_scale is not None

  def forward(q, k_or_scale, v_or_scale):
    if quantized:
      plain = plain_kv(k, v, block_table, k_or_scale, v_or_scale, q.dtype)
    else:
      plain = plain_kv(k_or_scale, v_or_scale, block_table, None, None, q.dtype)
    return _fused(contiguous, q, *plain, None, None, None, kv_lens, None)

  _, vjp = jax.vjp(forward, q, *((k_scale, v_scale) if quantized else (k, v)))
  dq, dk, dv = vjp(cotangents)
  if quantized:
    return dq, None, None, None, None, dk, dv
  return dq, dk, dv, None, None, None, None


_fused_cache.defvjp(_fused_cache_fwd, _fused_cache_bwd)


@dataclasses.dataclass(frozen=True)
class Explanation:
  """Which paths serve a ``fast_attention`` call and its gradient, and why
  (``explain``).

  Attributes:
    platform: the JAX platform the call was explained for ("cpu", "cuda").
    forward: the forward's path: a name of ``implementations()``.
    forward_reason: why that path serves.
    backward: the gradient's path: the forward's own name where it has a
      fused backward for the call, "xla" (XLA's autodiff of the reference
      math), "cudnn", or "blockwise" (the reference math over blocks of query
      rows, ``reference.attention_grads``).
    backward_reason: why.
    kernel: the CUDA kernel variant of the forward (e.g. "sm80 H=128
      bf16->bf16"), None on other paths.
  """

  platform: str
  forward: str
  forward_reason: str
  backward: str
  backward_reason: str
  kernel: str | None = None

  def __str__(self) -> str:
    kernel = f" [{self.kernel}]" if self.kernel else ""
    return (f"on {self.platform}:\n  forward:  {self.forward}{kernel}: {self.forward_reason}\n"
            f"  backward: {self.backward}: {self.backward_reason}")


def explain(query, key, value, bias=None, mask=None, *, backend=None, **kwargs) -> Explanation:
  """Says which path ``fast_attention(query, key, value, bias, mask, **kwargs)``
  would take, forward and backward, and why; runs nothing.

  The choice is the one the lowering makes (``backends.choose_forward`` and
  ``choose_backward``, where the library logs it once per process too).

  Args:
    query, key, value, bias, mask: as for ``fast_attention``: arrays, or
      anything with ``shape`` and ``dtype`` (``jax.ShapeDtypeStruct``), since
      only shapes and dtypes are read.
    backend: the JAX platform the call would run on ("cpu", "cuda");
      default ``jax.default_backend()``.
    **kwargs: ``fast_attention``'s keyword arguments (``is_causal``,
      ``key_value_seq_lengths``, ``implementation``, ...); lengths, segment
      ids, sinks and slopes may be ``ShapeDtypeStruct`` too.

  Returns:
    An ``Explanation``; ``print`` it for a two-line summary.

  Raises:
    ValueError, TypeError: as ``fast_attention`` would for these arguments,
      and as ``resolve_implementation`` for a path the platform cannot run.
  """
  unknown = set(kwargs) - _KEYWORDS
  if unknown:
    raise TypeError(f"explain: unexpected keyword arguments {sorted(unknown)}; it takes "
                    f"fast_attention's: {sorted(_KEYWORDS)}")
  arrays = {name: kwargs.pop(name, None) for name in _ARRAY_KEYWORDS}
  kwargs.pop("return_residual", None)
  prepared = {}

  def trace(query, key, value, bias, mask, arrays):
    prepared["config"], operands = _prepare(query, key, value, bias, mask, **arrays,
                                            **_defaults(kwargs))
    prepared["q"], prepared["k"] = operands[:2]
    return ()

  jax.eval_shape(trace, query, key, value, bias, mask, arrays)
  config, q, k = prepared["config"], prepared["q"], prepared["k"]
  platform = backends.platform_of(backend)
  if config.implementation == "cudnn":
    return Explanation(platform, "cudnn", "requested: jax.nn.dot_product_attention's cuDNN "
                       "kernel", "cudnn", "cuDNN's backward, through jax.nn")
  if config.implementation == "xla" or q.dtype == jnp.float64:
    why = ("requested" if config.implementation == "xla"
           else "float64 inputs are served by the reference math")
    return Explanation(platform, "xla", why + " (materializes B x N x T x S logits)", "xla",
                       "XLA's autodiff of the reference math")
  requested = None if config.implementation == "auto" else config.implementation
  forward, forward_reason = backends.choose_forward(requested, platform, q.dtype, q.shape[-1])
  backward, backward_reason = backends.choose_backward(forward, config, q.shape, k.shape,
                                                       q.dtype)
  if config.has_bias or config.has_alibi:
    backward_reason += ("; a differentiated bias or ALiBi slopes get their gradient from the "
                        "reference math (materializes B x N x T x S)")
  kernel = None
  if forward in backends.cuda.IMPLEMENTATIONS:
    plan = backends.cuda.plan(forward, config, q.shape, k.shape, q.dtype, config.has_bias,
                              config.has_mask, config.has_q_lens)
    kernel = backends.cuda.describe_variant(plan)
  if config.has_features:
    forward_reason += ("; with " + ", ".join(
        name for name, on in (("segment ids", config.has_segment_ids),
                              ("sinks", config.has_sinks), ("ALiBi", config.has_alibi)) if on)
        + " computed per tile")
  return Explanation(platform, forward, forward_reason, backward, backward_reason, kernel)


#: ``fast_attention``'s keyword arguments, and their defaults.
_KEYWORDS = frozenset(inspect.signature(fast_attention).parameters) - {
    "query", "key", "value", "bias", "mask"}


def _defaults(kwargs):
  """``_prepare``'s keyword arguments: ``kwargs`` over ``fast_attention``'s defaults."""
  params = inspect.signature(fast_attention).parameters
  return {name: kwargs.get(name, params[name].default) for name in _KEYWORDS
          if name not in _ARRAY_KEYWORDS + ("return_residual",)}


#: ``fast_attention``'s keyword arguments that take arrays.
_ARRAY_KEYWORDS = ("query_seq_lengths", "key_value_seq_lengths", "segment_ids", "sinks",
                   "alibi_slopes")
