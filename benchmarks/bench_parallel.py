"""Tensor-parallel attention block: the plain and tiled schedules against the compute alone.

Llama-3-8B's attention block by default (D = 4096, N = 32 query heads, K = 8
key/value heads, H = 128, bfloat16, B = 1) over P devices, for T from 1K to
32K query rows (causal prefill): ``fastattn_jax.parallel.attention_block``

Each variant is timed as a decoder layer uses the block: x + block(x) (the
residual sum, into which XLA fuses the tiles' concatenation), keys and values
returned.

* ``compute``: the block without its all-reduce (``reduce=False``), one tile;
* ``compute_tiled``: the same in the tiles of ``tiled``;
* ``plain``: attention, output projection, one all-reduce;
* ``tiled``: FastAttention's tiling-AllReduce with the tile count of the
  measured model (``plan_tiles``, at least two tiles), and with each count of
  ``--tiles``.

The all-reduce the plain schedule exposes is ``plain - compute``; the share of
it the tiled schedule hides is ``(plain - tiled) / (plain - compute)``. A
decode step (T = 1, ``--decode-batch`` sequences over a cache of
``--decode-context`` positions) is timed the same way: one tile is all it
has, so it gives the all-reduce's latency against the step's compute.
Variants take turns (``--rounds`` rounds, each the median of ``--repeats``
samples of ``--calls`` calls); a variant's time is the median of its rounds.
TFLOP/s are per device: the block's FLOP (projections, causal attention,
output projection) / P / time.

Run (NCCL_NVLS_ENABLE=0 keeps NCCL off NVLink multicast)::

  NCCL_NVLS_ENABLE=0 python -m benchmarks.bench_parallel --devices 2,4 --out /tmp/tp
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from benchmarks.bench import WARMUP_SECONDS, int_list
from fastattn_jax import parallel
from fastattn_jax.timing import median_seconds


def schedule_events(hlo_text: str) -> str:
  """The order of a compiled module's attention calls and all-reduces, one
  letter each, in the entry computation's order (its schedule): "A" a
  fastattn custom call, "R" a synchronous all-reduce, "S" and "D" the start
  and done of an asynchronous one; an instruction that calls computations
  (XLA:GPU wraps custom calls and collectives in fusions) counts as what they
  hold."""
  head, entry = hlo_text.split("\nENTRY", 1)
  bodies = {chunk.split(" ", 1)[0]: chunk for chunk in re.split(r"\n(?=%)", head)}

  def holds(line, seen=()):
    """What ``line`` runs, following the computations it calls: "A", "R" or ""."""
    if 'custom_call_target="fastattn_' in line:
      return "A"
    if re.search(r" all-reduce(-start)?\(", line):
      return "R"
    for name in re.findall(r"(?:calls|to_apply|called_computations)=\{?(%[\w.\-]+)", line):
      if name in bodies and name not in seen:
        found = "".join(holds(inner, seen + (name,)) for inner in bodies[name].splitlines()[1:])
        if found:
          return found[0]
    return ""

  events, started = [], set()
  for line in entry.splitlines()[1:]:
    kind = holds(line)
    done = re.search(r" (?:all-reduce|fusion)-done\((%[\w.\-]+)", line)
    if kind == "R" and re.search(r" (all-reduce|fusion)-start\(", line):
      kind = "S"
      started.add(line.split("=", 1)[0].strip())
    elif done and done.group(1) in started:
      kind = "D"
    events.append(kind)
  return "".join(events)


def block_flops(B, T, D, N, K, H, keys_before=0) -> float:
  """FLOP of one causal block: q/k/v and output projections, attention of the visible half."""
  return 2 * B * T * D * (2 * N + 2 * K) * H + 4 * B * N * H * T * (keys_before + (T + 1) / 2)


def _weights(tp, D, dtype, seed=0):
  N, K, H = tp.num_heads, tp.num_kv_heads, tp.head_dim
  ks = jax.random.split(jax.random.key(seed), 4)
  shapes = {"wq": (D, N * H), "wk": (D, K * H), "wv": (D, K * H), "wo": (N * H, D)}
  make = jax.jit(lambda key, shape: (jax.random.normal(key, shape, jnp.float32)
                                     * shape[0] ** -0.5).astype(dtype), static_argnums=1)
  return parallel.shard_attention_weights(
      tp, **{name: make(k, shape) for k, (name, shape) in zip(ks, shapes.items())})


def _layer_attention(x, w, cache, *, tp, rates, **kw):
  """The block as a decoder layer uses it: its output added to the residual
  stream x (XLA fuses the tiles' concatenation into that sum). Without the
  all-reduce, each device's partial sum is added."""
  out, k, v = parallel.attention_block(x, w, tp, is_causal=True, cache=cache, rates=rates, **kw)
  residual = x if kw.get("reduce", True) else jnp.tile(x, (tp.size, 1, 1))
  return residual + out, k, v


def run_case(tp, B, T, D, dtype, variants, rates, *, rounds, repeats, calls, cache_len=0):
  """Times ``variants`` {name: attention_block kwargs} on one shape; returns a row."""
  H = tp.head_dim
  w = _weights(tp, D, dtype)
  x = jax.device_put(jax.random.normal(jax.random.key(1), (B, T, D), dtype), tp.sharding())
  cache = None
  if cache_len:
    shape = (B, cache_len + T, tp.kv_heads, H)
    fill = jax.jit(lambda: jnp.ones(shape, dtype) * 0.01, out_shardings=tp.sharding(
        *tp.heads_spec))
    cache = (fill(), fill(), jnp.full((B,), cache_len, jnp.int32))
  fns, outs, texts = {}, {}, {}
  options = parallel.compiler_options(tp.mesh.devices.flat[0].platform)
  for name, kw in variants.items():
    compiled = jax.jit(functools.partial(_layer_attention, tp=tp, rates=rates, **kw)).lower(
        x, w, cache).compile(compiler_options=options)
    fns[name] = functools.partial(compiled, x, w, cache)
    outs[name] = fns[name]()
    texts[name] = compiled.as_text()
  reference = np.asarray(outs["plain"][0], np.float32)
  samples = {name: [] for name in fns}
  for _ in range(rounds):
    for name, fn in fns.items():
      samples[name].append(median_seconds(fn, repeats, calls=calls,
                                          warmup_seconds=WARMUP_SECONDS))
  flops = block_flops(B, T, D, tp.num_heads, tp.num_kv_heads, H, cache_len) / tp.size
  row = {"P": tp.size, "B": B, "T": T, "cache": cache_len}
  for name in fns:
    seconds = statistics.median(samples[name])
    row[name] = {"ms": seconds * 1e3, "tflops": flops / seconds / 1e12}
    if not name.startswith("compute"):
      row[name]["max_abs_diff_vs_plain"] = float(np.abs(
          np.asarray(outs[name][0], np.float32) - reference).max())
  exposed = row["plain"]["ms"] - row["compute"]["ms"]
  for name in fns:
    if name.startswith("tiled"):
      row[name]["hidden"] = (row["plain"]["ms"] - row[name]["ms"]) / exposed if exposed > 0 \
          else None
  row["tiled_schedule"] = schedule_events(texts["tiled"])
  row["samples_ms"] = {name: [t * 1e3 for t in ts] for name, ts in samples.items()}
  return row, texts["tiled"]


def format_table(rows) -> str:
  """One line per (P, T): ms and TFLOP/s per device of each variant, the share hidden."""
  names = list(dict.fromkeys(n for r in rows for n in r
                             if isinstance(r[n], dict) and "ms" in r[n]))
  head = f"{'P':>2} {'B':>2} {'T':>6} {'cache':>6} " + " ".join(
      f"{n:>22}" for n in names) + "  tiled/plain  hidden"
  lines = [head, "-" * len(head)]
  for r in rows:
    cells = " ".join(f"{r[n]['ms']:9.3f} ms {r[n]['tflops']:6.1f} TF" if n in r else
                     f"{'-':>22}" for n in names)
    ratio = r["plain"]["ms"] / r["tiled"]["ms"]
    hidden = r["tiled"].get("hidden")
    lines.append(f"{r['P']:>2} {r['B']:>2} {r['T']:>6} {r['cache']:>6} {cells}  {ratio:10.3f}x"
                 f"  {'n/a' if hidden is None else f'{hidden:6.0%}'}")
  return "\n".join(lines)


def plot(rows, path: str, device: str) -> None:
  """One panel per P: TFLOP/s per device against T for compute alone, tiled, plain."""
  from matplotlib.figure import Figure
  prefill = [r for r in rows if not r["cache"]]
  counts = sorted({r["P"] for r in prefill})
  fig = Figure(figsize=(6 * len(counts), 4.5), layout="constrained")
  for ax, P in zip(fig.subplots(1, len(counts), squeeze=False)[0], counts):
    rs = [r for r in prefill if r["P"] == P]
    Ts = [r["T"] for r in rs]
    for name, style in (("compute", "k--"), ("tiled", "C0o-"), ("plain", "C3s-")):
      ys = [r[name]["tflops"] for r in rs]
      ax.plot(Ts, ys, style, label=name)
      ax.annotate(f"{name}", (Ts[-1], ys[-1]), xytext=(6, 0), textcoords="offset points",
                  va="center", color=style[:2] if style[0] == "C" else "k")
    for r in rs:
      hidden = r["tiled"].get("hidden")
      ax.annotate(f"{r['plain']['ms'] / r['tiled']['ms']:.2f}x"
                  + ("" if hidden is None else f"\n{hidden:.0%} hid"),
                  (r["T"], r["tiled"]["tflops"]), xytext=(0, -24), textcoords="offset points",
                  ha="center", fontsize=8, color="C0")
    ax.set_xscale("log", base=2)
    ax.set_xticks(Ts, [f"{T // 1024}K" for T in Ts])
    ax.set_xlim(Ts[0] / 1.3, Ts[-1] * 1.6)
    ax.margins(y=0.15)
    ax.set_xlabel("T (query rows, causal prefill)")
    ax.set_ylabel("TFLOP/s per device")
    ax.set_title(f"P = {P}: tiled/plain speed and share of the all-reduce hidden")
    ax.grid(alpha=0.3)
  fig.suptitle(f"Llama-3-8B attention block, tensor-parallel, {device}")
  fig.savefig(path, dpi=110)


def _save(folder: str, name: str, text: str) -> None:
  os.makedirs(folder, exist_ok=True)
  with open(os.path.join(folder, name), "w") as f:
    f.write(text)


def main(argv=None) -> None:
  """Command line; see the module docstring. Writes ``bench_parallel.json``
  (device, rates, rows) and ``bench_parallel.png`` to ``--out``."""
  parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_parallel",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--devices", type=int_list, default=(2, 4), help="P values")
  parser.add_argument("--seq-lens", type=int_list,
                      default=(1024, 2048, 4096, 8192, 16384, 32768))
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--d-model", type=int, default=4096)
  parser.add_argument("--heads", type=int, default=32)
  parser.add_argument("--kv-heads", type=int, default=8)
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
  parser.add_argument("--tiles", type=int_list, default=(2, 4, 8),
                      help="fixed tile counts timed besides the model's")
  parser.add_argument("--decode-batch", type=int, default=8)
  parser.add_argument("--decode-context", type=int, default=8192)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--calls", type=int, default=3)
  parser.add_argument("--out", default="bench_results")
  args = parser.parse_args(argv)
  dtype = jnp.dtype(args.dtype)
  devices = jax.devices()
  rows, rates_json = [], {}
  for P in args.devices:
    if P > len(devices):
      print(f"P={P}: skipped, {len(devices)} devices", file=sys.stderr)
      continue
    tp = parallel.TensorParallel(jax.make_mesh((P,), ("model",), devices=devices[:P]), "model",
                                 args.heads, args.kv_heads, args.head_dim)
    rates = parallel.measure_rates(tp, args.d_model, dtype)
    rates_json[P] = vars(rates)
    print(f"P={P}: {rates.describe()}", flush=True)
    variants = {"compute": {"num_tiles": 1, "reduce": False}, "plain": {"schedule": "plain"},
                "tiled": {"schedule": "tiled"},
                "compute_tiled": {"schedule": "tiled", "reduce": False}}
    variants.update({f"tiled{n}": {"num_tiles": n} for n in args.tiles})
    for T in tqdm(args.seq_lens, desc=f"P={P}", file=sys.stderr):
      plan = parallel.plan_tiles(T, batch=args.batch, d_model=args.d_model, tp=tp, rates=rates,
                                 itemsize=dtype.itemsize, min_tiles=2)
      row, text = run_case(tp, args.batch, T, args.d_model, dtype, variants, rates,
                           rounds=args.rounds, repeats=args.repeats, calls=args.calls)
      _save(args.out, f"tiled_P{P}_T{T}.hlo.txt", text)
      row["plan"] = plan.explain()
      rows.append(row)
      print(format_table([row]).splitlines()[-1], "|", plan.explain(), flush=True)
    decode = {"compute": variants["compute"], "plain": variants["plain"],
              "tiled": variants["tiled"]}
    row, text = run_case(tp, args.decode_batch, 1, args.d_model, dtype, decode, rates,
                         rounds=args.rounds, repeats=args.repeats, calls=args.calls,
                         cache_len=args.decode_context)
    rows.append(row)
  print(format_table(rows))
  for r in rows:
    print(f"P={r['P']} T={r['T']}: tiled schedule {r['tiled_schedule']}")
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "bench_parallel.json"), "w") as f:
    json.dump({"device": devices[0].device_kind, "dtype": args.dtype, "rates": rates_json,
               "xla_flags": os.environ.get("XLA_FLAGS", ""), "rows": rows}, f, indent=1)
  plot(rows, os.path.join(args.out, "bench_parallel.png"), devices[0].device_kind)
  print(f"wrote {args.out}/bench_parallel.json and .png")


if __name__ == "__main__":
  main()
