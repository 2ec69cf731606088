"""Decode benchmark: ``decode_attention`` against ``jax.nn.dot_product_attention``.

T new tokens per sequence (``--queries``, 1 by default; several for
speculative decoding or chunked prefill) attend over a full KV cache of S
keys, in Llama-3-8B's shapes by default (N = 32 query heads, K = 8
key/value heads, H = 128, bfloat16), for batch sizes 1 and 8 and S from 4K
to 256K. ``jax.nn.dot_product_attention`` runs with ``key_value_seq_lengths``
and implementation "xla" and "cudnn" (where it runs); for T > 1 it also takes
the new tokens' end-aligned causal rule as a boolean mask of (1, 1, T, S),
which ``decode_attention`` applies by itself.

Timing: each competitor runs ``--calls`` times inside one jitted
``lax.fori_loop`` (each call's output is the next call's query, so no call can
be hoisted or skipped), so launch and dispatch overheads stay out of the
figure as they would in a compiled decode loop; the median of ``--repeats``
such loops, divided by the calls, is the time per call. A loop has a fixed
cost of its own (about 0.35 ms on the H100, whatever the attention): over 50
calls it added 7 us to each (B = 1, S = 4K: 22.3 us per call, 14.4 over
500), so the default is 500. The calls take turns
over several K/V sets, together at least ``--footprint-mib`` (256 MiB by
default, five times the H100's 50 MB L2), so that K and V come from device
memory, as in a decoder where every layer has its own cache: one set small
enough to stay in the L2 would time the cache instead. Bandwidth = bytes of K
and V read (2 * B * S * K * H * itemsize) / time, reported against the
device's copy bandwidth measured the same way (bytes read plus written by
``x + 1`` over a 2 GiB array). Each loop is warmed up for WARMUP_SECONDS
before it is timed. The table's last column is fastattn's speed
over the fastest competitor's at each shape (the faster of xla and cuDNN on
GPUs).

``--page-sizes 16,64,256`` adds ``decode_attention`` over a paged cache of
each page size: the same K/V sets seen as pools of pages (a reshape, no
copy) read through a block table that shuffles every sequence's pages over
the pool (a fixed random permutation), reported as its share of the
contiguous cache's bandwidth. ``--kv-dtypes int8,float8_e4m3fn`` adds
``decode_attention`` over the same K/V sets quantized (``decode.quantize``,
outside the timed loop: int8 per position and head, float8 with a per-head
scale of max |x| / 448), reported as its speed over the 16-bit cache's.

Run::

  python -m benchmarks.bench_decode --out /tmp/decode
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from benchmarks.bench import SUBJECT, WARMUP_SECONDS, int_list
from fastattn_jax import decode_attention
from fastattn_jax.decode import quantize
from fastattn_jax.timing import median_seconds


def _loop(attention, calls: int):
  """A jitted ``run(q, ks, vs, lengths, mask)``: ``calls`` calls of ``attention`` in a chain.

  ``ks`` and ``vs`` are tuples of K/V sets; call i reads set ``i % len(ks)``,
  and ``calls`` must be a multiple of ``len(ks)``.
  """

  def run(q, ks, vs, lengths, mask):
    def body(_, x):
      for k, v in zip(ks, vs):
        x = attention(x, k, v, lengths, mask).astype(x.dtype)
      return x

    return jax.lax.fori_loop(0, calls // len(ks), body, q)

  return jax.jit(run)


def kv_sets(kv_bytes: int, footprint_bytes: int) -> int:
  """How many K/V sets of ``kv_bytes`` the calls take turns over: enough to
  reach ``footprint_bytes`` together."""
  return max(1, -(-footprint_bytes // kv_bytes))


def copy_bandwidth(device) -> float:
  """``device``'s copy bandwidth in bytes/s: the bytes read and written by
  ``x + 1`` over a 2 GiB bfloat16 array, 20 times in one jitted loop, over
  the median time of 5 such loops."""
  n, calls = 2**30, 20
  x = jax.device_put(jnp.zeros((n,), jnp.bfloat16), device)
  fn = jax.jit(lambda x: jax.lax.fori_loop(0, calls, lambda _, y: y + 1, x))
  return 2 * n * 2 * calls / median_seconds(lambda: fn(x), repeats=5)


#: Name prefix of the paged-cache entries (``paged_competitor``), which are
#: not rivals: they are fastattn's own paged path.
PAGED = "paged "


def paged_competitor(page_size: int):
  """``decode_attention`` over k, v (B, S, K, H) seen as pools of
  (B * S / page_size, page_size, K, H) pages, each sequence's pages shuffled
  over the pool by a fixed permutation (a constant block table)."""

  def attention(q, k, v, lengths, mask):
    B, S = k.shape[:2]
    pages = B * S // page_size
    table = np.random.default_rng(page_size).permutation(pages).reshape(B, S // page_size)
    pool = lambda x: x.reshape(pages, page_size, *x.shape[2:])
    return decode_attention(q, pool(k), pool(v), lengths,
                            block_table=jnp.asarray(table, jnp.int32))

  return attention


#: Name prefix of the quantized-cache entries (``quantized_competitor``),
#: fastattn's own as well.
QUANT = "kv "


def quantized_competitor(kv_dtype: str):
  """``decode_attention`` over a cache of ``kv_dtype`` (int8 or
  float8_e4m3fn): its ``prepare(k, v)`` quantizes a K/V set once, before the
  timed loop, to the ``(values, scale)`` pairs the attention takes."""

  def attention(q, k, v, lengths, mask):
    return decode_attention(q, k[0], v[0], lengths, k_scale=k[1], v_scale=v[1])

  def prepare(k, v):
    if kv_dtype == "int8":
      return quantize(k, jnp.int8), quantize(v, jnp.int8)
    per_head = lambda x: jnp.max(jnp.abs(x.astype(jnp.float32)), axis=(0, 1, 3))[None, None] / 448
    return (quantize(k, jnp.float8_e4m3fn, per_head(k)),
            quantize(v, jnp.float8_e4m3fn, per_head(v)))

  attention.prepare = prepare
  return attention


def competitors(platform: str) -> dict:
  """``{name: attention(q, k, v, lengths, mask)}`` for a JAX platform
  ("cpu", "gpu"): ``decode_attention`` as SUBJECT (end-aligned causal among
  the T new tokens; ``mask`` unused), then jax.nn's "xla" and, on GPUs,
  "cudnn", all with ``key_value_seq_lengths=lengths`` and ``mask`` (None, or
  the same rule as a boolean (1, 1, T, S)). q is (B, T, N, H), k and v (B, S,
  K, H), lengths int32 (B,)."""
  comps = {
      SUBJECT: lambda q, k, v, lengths, mask: decode_attention(q, k, v, lengths),
      "xla": lambda q, k, v, lengths, mask: jax.nn.dot_product_attention(
          q, k, v, mask=mask, key_value_seq_lengths=lengths, implementation="xla"),
  }
  if platform == "gpu":
    comps["cudnn"] = lambda q, k, v, lengths, mask: jax.nn.dot_product_attention(
        q, k, v, mask=mask, key_value_seq_lengths=lengths, implementation="cudnn")
  return comps


def run_case(B, T, S, N, K, H, dtype, comps, calls, repeats, footprint_bytes) -> dict:
  """Times each of ``comps`` on one decode step: q (B, T, N, H) over full
  caches k, v (B, S, K, H) of ``dtype``, the T queries at the last T
  positions.

  The ``calls`` calls of each timed loop (rounded up to a multiple of the
  K/V sets) take turns over ``kv_sets(kv_bytes, footprint_bytes)`` random
  K/V sets; the time per call is the median of ``repeats`` loops over
  ``calls``.

  Returns:
    ``{"B", "T", "S", "N", "K", "H", "kv_bytes" (K and V of one set, bytes),
    "kv_sets", name: {"us": microseconds per call, "GB/s": kv_bytes / time
    / 1e9} or {"error": why it did not run}}``.
  """
  kv_bytes = 2 * B * S * K * H * jnp.dtype(dtype).itemsize
  sets = kv_sets(kv_bytes, footprint_bytes)
  calls = -(-calls // sets) * sets
  keys = jax.random.split(jax.random.key(0), 1 + 2 * sets)
  q = jax.random.normal(keys[0], (B, T, N, H), dtype)
  ks = tuple(jax.random.normal(key, (B, S, K, H), dtype) for key in keys[1:1 + sets])
  vs = tuple(jax.random.normal(key, (B, S, K, H), dtype) for key in keys[1 + sets:])
  lengths = jnp.full((B,), S, jnp.int32)
  mask = None
  if T > 1:  # query t at position S - T + t
    mask = (jnp.arange(S)[None, :] <= S - T + jnp.arange(T)[:, None])[None, None]
  row = {"B": B, "T": T, "S": S, "N": N, "K": K, "H": H, "kv_bytes": kv_bytes,
         "kv_sets": sets}
  for name, attention in comps.items():
    try:
      loop = _loop(attention, calls)
      prepare = getattr(attention, "prepare", None)
      sets_k, sets_v = ks, vs
      if prepare is not None:
        sets_k, sets_v = zip(*(prepare(k, v) for k, v in zip(ks, vs)))
      seconds = median_seconds(lambda: loop(q, sets_k, sets_v, lengths, mask), repeats,
                               warmup_seconds=WARMUP_SECONDS) / calls
      del sets_k, sets_v
      row[name] = {"us": seconds * 1e6, "GB/s": kv_bytes / seconds / 1e9}
    except Exception as err:  # a competitor that cannot run this shape
      row[name] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"}
  del q, ks, vs
  return row


def format_table(rows: list[dict], names: list[str], copy_gbs: float) -> str:
  """A Markdown table of ``run_case`` rows: microseconds per call of each of
  ``names`` (SUBJECT first), fastattn's GB/s and its share of ``copy_gbs``
  (GB/s), and its speed over the fastest competitor's at that shape
  ("1.04x (cudnn)": the competitor takes 1.04 times as long); "err" and "-"
  where an entry did not run."""
  paged = [n for n in names if n.startswith(PAGED)]
  quantized = [n for n in names if n.startswith(QUANT)]
  rivals = [n for n in names if n != SUBJECT and n not in paged + quantized]
  names = [n for n in names if n not in paged + quantized]
  versus = f"fastest of {', '.join(rivals)}" if len(rivals) > 1 else rivals[0]
  head = ["B", "T", "S"] + [f"{n} us" for n in names]
  head += [f"{SUBJECT} GB/s", f"{SUBJECT} % copy", f"{SUBJECT} vs {versus}"]
  head += [f"{n} us (% of contiguous GB/s)" for n in paged]
  head += [f"{n} us (speed over {SUBJECT}'s)" for n in quantized]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in rows:
    us = {n: r[n].get("us") for n in names}
    cells = [str(r["B"]), str(r["T"]), str(r["S"])]
    cells += [f"{us[n]:.1f}" if us[n] else "err" for n in names]
    timed = [n for n in rivals if us[n]]
    if us[SUBJECT]:
      cells += [f"{r[SUBJECT]['GB/s']:.0f}", f"{100 * r[SUBJECT]['GB/s'] / copy_gbs:.0f}%"]
      best = min(timed, key=us.get) if timed else None
      cells.append(f"{us[best] / us[SUBJECT]:.2f}x ({best})" if best else "-")
    else:
      cells += ["-"] * 3
    for n in paged:
      paged_us = r[n].get("us")
      cells.append(f"{paged_us:.1f} ({100 * us[SUBJECT] / paged_us:.0f}%)"
                   if paged_us and us[SUBJECT] else "err")
    for n in quantized:
      quant_us = r[n].get("us")
      cells.append(f"{quant_us:.1f} ({us[SUBJECT] / quant_us:.2f}x)"
                   if quant_us and us[SUBJECT] else "err")
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main(argv=None) -> None:
  """Command line; see the module docstring. Writes ``bench_decode.json``
  (device, copy bandwidth in GB/s, dtype, calls, rows) to ``--out``."""
  parser = argparse.ArgumentParser(
      prog="python -m benchmarks.bench_decode",
      description="Times decode_attention (T new tokens over a KV cache) against jax.nn.")
  parser.add_argument("--batch", type=int_list, default=(1, 8))
  parser.add_argument("--queries", type=int_list, default=(1,), help="T, new tokens per step")
  parser.add_argument("--seq-lens", type=int_list,
                      default=(4096, 16384, 65536, 131072, 262144))
  parser.add_argument("--heads", type=int, default=32, help="N, query heads")
  parser.add_argument("--kv-heads", type=int, default=8, help="K, key/value heads")
  parser.add_argument("--head-dim", type=int, default=128, help="H")
  parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
  parser.add_argument("--calls", type=int, default=500, help="calls per timed loop")
  parser.add_argument("--repeats", type=int, default=5, help="timed loops per measurement")
  parser.add_argument("--footprint-mib", type=int, default=256,
                      help="least MiB of K and V the calls take turns over (keeps K/V out "
                           "of the L2)")
  parser.add_argument("--page-sizes", type=int_list, default=(),
                      help="also time a paged cache of these page sizes")
  parser.add_argument("--kv-dtypes", type=lambda text: [x for x in text.split(",") if x],
                      default=(), help="also time a quantized cache of these dtypes (int8, "
                                       "float8_e4m3fn)")
  parser.add_argument("--out", default="bench_results", help="output directory")
  args = parser.parse_args(argv)

  device = jax.devices()[0]
  platform = device.platform
  comps = competitors(platform)
  comps.update({f"{PAGED}{p}": paged_competitor(p) for p in args.page_sizes})
  for kv_dtype in args.kv_dtypes:
    if kv_dtype not in ("int8", "float8_e4m3fn"):
      parser.error(f"--kv-dtypes: int8 or float8_e4m3fn, got {kv_dtype!r}")
    comps[f"{QUANT}{kv_dtype}"] = quantized_competitor(kv_dtype)
  names = list(comps)
  copy_gbs = copy_bandwidth(device) / 1e9
  print(f"device: {device.device_kind}; copy bandwidth {copy_gbs:.0f} GB/s (read + write)")
  rows = []
  cases = [(B, T, S) for B in args.batch for T in args.queries for S in args.seq_lens]
  for B, T, S in tqdm(cases, desc="decode bench", unit="shape", file=sys.stderr):
    rows.append(run_case(B, T, S, args.heads, args.kv_heads, args.head_dim,
                         jnp.dtype(args.dtype), comps, args.calls, args.repeats,
                         args.footprint_mib * 2**20))
  print(format_table(rows, names, copy_gbs))
  for r in rows:
    for n in names:
      if "error" in r[n]:
        print(f"B={r['B']} T={r['T']} S={r['S']} {n}: {r[n]['error']}")
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "bench_decode.json")
  with open(path, "w") as f:
    json.dump({"device": device.device_kind, "copy_GBps": copy_gbs, "dtype": args.dtype,
               "calls": args.calls, "rows": rows}, f, indent=1)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
