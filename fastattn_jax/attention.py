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
                   logits_soft_cap=None, return_residual=False,
                   implementation=None, deterministic=False):
  r"""Scaled dot-product attention, fused: a drop-in for ``jax.nn.dot_product_attention``.

  Computes, per batch b and query head n (reading key/value head
  ``n // (N // K)``)::

    logits = scale * Q K^T              (float32 accumulation)
    logits = c * tanh(logits / c)       if logits_soft_cap = c
    logits = logits + bias              if bias is given
    out    = softmax(logits over the visible keys) V

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
    ValueError: on shapes that do not fit (named with their shapes), negative
      window sizes, non-positive soft caps, a scale or soft cap that float32
      does not represent, concrete sequence lengths out of range, an unknown
      implementation or one that cannot run on the current platform or GPU,
      or H > 256 on a CUDA path.
    RuntimeError: (at the first run on a GPU) when no NVRTC can compile the
      kernel; the message says what to install.
    TypeError: on dtypes that do not fit, or traced values where static ones
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
      implementation=implementation, deterministic=deterministic)
  out_shape = jnp.shape(query)
  if config.implementation == "cudnn":
    if config.softcap is not None:
      raise ValueError("implementation='cudnn' does not support logits_soft_cap")
    q_lens, kv_lens = operands[-2:]
    return jax.nn.dot_product_attention(
        query, key, value, bias, mask, scale=config.scale, is_causal=config.is_causal,
        query_seq_lengths=q_lens, key_value_seq_lengths=kv_lens,
        local_window_size=config.window, implementation="cudnn",
        return_residual=return_residual)
  out, lse = run_config(config, *operands)
  out = out.reshape(out_shape)
  return (out, jax.lax.stop_gradient(lse.reshape(out_shape[:-1]))) if return_residual else out


def _prepare(query, key, value, bias, mask, *, scale, is_causal, query_seq_lengths,
             key_value_seq_lengths, local_window_size, logits_soft_cap, implementation,
             deterministic):
  """Checks ``fast_attention``'s arguments; returns its ``AttentionConfig`` and
  the operands (q, k, v 4-D; bias and mask 4-D; lengths (B,) int32; absent
  ones None)."""
  query, key, value = (jnp.asarray(x) for x in (query, key, value))
  q, k, v = (x[None] if x.ndim == 3 else x for x in (query, key, value))
  dims = shapes.check_qkv(q, k, v)
  bias = _broadcast_operand("bias", bias, dims)
  mask = _broadcast_operand("mask", mask, dims)
  q_lens = seq_lengths("query_seq_lengths", query_seq_lengths, dims.B, dims.T)
  kv_lens = seq_lengths("key_value_seq_lengths", key_value_seq_lengths, dims.B, dims.S)
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
      implementation=requested_implementation(implementation, q.dtype),
      deterministic=shapes.static_bool("deterministic", deterministic))
  return config, (q, k, v, bias, mask, q_lens, kv_lens)


def run_config(config: AttentionConfig, q, k, v, bias=None, mask=None, q_lens=None,
               kv_lens=None, block_table=None, k_scale=None, v_scale=None):
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
    return attention_reference(config, q, k, v, bias, mask, q_lens, kv_lens)
  if bias is not None and bias.dtype == jnp.float64 and q.dtype != jnp.float64:
    bias = bias.astype(jnp.float32)
  return _fused(config, q, k, v, bias, mask, q_lens, kv_lens)


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
def _fused(config, q, k, v, bias, mask, q_lens, kv_lens):
  """The fused path; float64 inputs take the reference math under the same VJP."""
  if q.dtype == jnp.float64:
    return attention_reference(config, q, k, v, bias, mask, q_lens, kv_lens)
  operands = [x for x in (q, k, v, bias, mask, q_lens, kv_lens) if x is not None]
  return primitive.bind(config, *operands)


def _fused_fwd(config, q, k, v, bias, mask, q_lens, kv_lens):
  """FlashAttention-2's residuals: the operands, out and lse, from a forward
  whose logits the backward recomputes (``AttentionConfig.for_backward``).
  For 16-bit inputs the kernel writes out in float32
  (``AttentionConfig.float32_out``): the primal is rounded from it and the
  backward's D reduced from it."""
  if q.dtype == jnp.float64:
    out, lse = _fused(config, q, k, v, bias, mask, q_lens, kv_lens)
    return (out, lse), ((q, k, v, bias, mask, q_lens, kv_lens), out, lse)
  operands = [x for x in (q, k, v, bias, mask, q_lens, kv_lens) if x is not None]
  out, lse = primitive.bind(dataclasses.replace(config, for_backward=True,
                                                float32_out=q.dtype != jnp.float32), *operands)
  return ((out.astype(q.dtype), lse),
          ((q, k, v, bias, mask, q_lens, kv_lens), out, lse))


def _fused_bwd(config, residuals, cotangents):
  """dq, dk, dv from the path's backward; the bias's gradient (dS summed over
  its broadcast dims) from the reference math, which materializes B x N x T x
  S: under jit, XLA drops it where the bias is not differentiated."""
  args, out, lse = residuals
  q, k, v, bias, mask, q_lens, kv_lens = args
  d_out, d_lse = cotangents
  if q.dtype == jnp.float64:
    forward = lambda q, k, v, bias: attention_reference(
        config, q, k, v, bias, mask, q_lens, kv_lens)
    _, vjp = jax.vjp(forward, q, k, v, bias)
    return (*vjp((d_out, d_lse)), None, None, None)
  operands = [x for x in args if x is not None]
  dq, dk, dv = primitive.bind_backward(config, *operands, out, lse, d_out,
                                       d_lse.astype(jnp.float32))
  d_bias = None
  if bias is not None:
    forward = lambda bias: attention_reference(config, q, k, v, bias, mask, q_lens, kv_lens)
    _, vjp = jax.vjp(forward, bias)
    (d_bias,) = vjp((d_out, d_lse.astype(lse.dtype)))
  return dq, dk, dv, d_bias, None, None, None


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
    return _fused(contiguous, q, *plain, None, None, None, kv_lens)

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
      ``key_value_seq_lengths``, ``implementation``, ...); lengths may be
      ``ShapeDtypeStruct`` too.

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
  lengths = {name: kwargs.pop(name, None)
             for name in ("query_seq_lengths", "key_value_seq_lengths")}
  kwargs.pop("return_residual", None)
  prepared = {}

  def trace(query, key, value, bias, mask, lengths):
    prepared["config"], operands = _prepare(query, key, value, bias, mask, **lengths,
                                            **_defaults(kwargs))
    prepared["q"], prepared["k"] = operands[:2]
    return ()

  jax.eval_shape(trace, query, key, value, bias, mask, lengths)
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
  if config.has_bias:
    backward_reason += ("; a differentiated bias gets its gradient from the reference math "
                        "(materializes B x N x T x S)")
  kernel = None
  if forward in backends.cuda.IMPLEMENTATIONS:
    plan = backends.cuda.plan(forward, config, q.shape, k.shape, q.dtype, config.has_bias,
                              config.has_mask, config.has_q_lens)
    kernel = backends.cuda.describe_variant(plan)
  return Explanation(platform, forward, forward_reason, backward, backward_reason, kernel)


#: ``fast_attention``'s keyword arguments, and their defaults.
_KEYWORDS = frozenset(inspect.signature(fast_attention).parameters) - {
    "query", "key", "value", "bias", "mask"}


def _defaults(kwargs):
  """``_prepare``'s keyword arguments: ``kwargs`` over ``fast_attention``'s defaults."""
  params = inspect.signature(fast_attention).parameters
  return {name: kwargs.get(name, params[name].default) for name in _KEYWORDS
          if name not in ("query_seq_lengths", "key_value_seq_lengths", "return_residual")}
