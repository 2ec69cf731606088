"""Helpers of the test suite: random inputs, a float64 reference, the
acceptance rule.

The reference here is written from the definition in numpy float64 and is
deliberately independent of ``fastattn_jax.reference`` (the "xla" path, which
is itself under test). Semantics (``fast_attention``'s docstring):

  logits = scale * q k^T; softcap c: c * tanh(logits / c); + bias;
  visible(i, j) = mask & (j <= i if causal) & (i - left <= j <= i + right)
                  & (i < q_len[b]) & (j < kv_len[b]);
  out = softmax over visible keys @ v; rows with no visible key: out 0,
  lse -inf.

Acceptance rule (the issue's): for output and LSE,
  max|fast - ref64| <= 2 * max|xla_same_dtype - ref64| + atol[dtype].
"""

from __future__ import annotations

import os
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np

import fastattn_jax
from fastattn_jax import ascend, cuda, fast_attention

#: The path under test; None lets the library choose for the platform.
IMPL = os.environ.get("FASTATTN_TEST_IMPLEMENTATION") or None

DTYPES = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}

#: atol of the acceptance rule on the output, per dtype: about one ulp of
#: outputs of size ~1 (the rounding of the result to the dtype alone costs
#: half an ulp, and the xla path pays it too).
OUT_ATOL = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 1e-2}
#: atol on the float32 LSE (every dtype accumulates logits in float32).
LSE_ATOL = {"float32": 2e-5, "float16": 5e-5, "bfloat16": 5e-5}
#: Sanity bound on the xla path itself (it anchors the rule; if it drifted
#: the rule would loosen): its error against the float64 reference.
XLA_MAX_ERR = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}
#: Agreement with jax.nn.dot_product_attention on rows with a visible key:
#: jax.nn rounds the probabilities to the input dtype before P @ V.
JAXNN_TOL = {"float32": 2e-5, "float16": 5e-3, "bfloat16": 5e-2}


def dtype_name(x) -> str:
  return np.dtype(x.dtype).name


def seed_of(text: str) -> int:
  return zlib.crc32(text.encode())


def has_gpu() -> bool:
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


def fresh_process_env(**overrides) -> dict:
  """The environment for a fresh Python process that must import the
  fastattn_jax under test, wherever it came from (an install, or a checkout
  whose extension was built or copied in place and which pytest's
  ``pythonpath`` put first): its parent folder first on PYTHONPATH."""
  root = os.path.dirname(os.path.dirname(fastattn_jax.__file__))
  path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
  return {**os.environ, "PYTHONPATH": path, **overrides}


# --- inputs ------------------------------------------------------------------

def qkv(rng, B, T, S, N, K, H, dtype=jnp.float32, batch=True):
  """Random normal query (B,T,N,H), key and value (B,S,K,H) (no B if not batch)."""
  lead = (B,) if batch else ()
  make = lambda *shape: jnp.asarray(rng.standard_normal(lead + shape), dtype)
  return make(T, N, H), make(S, K, H), make(S, K, H)


def random_bias(rng, shape, dtype=jnp.float32):
  return jnp.asarray(rng.standard_normal(shape), dtype)


def random_ids(rng, B, L, segments, order):
  """(B, L) int32 ids of 1 to ``segments`` runs of random lengths (length 1
  included); ``order``: "sorted" (packed documents), "shuffled" (runs in
  random id order, ids reappearing later in the row) or "scattered" (each
  position's id drawn at random)."""
  ids = np.zeros((B, L), np.int32)
  for b in range(B):
    cuts = np.sort(rng.choice(np.arange(1, L), size=min(segments, L) - 1, replace=False)) \
        if L > 1 and segments > 1 else np.array([], int)
    runs = np.split(np.arange(L), cuts)
    if order == "scattered":
      ids[b] = rng.integers(0, segments, L)
      continue
    labels = np.arange(len(runs)) if order == "sorted" else rng.integers(0, 3, len(runs))
    for run, label in zip(runs, labels):
      ids[b, run] = 10 * label + 3  # not from 0, not contiguous values
  return ids


def random_mask(rng, shape, p_true=0.7):
  return jnp.asarray(rng.random(shape) < p_true)


def lengths(values):
  return jnp.asarray(values, jnp.int32)


# --- float64 reference ----------------------------------------------------------

def _f64(x):
  return None if x is None else np.asarray(x).astype(np.float64)


def _as_4d(x):
  return x.reshape((1,) * (4 - x.ndim) + x.shape)


def _reference64_rows(query, key, value, bias, mask, scale, is_causal, query_seq_lengths,
                      key_value_seq_lengths, local_window_size, logits_soft_cap, block_elems,
                      sinks=None):
  """The float64 definition's pieces, block by block: yields (b, n, rows, q
  rows, key and value head, scaled logits before the soft cap, final logits
  with the hidden ones at -inf, visibility, softmax P with zero rows where
  nothing is visible, LSE). q, k, v: 4-D numpy float64. ``sinks`` (B|1, N):
  an extra logit per row with a value row of zeros (P sums to less than 1,
  LSE counts it; a row that sees no key gets LSE = sink)."""
  q, k, v = query, key, value
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  G = N // K
  scale = 1.0 / np.sqrt(H) if scale is None else float(scale)
  full = (B, N, T, S)
  bias4 = None if bias is None else np.broadcast_to(_as_4d(_f64(bias)), full)
  mask4 = None if mask is None else np.broadcast_to(_as_4d(np.asarray(mask)), full)
  if isinstance(local_window_size, int):
    local_window_size = (local_window_size, local_window_size)
  ql = None if query_seq_lengths is None else np.asarray(query_seq_lengths)
  kl = None if key_value_seq_lengths is None else np.asarray(key_value_seq_lengths)
  j = np.arange(S)[None, :]
  rows = max(1, block_elems // max(S, 1))
  for b in range(B):
    for n in range(N):
      kb, vb = k[b, :, n // G], v[b, :, n // G]
      for r0 in range(0, T, rows):
        r1 = min(T, r0 + rows)
        i = np.arange(r0, r1)[:, None]
        x = (q[b, r0:r1, n] @ kb.T) * scale
        s = x
        if logits_soft_cap is not None:
          s = logits_soft_cap * np.tanh(x / logits_soft_cap)
        if bias4 is not None:
          s = s + bias4[b, n, r0:r1]
        vis = np.ones((r1 - r0, S), bool)
        if mask4 is not None:
          vis &= mask4[b, n, r0:r1]
        if is_causal:
          vis &= j <= i
        if local_window_size is not None:
          left, right = local_window_size
          vis &= (j >= i - left) & (j <= i + right)
        if ql is not None:
          vis &= i < ql[b]
        if kl is not None:
          vis &= j < kl[b]
        s = np.where(vis, s, -np.inf)
        has = vis.any(axis=1)
        m = np.where(has, s.max(axis=1, initial=-np.inf), 0.0)[:, None]
        if sinks is not None:
          sink = float(np.asarray(sinks, np.float64)[b % len(sinks), n])
          m = np.maximum(np.where(has[:, None], m, -np.inf), sink)
        p = np.where(vis, np.exp(s - m), 0.0)
        l = p.sum(axis=1)
        if sinks is not None:
          l = l + np.exp(sink - m[:, 0])
          has = np.ones_like(has)
        l_safe = np.where(has, l, 1.0)
        yield b, n, slice(r0, r1), kb, vb, x, s, vis, p / l_safe[:, None], m[:, 0] + np.log(l_safe)


def reference64(query, key, value, bias=None, mask=None, *, scale=None,
                is_causal=False, query_seq_lengths=None,
                key_value_seq_lengths=None, local_window_size=None,
                logits_soft_cap=None, sinks=None, block_elems=1 << 21):
  """Attention by the definition in float64; returns (out, lse) as numpy.

  Works on (B,T,N,H) or (T,N,H) inputs; bias/mask of any rank <= 4
  broadcastable to (B,N,T,S). Computes (b, n, block of rows) at a time so a
  4096 x 4096 problem needs only ``block_elems`` logits in memory.
  """
  q, k, v = _f64(query), _f64(key), _f64(value)
  three_d = q.ndim == 3
  if three_d:
    q, k, v = q[None], k[None], v[None]
  B, T, N, H = q.shape
  out = np.zeros((B, T, N, H))
  lse = np.full((B, T, N), -np.inf)
  for b, n, rows, _, vb, _, _, vis, p, lse_rows in _reference64_rows(
      q, k, v, bias, mask, scale, is_causal, query_seq_lengths, key_value_seq_lengths,
      local_window_size, logits_soft_cap, block_elems, sinks):
    has = vis.any(axis=1) | (sinks is not None)
    out[b, rows, n] = p @ vb
    lse[b, rows, n] = np.where(has, lse_rows, -np.inf)
  if three_d:
    out, lse = out[0], lse[0]
  return out, lse


def reference64_grads(query, key, value, d_out, bias=None, mask=None, *, scale=None,
                      is_causal=False, query_seq_lengths=None, key_value_seq_lengths=None,
                      local_window_size=None, logits_soft_cap=None, sinks=None,
                      block_elems=1 << 21, with_sinks=False):
  """The gradients of sum(out * d_out) by the definition in float64, written
  out (FlashAttention-2's backward, Dao 2023, Algorithm 2, without tiles):
  dV = P^T dO, dS = P (dO V^T - rowsum(dO O)), through the soft cap's tanh,
  dQ = scale dS K, dK = scale dS^T Q; GQA heads summed into their key/value
  head. Returns numpy (dq, dk, dv, dbias) shaped as the inputs (4-D;
  dbias summed over bias's broadcast dims, None without bias); with
  ``with_sinks`` also dsinks shaped as ``sinks``: the sink's logit has dP =
  0 (a value row of zeros), so its dS is -P_sink rowsum(dO O)."""
  q, k, v, do = _f64(query), _f64(key), _f64(value), _f64(d_out)
  B, T, N, H = q.shape
  K = k.shape[2]
  G = N // K
  scale_ = 1.0 / np.sqrt(H) if scale is None else float(scale)
  dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
  dbias = None if bias is None else np.zeros((B, N, T, k.shape[1]))
  dsinks = None if sinks is None else np.zeros((B, N))
  for b, n, rows, kb, vb, x, _, _, p, lse in _reference64_rows(
      q, k, v, bias, mask, scale, is_causal, query_seq_lengths, key_value_seq_lengths,
      local_window_size, logits_soft_cap, block_elems, sinks):
    dor = do[b, rows, n]
    dv[b, :, n // G] += p.T @ dor
    delta = np.sum(dor * (p @ vb), axis=1, keepdims=True)
    ds = p * (dor @ vb.T - delta)
    if dsinks is not None:
      sink = float(np.asarray(sinks, np.float64)[b % len(sinks), n])
      dsinks[b, n] -= np.sum(np.exp(sink - lse) * delta[:, 0])
    if dbias is not None:
      dbias[b, n, rows] = ds
    if logits_soft_cap is not None:
      ds = ds * (1 - np.tanh(x / logits_soft_cap) ** 2)
    dq[b, rows, n] = scale_ * ds @ kb
    dk[b, :, n // G] += scale_ * ds.T @ q[b, rows, n]
  if dbias is not None:
    shape = _as_4d(np.asarray(bias)).shape
    dbias = dbias.sum(axis=tuple(a for a in range(4) if shape[a] == 1), keepdims=True)
  if with_sinks:
    if dsinks is not None and len(sinks) == 1:
      dsinks = dsinks.sum(axis=0, keepdims=True)
    return dq, dk, dv, dbias, dsinks
  return dq, dk, dv, dbias


# --- comparisons --------------------------------------------------------------

def max_err(x, ref, where=None):
  """max |x - ref| over finite entries of ref (and ``where``), in float64."""
  x = np.asarray(x).astype(np.float64)
  sel = np.isfinite(ref) if where is None else (np.isfinite(ref) & where)
  if not sel.any():
    return 0.0
  return float(np.max(np.abs(x[sel] - ref[sel]))) if np.isfinite(x[sel]).all() else np.inf


def assert_accepted(fast, xla, ref, atol, xla_max, what):
  """The acceptance rule, plus: finite where ref is, -inf exactly where ref is."""
  fast64 = np.asarray(fast).astype(np.float64)
  finite = np.isfinite(ref)
  bad = ~np.isfinite(fast64[finite])
  assert not bad.any(), (
      f"{what}: {bad.sum()} non-finite values where the reference is finite, "
      f"first at {np.argwhere(finite)[np.argmax(bad)]}")
  assert np.array_equal(np.isneginf(fast64), np.isneginf(ref)), (
      f"{what}: -inf at {np.argwhere(np.isneginf(fast64) != np.isneginf(ref))[:5]} "
      f"disagrees with the reference")
  err_fast, err_xla = max_err(fast64, ref), max_err(xla, ref)
  assert err_xla <= xla_max, (
      f"{what}: the xla path itself is off the float64 reference by {err_xla:.3g} "
      f"(> {xla_max:.3g}); the acceptance rule would be meaningless")
  assert err_fast <= 2 * err_xla + atol, (
      f"{what}: max|fast - ref64| = {err_fast:.3g} > 2 * max|xla - ref64| "
      f"({err_xla:.3g}) + atol ({atol:.3g})")
  return err_fast, err_xla


def visible_rows(ref_lse):
  """Rows (b, t, n) with at least one visible key."""
  return np.isfinite(ref_lse)


def check_call(q, k, v, bias=None, mask=None, *, implementation=None,
               compare_jax_nn=True, jit=True, **opts):
  """Runs ``fast_attention`` (implementation under test) and the xla path on
  the same inputs; checks output and LSE against the float64 reference under
  the acceptance rule and, where jax.nn supports the call, against
  ``jax.nn.dot_product_attention`` on rows with a visible key.

  Returns (out, lse, ref_out, ref_lse) for further checks.
  """
  name = dtype_name(q)
  out, lse = _run(implementation, jit, q, k, v, bias, mask, opts)
  # A path that rounds the inputs to a narrower dtype for its matrix products
  # (the CUDA kernels: float32 -> float16) is held to the xla path run on
  # inputs rounded the same way.
  computed = computed_dtype(implementation, name)
  xout, xlse = _run("xla", jit, *(x.astype(DTYPES[computed]) for x in (q, k, v)), bias, mask,
                    opts)
  xout = xout.astype(q.dtype)
  assert out.shape == q.shape and out.dtype == q.dtype, (out.shape, out.dtype)
  assert lse.shape == q.shape[:-1] and lse.dtype == jnp.float32, (lse.shape, lse.dtype)
  ref_out, ref_lse = reference64(q, k, v, bias, mask, **opts)
  if computed == name:
    assert_accepted(out, xout, ref_out, OUT_ATOL[name], XLA_MAX_ERR[name], f"output ({name})")
    assert_accepted(lse, xlse, ref_lse, LSE_ATOL[name], LSE_ATOL[name], f"LSE ({name})")
  else:  # the reference sees the unrounded inputs: xla's error includes the rounding
    # of the inputs to ``computed`` and of the output back to ``name``.
    assert_accepted(out, xout, ref_out, max(OUT_ATOL[name], OUT_ATOL[computed]),
                    max(XLA_MAX_ERR[name], 2 * XLA_MAX_ERR[computed]),
                    f"output ({name}, computed in {computed})")
    assert_accepted(lse, xlse, ref_lse, LSE_ATOL[computed], 2 * XLA_MAX_ERR[computed],
                    f"LSE ({name}, computed in {computed})")
  empty = ~np.isfinite(ref_lse)
  assert np.all(np.asarray(out)[empty] == 0), "rows with no visible key must be 0"
  if compare_jax_nn and opts.get("logits_soft_cap") is None:
    # "highest": GPUs would otherwise run jax.nn's float32 matmuls in TF32.
    with jax.default_matmul_precision("highest"):
      nn_out = jax.nn.dot_product_attention(
          q, k, v, bias, mask,
          **{k_: v_ for k_, v_ in opts.items() if k_ != "logits_soft_cap"})
    rows = visible_rows(ref_lse)[..., None] & np.ones(q.shape[-1:], bool)
    tol = max(JAXNN_TOL[name], JAXNN_TOL[computed_dtype(implementation, name)])
    err_nn_ref = max_err(nn_out, ref_out, rows)
    assert err_nn_ref <= tol, (
        f"jax.nn.dot_product_attention is {err_nn_ref:.3g} off the float64 "
        f"reference of this suite (> {tol}): the suite's semantics are wrong")
    diff = np.abs(np.asarray(out, np.float64) - np.asarray(nn_out, np.float64))[rows]
    assert diff.size == 0 or diff.max() <= tol, (
        f"fast_attention vs jax.nn.dot_product_attention: {diff.max():.3g} > {tol}")
  return out, lse, ref_out, ref_lse


def _run(impl, jit, q, k, v, bias, mask, opts):
  f = lambda q, k, v, bias, mask: fast_attention(
      q, k, v, bias, mask, return_residual=True, implementation=impl, **opts)
  if jit:
    f = jax.jit(f)
  return f(q, k, v, bias, mask)


#: Floor of the gradients' rule, relative to the largest reference gradient: a
#: few ulps of the dtype (the gradients are rounded to it; float32 sums rows in
#: another order than XLA's dot does).
GRAD_ATOL = {"float32": 2e-6, "float16": 1e-3, "bfloat16": 8e-3}


def grad_floor(implementation, name: str) -> float:
  """The gradients' rule's floor for ``name`` inputs on ``implementation``:
  that of the dtype the forward multiplies in where it is narrower (the CUDA
  kernels round float32 to float16, and the backward starts from their out
  and LSE)."""
  return max(GRAD_ATOL[name], GRAD_ATOL[computed_dtype(implementation, name)])


def ref_atol(name: str = "float32", implementation=IMPL) -> float:
  """atol of a direct comparison of a moderate-size output with the float64
  reference: 1e-5 for float32, or the atol of the dtype the path actually
  multiplies in (CUDA paths: float16) when that is narrower."""
  return max(OUT_ATOL[name], OUT_ATOL[computed_dtype(implementation, name)] * 3)


#: The grid every kernel path runs (``check_case``): GQA and causal, decode
#: (T = 1), a negative scale, a window, soft cap with bias, mask with lengths.
PATH_GRID = [
    dict(B=2, T=97, S=130, N=4, K=2, H=64, opts=dict(is_causal=True)),
    dict(B=1, T=1, S=1000, N=8, K=1, H=128, opts={}),
    dict(B=2, T=80, S=80, N=2, K=1, H=128, opts=dict(scale=-0.15, is_causal=True)),
    dict(B=3, T=64, S=64, N=2, K=2, H=40, opts=dict(local_window_size=(7, 3))),
    dict(B=2, T=33, S=77, N=2, K=1, H=256, opts=dict(logits_soft_cap=5.0, bias=True)),
    dict(B=2, T=70, S=90, N=3, K=3, H=96,
         opts=dict(mask=True, query_seq_lengths=(70, 9), key_value_seq_lengths=(0, 41))),
]


def check_case(rng, case: dict, dtype: str, implementation):
  """``check_call`` on random inputs of a grid ``case``: B, T, S, N, K, H and
  ``opts`` (fast_attention's options; ``bias=True`` / ``mask=True`` ask for a
  random (B, N, T, S) bias / (B, 1, T, S) mask, lengths are tuples)."""
  opts = dict(case["opts"])
  q, k, v = qkv(rng, case["B"], case["T"], case["S"], case["N"], case["K"], case["H"],
                DTYPES[dtype])
  bias = mask = None
  if opts.pop("bias", False):
    bias = random_bias(rng, (case["B"], case["N"], case["T"], case["S"]))
  if opts.pop("mask", False):
    mask = random_mask(rng, (case["B"], 1, case["T"], case["S"]))
  opts = {k_: (lengths(v_) if k_.endswith("lengths") else v_) for k_, v_ in opts.items()}
  return check_call(q, k, v, bias, mask, implementation=implementation, **opts)


def computed_dtype(implementation, name: str) -> str:
  """The dtype the path's matrix products take inputs of dtype ``name`` in."""
  if implementation in cuda.IMPLEMENTATIONS:
    return cuda.operand_dtype(implementation, name)
  if implementation in ascend.IMPLEMENTATIONS:
    return ascend.operand_dtype(name).name
  return name


# --- HLO --------------------------------------------------------------------

_SHAPE = re.compile(r"\b(?:pred|[suf]\d+|bf16|f8\w*)\[([0-9,]*)\]")


def hlo_shapes(text):
  """All array shapes (tuples of ints) mentioned in an HLO text."""
  return [tuple(int(d) for d in m.group(1).split(",") if d)
          for m in _SHAPE.finditer(text)]


def x64():
  """Context manager enabling float64 (restores the previous setting)."""
  return jax.enable_x64(True)
