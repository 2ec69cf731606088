"""KV-cache write: compile time and run time of ``decode.write`` by batch size.

For each batch size B, one layer's decode step (T = 1 new position per
sequence written into (B, S_max, K, H) caches, then ``decode_attention`` of
the N query heads over them, the caches donated) is lowered and compiled
from abstract inputs, in two forms:

* ``write``: ``fastattn_jax.decode.write`` (on GPUs one scatter per cache,
  a program of the same size at any B; on the CPU the same as ``unrolled``);
* ``unrolled``: one ``dynamic_update_slice`` per sequence, written out B
  times (the former ``decode.write``), the reference.

Compile time = wall seconds of ``jit(...).lower(...).compile()``, the median
of ``--repeats``, each of a fresh function with JAX's persistent compilation
cache off. Run time = the jitted write alone on real caches (donated), the
median of ``--repeats`` loops of ``--calls`` calls, the two forms taking
turns.

Run::

  python -m benchmarks.bench_cache --out /tmp/cache
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from tqdm import tqdm

from benchmarks.bench import int_list
from fastattn_jax.decode import decode_attention, write


def unrolled_write(cache_k, cache_v, lengths, k_new, v_new):
  """One ``dynamic_update_slice`` per sequence, on the bits: the former ``decode.write``."""

  def put(cache, new):
    bits = jnp.dtype(f"uint{8 * cache.dtype.itemsize}")
    raw = jax.lax.bitcast_convert_type(cache, bits)
    new = jax.lax.bitcast_convert_type(new.astype(cache.dtype), bits)
    for b in range(cache.shape[0]):
      raw = jax.lax.dynamic_update_slice(raw, new[b:b + 1], (b, lengths[b], 0, 0))
    return jax.lax.bitcast_convert_type(raw, cache.dtype)

  return put(cache_k, k_new), put(cache_v, v_new)


FORMS = {"write": write, "unrolled": unrolled_write}


def _step(write_fn):
  def step(query, cache_k, cache_v, lengths, k_new, v_new):
    cache_k, cache_v = write_fn(cache_k, cache_v, lengths, k_new, v_new)
    return decode_attention(query, cache_k, cache_v, lengths + 1), cache_k, cache_v
  return step


def compile_seconds(write_fn, B, S, N, K, H, dtype, repeats) -> float:
  """Median wall seconds to lower and compile one layer's step with ``write_fn``."""
  spec = jax.ShapeDtypeStruct
  cache = spec((B, S, K, H), dtype)
  args = (spec((B, 1, N, H), dtype), cache, cache, spec((B,), jnp.int32),
          spec((B, 1, K, H), dtype), spec((B, 1, K, H), dtype))
  times = []
  for _ in range(repeats):
    step = _step(write_fn)
    fn = jax.jit(lambda *a: step(*a), donate_argnums=(1, 2))
    start = time.perf_counter()
    fn.lower(*args).compile()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def run_microseconds(B, S, K, H, dtype, calls, repeats) -> dict:
  """Microseconds per call of each form's jitted write on real, donated
  caches: ``repeats`` rounds, each a loop of ``calls`` calls per form in
  turn; the median per form."""
  keys = jax.random.split(jax.random.key(0), 2)
  new = jax.random.normal(keys[0], (B, 1, K, H), dtype)
  lengths = jax.random.randint(keys[1], (B,), 0, S - 1)
  fns = {name: jax.jit(fn, donate_argnums=(0, 1)) for name, fn in FORMS.items()}
  caches = {name: (jnp.zeros((B, S, K, H), dtype), jnp.zeros((B, S, K, H), dtype))
            for name in FORMS}
  times = {name: [] for name in FORMS}
  for round_ in range(repeats + 1):
    for name, fn in fns.items():
      k, v = caches[name]
      start = time.perf_counter()
      for _ in range(calls):
        k, v = fn(k, v, lengths, new, new)
      jax.block_until_ready((k, v))
      if round_:  # the first round compiles and warms up
        times[name].append((time.perf_counter() - start) / calls * 1e6)
      caches[name] = (k, v)
  return {name: statistics.median(t) for name, t in times.items()}


def main(argv=None) -> None:
  """Command line; see the module docstring. Writes ``bench_cache.json`` to ``--out``."""
  parser = argparse.ArgumentParser(
      prog="python -m benchmarks.bench_cache",
      description="Times the compile and the run of one layer's KV-cache write.")
  parser.add_argument("--batch", type=int_list, default=(8, 64, 256))
  parser.add_argument("--max-len", type=int, default=4096, help="S_max, cache positions")
  parser.add_argument("--heads", type=int, default=32, help="N, query heads")
  parser.add_argument("--kv-heads", type=int, default=8, help="K, key/value heads")
  parser.add_argument("--head-dim", type=int, default=128, help="H")
  parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
  parser.add_argument("--calls", type=int, default=20, help="calls per timed loop")
  parser.add_argument("--repeats", type=int, default=3, help="measurements per median")
  parser.add_argument("--out", default="bench_results", help="output directory")
  args = parser.parse_args(argv)

  jax.config.update("jax_enable_compilation_cache", False)
  device = jax.devices()[0]
  dtype = jnp.dtype(args.dtype)
  print(f"device: {device.device_kind}; S_max={args.max_len} N={args.heads} "
        f"K={args.kv_heads} H={args.head_dim} {args.dtype}")
  rows = []
  for B in tqdm(args.batch, desc="cache bench", unit="batch", file=sys.stderr):
    row = {"B": B}
    for name, fn in FORMS.items():
      row[f"{name} compile s"] = compile_seconds(fn, B, args.max_len, args.heads, args.kv_heads,
                                                 args.head_dim, dtype, args.repeats)
    for name, us in run_microseconds(B, args.max_len, args.kv_heads, args.head_dim, dtype,
                                     args.calls, args.repeats).items():
      row[f"{name} us"] = us
    rows.append(row)
  head = list(rows[0])
  print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
  for r in rows:
    print("| " + " | ".join(f"{r[h]:.2f}" if isinstance(r[h], float) else str(r[h])
                            for h in head) + " |")
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "bench_cache.json")
  with open(path, "w") as f:
    json.dump({"device": device.device_kind, "S_max": args.max_len, "N": args.heads,
               "K": args.kv_heads, "H": args.head_dim, "dtype": args.dtype, "rows": rows},
              f, indent=1)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
