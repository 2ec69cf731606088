"""Training-feature benchmark: packed sequences, attention sinks and ALiBi.

Packed: one row of T tokens holds documents of random lengths (a document
length drawn uniformly from [T/8, T/2], the last one cut to fill the row),
causal within each document. Three ways to compute it, all with
``fast_attention`` (the last two on this path too), each timed as a whole
jitted call:

- ``packed``: ``segment_ids`` (the documents' ids) and ``is_causal``;
- ``separate``: each document in a call of its own (the sum of their
  times; the work a packed call must match);
- ``dense mask``: the (1, 1, T, T) block-diagonal boolean mask and
  ``is_causal`` (what a user without segment ids writes).

cuDNN's time for the same packing, expressed as the block-diagonal mask
through ``jax.nn.dot_product_attention(implementation="cudnn")``, is
reported where it runs (GPUs).

Sinks and ALiBi: causal self-attention of T tokens with ``sinks`` (N,) or
``alibi_slopes`` (N,) against the same call without, as a ratio of times.

Columns: milliseconds per call (the median of ``--repeats`` samples of
``--calls`` calls, ``fastattn_jax.timing.median_seconds``), and the ratios
the targets are stated in: packed / separate, dense mask / packed, cuDNN /
packed, feature / plain. Competitors run interleaved: each round takes one
sample of every competitor of a row in turn (each document of "separate"
among them), so a noisy machine's slow spells fall on all alike.

Run::

  python -m benchmarks.bench_features            # CPU: float32, N = 8, H = 64
  python -m benchmarks.bench_features --dtype bfloat16 --heads 16 --head-dim 128  # GPUs
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bench import int_list
from fastattn_jax import fast_attention
from fastattn_jax.timing import median_seconds


def documents(rng, T: int) -> list[int]:
  """Lengths of documents filling T tokens, each drawn from [T/8, T/2]."""
  lengths = []
  while sum(lengths) < T:
    lengths.append(int(rng.integers(max(1, T // 8), max(2, T // 2) + 1)))
  lengths[-1] -= sum(lengths) - T
  return [n for n in lengths if n > 0]


def _interleaved(cases: dict, calls: int, repeats: int) -> dict:
  """Milliseconds per call of each case, ``{name: (fn, args)}``: every case
  jitted and warmed up, then ``repeats`` rounds that take one sample of each
  case in turn (``calls`` calls), so that a noisy machine's slow spells fall
  on all of them alike; the median round of each."""
  jitted = {name: (jax.jit(fn), args) for name, (fn, args) in cases.items()}
  for fn, args in jitted.values():
    jax.block_until_ready(fn(*args))
  samples = {name: [] for name in cases}
  for _ in range(repeats):
    for name, (fn, args) in jitted.items():
      samples[name].append(median_seconds(lambda: fn(*args), 1, warmup=0, calls=calls) * 1e3)
  return {name: float(np.median(times)) for name, times in samples.items()}


def packed_case(rng, T, N, H, dtype, calls, repeats, with_cudnn) -> dict:
  docs = documents(rng, T)
  q, k, v = (jnp.asarray(rng.standard_normal((1, T, N, H)), dtype) for _ in range(3))
  ids = jnp.asarray(np.repeat(np.arange(len(docs)), docs)[None], jnp.int32)
  mask = ids[:, None, :, None] == ids[:, None, None, :]
  cases = {
      "packed": (lambda q, k, v, ids: fast_attention(q, k, v, segment_ids=ids, is_causal=True),
                 (q, k, v, ids)),
      "dense mask": (lambda q, k, v, m: fast_attention(q, k, v, mask=m, is_causal=True),
                     (q, k, v, mask)),
  }
  starts = np.cumsum([0] + docs[:-1])
  for d, (s, n) in enumerate(zip(starts, docs)):
    cases[f"document {d}"] = (lambda q, k, v: fast_attention(q, k, v, is_causal=True),
                              tuple(x[:, s:s + n] for x in (q, k, v)))
  if with_cudnn:
    cases["cudnn mask"] = (
        lambda q, k, v, m: jax.nn.dot_product_attention(q, k, v, mask=m, is_causal=True,
                                                        implementation="cudnn"),
        (q, k, v, mask))
  ms = _interleaved(cases, calls, repeats)
  row = {"T": T, "documents": docs,
         "separate": sum(ms.pop(f"document {d}") for d in range(len(docs)))}
  row.update(ms)
  return row


def feature_case(rng, T, N, H, dtype, calls, repeats) -> dict:
  q, k, v = (jnp.asarray(rng.standard_normal((1, T, N, H)), dtype) for _ in range(3))
  sinks = jnp.asarray(rng.standard_normal(N), jnp.float32)
  slopes = jnp.asarray(2.0 ** (-8 * np.arange(1, N + 1) / N), jnp.float32)
  attend = functools.partial(fast_attention, is_causal=True)
  return {"T": T, **_interleaved({
      "plain": (lambda q, k, v: attend(q, k, v), (q, k, v)),
      "sinks": (lambda q, k, v, s: attend(q, k, v, sinks=s), (q, k, v, sinks)),
      "alibi": (lambda q, k, v, a: attend(q, k, v, alibi_slopes=a), (q, k, v, slopes)),
  }, calls, repeats)}


def format_tables(packed: list[dict], features: list[dict]) -> str:
  cudnn = any("cudnn mask" in r for r in packed)
  head = ("| T | documents | packed ms | separate ms | dense mask ms | packed / separate | "
          "mask / packed |" + (" cuDNN mask ms | cuDNN / packed |" if cudnn else ""))
  lines = [head, "|" + "---|" * (head.count("|") - 1)]
  for r in packed:
    line = (f"| {r['T']} | {len(r['documents'])} | {r['packed']:.2f} | {r['separate']:.2f} | "
            f"{r['dense mask']:.2f} | {r['packed'] / r['separate']:.2f}x | "
            f"{r['dense mask'] / r['packed']:.2f}x |")
    if cudnn:
      line += f" {r['cudnn mask']:.2f} | {r['cudnn mask'] / r['packed']:.2f}x |"
    lines.append(line)
  lines += ["", "| T | plain ms | sinks ms | ALiBi ms | sinks / plain | ALiBi / plain |",
            "|---|---|---|---|---|---|"]
  for r in features:
    lines.append(f"| {r['T']} | {r['plain']:.2f} | {r['sinks']:.2f} | {r['alibi']:.2f} | "
                 f"{r['sinks'] / r['plain']:.3f} | {r['alibi'] / r['plain']:.3f} |")
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--lengths", type=int_list, default=[2048, 4096, 8192, 16384],
                      help="T of the packed rows (comma-separated)")
  parser.add_argument("--feature-lengths", type=int_list, default=[2048, 4096],
                      help="T of the sinks and ALiBi cases")
  parser.add_argument("--heads", type=int, default=8)
  parser.add_argument("--head-dim", type=int, default=64)
  parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
  parser.add_argument("--calls", type=int, default=1)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", help="folder for features.json and features.md")
  args = parser.parse_args(argv)
  rng = np.random.default_rng(args.seed)
  dtype = jnp.dtype(args.dtype)
  with_cudnn = jax.default_backend() == "gpu"
  packed = [packed_case(rng, T, args.heads, args.head_dim, dtype, args.calls, args.repeats,
                        with_cudnn) for T in args.lengths]
  features = [feature_case(rng, T, args.heads, args.head_dim, dtype, args.calls, args.repeats)
              for T in args.feature_lengths]
  table = format_tables(packed, features)
  print(f"{jax.devices()[0].device_kind}, {args.dtype}, N = {args.heads}, H = {args.head_dim}, "
        f"B = 1, causal\n{table}")
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "features.json"), "w") as f:
      json.dump({"packed": packed, "features": features, "dtype": args.dtype,
                 "device": jax.devices()[0].device_kind}, f, indent=1)
    with open(os.path.join(args.out, "features.md"), "w") as f:
      f.write(table + "\n")


if __name__ == "__main__":
  main()
