"""A small workload for compute-sanitizer: the forward and the fused backward
of each CUDA path on a few odd shapes that touch every edge of the kernels
(T and S off the tiles, query/key lengths, causal and window rules, GQA, bias,
mask and soft cap, the decode kernel's row groups), and the decode kernel's
paged and quantized builds (``decode_attention`` over shuffled pages and
int8 and float8 caches, ragged lengths).

Run under the sanitizer with XLA's platform allocator, so that every buffer is
its own cudaMalloc and an access past one is caught rather than landing in the
allocator's pool::

  XLA_PYTHON_CLIENT_ALLOCATOR=platform compute-sanitizer --tool memcheck \\
      --kernel-name kns=fa_ python3 -m benchmarks.sanitize --paths cuda_sm90

It prints, per case, the path and whether its gradients are finite; a case
whose backward is not fused on a path (its head dim beyond the path's
backward kernels) is skipped there: its gradient is XLA's, not ours.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from fastattn_jax import decode_attention, explain, fast_attention
from fastattn_jax.decode import quantize

#: (B, T, S, N, K, H, AttentionConfig rules, bias, mask, lengths)
CASES = (
    (2, 97, 130, 4, 2, 64, {"is_causal": True}, False, False, False),
    (2, 70, 200, 8, 1, 128, {"window": (37, 5)}, False, False, True),
    (1, 33, 90, 4, 4, 40, {}, False, False, True),
    (2, 65, 129, 4, 2, 96, {"softcap": 20.0}, True, True, True),
    (1, 45, 77, 2, 1, 200, {"is_causal": True}, False, False, True),
    # 64 and 12 query rows per key/value head over long keys: the sm80 and
    # sm90 paths' forward is the decode kernel (row groups sharing a ring).
    (2, 16, 2100, 8, 2, 64, {"softcap": 20.0}, False, False, False),
    (1, 3, 4099, 4, 1, 128, {}, False, False, False),
    # More work blocks than an H100 holds blocks at once (8 row blocks of 32
    # heads): sm_90's persistent forward walks several per block.
    (2, 1000, 1000, 16, 4, 64, {"is_causal": True}, False, False, True),
)

#: fast_attention's name of each AttentionConfig rule above.
KWARGS = {"is_causal": "is_causal", "window": "local_window_size",
          "softcap": "logits_soft_cap"}


def run_case(path, case, dtype) -> str:
  B, T, S, N, K, H, rules, with_bias, with_mask, with_lengths = case
  opts = {KWARGS[name]: value for name, value in rules.items()}
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal(s), dtype)
             for s in ((B, T, N, H), (B, S, K, H), (B, S, K, H)))
  bias = jnp.asarray(rng.standard_normal((1, N, T, S)), dtype) if with_bias else None
  mask = jnp.asarray(rng.random((B, 1, T, S)) > 0.2) if with_mask else None
  lengths = {}
  if with_lengths:
    lengths = {"query_seq_lengths": jnp.asarray([T, T // 2 + 1][:B], jnp.int32),
               "key_value_seq_lengths": jnp.asarray([S - 3, S // 3][:B], jnp.int32)}
  paths = explain(q, k, v, bias, mask, implementation=path, **opts, **lengths)
  if paths.backward != paths.forward:
    return f"H={H} skipped: no fused backward ({paths.backward_reason})"

  def loss(q, k, v):
    out = fast_attention(q, k, v, bias, mask, implementation=path, **opts, **lengths)
    return jnp.sum(out.astype(jnp.float32) ** 2)

  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  jax.block_until_ready(grads)
  finite = all(bool(jnp.all(jnp.isfinite(g))) for g in grads)
  return f"B={B} T={T} S={S} N={N} K={K} H={H} {opts} finite={finite}"


#: (B, T, S, N, K, H, page_size or None, cache dtype) of decode_attention.
DECODE_CASES = (
    (2, 1, 4099, 8, 2, 128, None, "int8"),
    (3, 2, 1000, 16, 2, 64, 16, "int8"),
    (2, 4, 777, 8, 1, 96, 64, "float8_e4m3fn"),
    (2, 1, 300, 4, 4, 256, None, "float8_e4m3fn"),
    (2, 3, 2100, 8, 2, 128, 16, None),
)


def run_decode_case(path, case, dtype) -> str:
  B, T, S, N, K, H, page_size, cache = case
  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.standard_normal((B, T, N, H)), dtype)
  k, v = (jnp.asarray(rng.standard_normal((B, S, K, H)), dtype) for _ in range(2))
  lengths = jnp.asarray([S, S // 3 + 1, T][:B], jnp.int32)
  scales = {}
  if cache is not None:
    unit = None if cache == "int8" else jnp.full((1, 1, K), 0.01, jnp.float32)
    (k, ks), (v, vs) = quantize(k, jnp.dtype(cache), unit), quantize(v, jnp.dtype(cache), unit)
    scales = {"k_scale": ks, "v_scale": vs}
  table = None
  if page_size is not None:
    S_pages = -(-S // page_size) * page_size
    pad = ((0, 0), (0, S_pages - S), (0, 0), (0, 0))
    pages = B * S_pages // page_size
    perm = rng.permutation(pages)
    pool = lambda x: jnp.pad(x, pad[:x.ndim]).reshape(pages, page_size, *x.shape[2:])[perm]
    table = jnp.asarray(np.argsort(perm).reshape(B, -1), jnp.int32)
    k, v = pool(k), pool(v)
    scales = {name: pool(x) if x.shape[0] == B else x for name, x in scales.items()}
  out = jax.jit(lambda q: decode_attention(q, k, v, lengths, block_table=table,
                                           implementation=path, **scales))(q)
  finite = bool(jnp.all(jnp.isfinite(out)))
  return f"decode B={B} T={T} S={S} N={N} K={K} H={H} page={page_size} {cache} finite={finite}"


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--paths", default="cuda_sm90,cuda_sm80,cuda_sm75,cuda_sm70")
  parser.add_argument("--dtype", default="bfloat16", choices=("float16", "bfloat16"))
  parser.add_argument("--decode-only", action="store_true",
                      help="only the decode_attention cases (paged and quantized caches)")
  args = parser.parse_args(argv)
  for path in args.paths.split(","):
    for case in () if args.decode_only else CASES:
      print(path, run_case(path, case, jnp.dtype(args.dtype)), flush=True)
    for case in DECODE_CASES:
      print(path, run_decode_case(path, case, jnp.dtype(args.dtype)), flush=True)


if __name__ == "__main__":
  main()
