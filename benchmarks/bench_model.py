"""Whole-model benchmark: a Llama-3-8B-shaped decoder with ``fast_attention`` against
the same model with ``jax.nn.dot_product_attention`` ("cudnn", "xla"): prefill, a
training step and decode steps, in one run.

The model is ``fastattn_jax.models.llama``'s preset ``--preset`` (default
"llama3-8b": D = 4096, N = 32 query heads, K = 8 key/value heads, H = 128,
F = 14336, V = 128256) cut to ``--layers`` layers (default 2), with random
weights (``llama.init_params``) in ``--dtype`` (default bfloat16). The
competitors run the same weights on the same inputs:

* ``fastattn``, the library's default path: ``llama.forward`` with causal
  ``fast_attention`` (what ``llama.prefill`` runs), and ``llama.decode_step``
  (``decode_attention`` over a ``KVCache``);
* ``cudnn`` and ``xla``: the same layers with causal
  ``jax.nn.dot_product_attention(..., implementation=name)``, and for decoding
  ``benchmarks.bench_generate.jaxnn_decode_step`` (the same ``KVCache``,
  written by ``decode.write``, attended with ``key_value_seq_lengths``).

A competitor that cannot run somewhere (cuDNN on the CPU), or a point that
would not fit the device's free memory (XLA's memory analysis of the
compiled call against ``memory_stats``), is skipped and the reason recorded;
nothing is run into an out-of-memory error.

Phases, at each batch B (``--batch``, default 1,8) and context
(``--contexts``, default 4096,32768), chosen by ``--phases`` (default all three):

* ``prefill``: tokens (B, P = context) -> the logits (B, P, V) float32 of
  every position (as ``llama.prefill`` returns them; ``llama.generate``
  reads the last) and every layer's keys and values (L, B, P, K, H), the
  cache's content. One jitted call.
* ``train``: ``jax.value_and_grad`` of the next-token cross-entropy of
  ``llama.forward``'s logits over the same (B, P) tokens, with respect to
  every weight; one jitted call, no optimizer.
* ``decode``: one step of a serving loop: one new token per sequence over a
  ``KVCache`` holding ``context`` positions (random keys and values, room
  for ``--steps`` more), one jitted call with the cache donated, then the
  greedy tokens (argmax of the logits, jitted) read back to the host and
  fed to the next step.

Timing: the competitors take turns, so that the machine's drift hits all
alike. Prefill and train: every competitor is compiled ahead of time (for
the memory analysis), called once (its result checked, below), warmed up for
``bench.WARMUP_SECONDS``, then timed ``--repeats`` (default 5) times in turns, one call
waited for per sample (``fastattn_jax.timing.median_seconds``). Decode: each
competitor's first step compiles and is checked; untimed steps go on in
turns for ``WARMUP_SECONDS`` (after each, the cache's lengths are set back to
the context); then ``--steps`` (default 50) steps in turns are timed one by one, the
host read-back included. Reported: the median ms per call; tokens/s (B·P per
prefill or training step, B per decode step); and fastattn's speed over the
fastest competitor's (ratio > 1: fastattn faster).

Equal work: each competitor's first result is compared with fastattn's,
``rel_diff`` = max |difference| / max |fastattn's| over the last position's
logits (prefill), the loss (train) or the first step's logits (decode).

Memory, with the defaults (XLA's memory analysis of each call compiled for
the CPU, a guide: the GPU's fusions need less): the weights take 3 GiB (2
layers, the embedding and the output head). A prefill of B·P = 32K tokens
needs 21 GiB with fastattn, 16 of them its logits (B, P, V) float32; at B =
8, P = 32K, 165 GiB: skipped for every competitor. xla's attention
materializes B·N·P² logits: 51 GiB at B = 8, 4K; 275 GiB at B = 1, 32K
(skipped). A training step needs 20 GiB at 4K tokens and about 95 GiB at
32K (the logits, their log-softmax and its gradient in float32), so train
runs at B = 1, 4K, and at 32K tokens (B = 8, 4K; B = 1, 32K) only where the
GPU needs less than it has free. A decode point holds one cache per
competitor and their random source: 2 GiB each at B = 8, 32K. JAX takes 75%
of a GPU by default; give it more with
``XLA_PYTHON_CLIENT_MEM_FRACTION=0.95``.

Run::

  XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python -m benchmarks.bench_model --out /tmp/model
  python -m benchmarks.bench_model --preset tiny --layers 1 --contexts 64,128 \\
      --dtype float32 --steps 4 --repeats 2 --out /tmp/model      # a CPU smoke run

It prints a table (one row per phase, B and context) and writes
``bench_model.json`` (the environment, the configuration, every row with
every sample) and ``bench_model.png`` (:func:`plot`) to ``--out``. Progress
goes to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from benchmarks.bench import SUBJECT, WARMUP_SECONDS, environment, int_list
from benchmarks.bench_generate import jaxnn_decode_step
from fastattn_jax import KVCache, fast_attention, resolve_implementation
from fastattn_jax.models import llama
from fastattn_jax.timing import median_seconds

#: The competitors, fastattn first: the others are jax.nn's implementations.
NAMES = (SUBJECT, "cudnn", "xla")
PHASES = ("prefill", "train", "decode")


def attention_fn(name: str):
  """Causal attention of competitor ``name`` for ``llama.forward``."""
  if name == SUBJECT:
    return functools.partial(fast_attention, is_causal=True)
  return functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation=name)


def prefill_fn(config: llama.LlamaConfig, name: str):
  """Jitted ``(params, tokens) -> (logits, k, v)``: ``llama.forward`` with ``name``'s attention."""
  return jax.jit(functools.partial(llama.forward, config=config, attention_fn=attention_fn(name)))


def train_fn(config: llama.LlamaConfig, name: str):
  """Jitted ``(params, tokens) -> (loss, grads)``: the mean next-token
  cross-entropy of ``llama.forward``'s logits and its gradient with respect
  to ``params``."""
  attention = attention_fn(name)

  def loss(params, tokens):
    logits, _, _ = llama.forward(params, tokens, config=config, attention_fn=attention)
    log_probs = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    return -jnp.mean(jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1))

  return jax.jit(jax.value_and_grad(loss))


def decode_fn(config: llama.LlamaConfig, name: str, params):
  """``(cache, tokens) -> (logits, cache)``: one decode step of competitor
  ``name`` (the cache donated)."""
  if name == SUBJECT:
    return lambda cache, tokens: llama.decode_step(params, cache, tokens, config=config)
  return lambda cache, tokens: jaxnn_decode_step(params, cache, tokens, config=config,
                                                 implementation=name)


@jax.jit
def _greedy(logits):
  """The next tokens (B, 1) int32 of a step's logits (B, 1, V)."""
  return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def free_bytes(device) -> int:
  """Bytes ``device`` can still allocate: its allocator's limit less what is
  in use, or the host's available memory for devices without memory stats
  (the CPU)."""
  stats = device.memory_stats()
  if stats and "bytes_limit" in stats:
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0)
  return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def needed_bytes(compiled) -> int:
  """Bytes a compiled call allocates beyond its arguments (XLA's memory
  analysis: scratch and outputs, less outputs that alias donated inputs)."""
  m = compiled.memory_analysis()
  return m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes


def _reason(err: Exception) -> str:
  return f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:160]}"


def _gib(nbytes: float) -> str:
  return f"{nbytes / 2**30:.1f} GiB"


def rel_diff(x, ref) -> float:
  """max |x - ref| / max |ref| (0 where ref is all zeros and x equals it)."""
  x, ref = (np.asarray(a, np.float64) for a in (x, ref))
  scale = np.max(np.abs(ref))
  diff = np.max(np.abs(x - ref))
  return float(diff / scale) if scale else float(diff)


def _summarize(results: dict, tokens: int) -> dict:
  """Fills each timed result's median ms and tokens/s; returns the row's
  ``ratio`` (the fastest competitor's ms over fastattn's) and ``best``."""
  for r in results.values():
    if "times_ms" in r:
      r["ms"] = float(np.median(r["times_ms"]))
      r["tokens_per_s"] = tokens / r["ms"] * 1e3
  rivals = [n for n, r in results.items() if n != SUBJECT and "ms" in r]
  if "ms" not in results.get(SUBJECT, {}) or not rivals:
    return {"ratio": None, "best": None}
  best = min(rivals, key=lambda n: results[n]["ms"])
  return {"ratio": results[best]["ms"] / results[SUBJECT]["ms"], "best": best}


def time_calls(fns: dict, args: tuple, fingerprint, repeats: int, device) -> dict:
  """Compiles, checks and times each of ``fns`` (jitted functions of ``args``), in turns.

  ``fingerprint(out)`` picks what is compared with fastattn's result
  (``rel_diff``). Returns ``{name: {"memory_gib", "rel_diff", "times_ms"} or
  {"skipped": reason}}``.
  """
  results, compiled = {}, {}
  for name, fn in fns.items():
    try:
      exe = fn.lower(*args).compile()
    except Exception as err:  # e.g. cuDNN on the CPU
      results[name] = {"skipped": _reason(err)}
      continue
    need, free = needed_bytes(exe), free_bytes(device)
    if need > free:
      results[name] = {"skipped": f"needs {_gib(need)} (XLA memory analysis), {_gib(free)} free"}
      continue
    results[name] = {"memory_gib": need / 2**30}
    compiled[name] = exe
  reference = None
  for name, exe in list(compiled.items()):
    try:
      got = np.asarray(fingerprint(exe(*args)))
      median_seconds(lambda: exe(*args), 1, warmup=0, warmup_seconds=WARMUP_SECONDS)
    except Exception as err:  # e.g. out of memory after all
      results[name] = {"skipped": _reason(err)}
      del compiled[name]
      continue
    if name == SUBJECT:
      reference = got
    elif reference is not None:
      results[name]["rel_diff"] = rel_diff(got, reference)
    results[name]["times_ms"] = []
  for _ in range(repeats):
    for name, exe in compiled.items():
      seconds = median_seconds(lambda: exe(*args), 1, warmup=0)
      results[name]["times_ms"].append(seconds * 1e3)
  return results


def time_decode(steppers: dict, make_cache, lengths, first_tokens, steps: int) -> dict:
  """Checks and times decode steps of each of ``steppers`` (``(cache,
  tokens) -> (logits, cache)``), each over its own ``make_cache()`` whose
  ``lengths`` (B,) are the context, in turns.

  Returns ``{name: {"rel_diff", "times_ms"} or {"skipped": reason}}``.
  """

  def reset(cache):  # back to the context: an untimed step leaves no position behind
    return dataclasses.replace(cache, lengths=jax.device_put(lengths, cache.lengths.sharding))

  results, state, reference = {}, {}, None
  for name, step in steppers.items():
    try:
      logits, cache = step(make_cache(), first_tokens)
      tokens = np.asarray(_greedy(logits))
    except Exception as err:  # e.g. cuDNN on the CPU
      results[name] = {"skipped": _reason(err)}
      continue
    results[name] = {}
    if name == SUBJECT:
      reference = np.asarray(logits)
    elif reference is not None:
      results[name]["rel_diff"] = rel_diff(logits, reference)
    state[name] = reset(cache), tokens
  start = time.perf_counter()
  while time.perf_counter() - start < WARMUP_SECONDS:
    for name, (cache, tokens) in state.items():
      logits, cache = steppers[name](cache, tokens)
      state[name] = reset(cache), np.asarray(_greedy(logits))
  for name in state:
    results[name]["times_ms"] = []
  for _ in range(steps):
    for name, (cache, tokens) in state.items():
      start = time.perf_counter()
      logits, cache = steppers[name](cache, tokens)
      tokens = np.asarray(_greedy(logits))
      results[name]["times_ms"].append((time.perf_counter() - start) * 1e3)
      state[name] = cache, tokens
  return results


def run_point(phase: str, config: llama.LlamaConfig, params, batch: int, context: int,
              names, repeats: int, steps: int, device) -> dict:
  """One row: every competitor of ``names`` in ``phase`` at ``batch`` and ``context``."""
  key = jax.random.key(batch * 1_000_003 + context)
  if phase == "decode":
    tokens = batch  # per call
    shape = (config.num_layers, batch, context, config.num_kv_heads, config.head_dim)
    cache_bytes = (2 * config.num_layers * batch * (context + steps) * config.num_kv_heads
                   * config.head_dim * jnp.dtype(config.dtype).itemsize)
    need, free = (len(names) + 1) * cache_bytes, free_bytes(device)
    if need > free:
      results = {n: {"skipped": f"{len(names)} caches and their source need {_gib(need)}, "
                                f"{_gib(free)} free"} for n in names}
    else:
      k_key, v_key, token_key = jax.random.split(key, 3)
      # Committed to the device, as a prefill's outputs are: from uncommitted
      # arrays the cache's second step would compile again.
      k, v = (jax.device_put(jax.random.normal(kk, shape, config.dtype), device)
              for kk in (k_key, v_key))
      lengths = np.full(batch, context, np.int32)
      first = np.asarray(jax.random.randint(token_key, (batch, 1), 0, config.vocab_size,
                                            jnp.int32))
      results = time_decode(
          {n: decode_fn(config, n, params) for n in names},
          lambda: KVCache.from_prefill(k, v, lengths, context + steps), lengths, first, steps)
      del k, v
  else:
    tokens = batch * context
    ids = jax.device_put(jax.random.randint(key, (batch, context), 0, config.vocab_size,
                                            jnp.int32), device)
    if phase == "prefill":
      fns = {n: prefill_fn(config, n) for n in names}
      fingerprint = lambda out: out[0][:, -1]
    else:
      fns = {n: train_fn(config, n) for n in names}
      fingerprint = lambda out: out[0]
    results = time_calls(fns, (params, ids), fingerprint, repeats, device)
  return {"phase": phase, "batch": batch, "context": context, "tokens_per_call": tokens,
          "results": results, **_summarize(results, tokens)}


def skip_lines(rows: list[dict], names) -> list[str]:
  """One line per competitor and reason it was skipped: the reason, then the points."""
  skips = {}
  for r in rows:
    for n in names:
      if "skipped" in r["results"][n]:
        skips.setdefault((n, r["results"][n]["skipped"]), []).append(
            f"{r['phase']} B={r['batch']} {r['context']}")
  return [f"{n} skipped ({why}) at "
          f"{'every point' if len(where) == len(rows) else ', '.join(where)}"
          for (n, why), where in skips.items()]


def format_table(rows: list[dict], names) -> str:
  """A Markdown table: per row the ms per call of each of ``names``,
  fastattn's tokens/s and its speed over the fastest competitor's ("0.70x
  (cudnn)": fastattn takes 1/0.70 times as long); then ``skip_lines``."""
  head = ["phase", "B", "context"] + [f"{n} ms" for n in names]
  head += [f"{SUBJECT} tok/s", f"{SUBJECT} vs best"]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in rows:
    cells = [r["phase"], str(r["batch"]), str(r["context"])]
    cells += [f"{r['results'][n]['ms']:.3f}" if "ms" in r["results"][n] else "skip"
              for n in names]
    ours = r["results"][SUBJECT]
    cells.append(f"{ours['tokens_per_s']:.0f}" if "ms" in ours else "-")
    cells.append(f"{r['ratio']:.2f}x ({r['best']})" if r["ratio"] else "-")
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines + skip_lines(rows, names))


def _context_label(n: int) -> str:
  return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def plot(rows: list[dict], names, *, title: str):
  """Draws a run's rows: one panel per phase (rows of panels) and batch
  (columns); in each, one group of bars per context, a bar per competitor
  (tokens/s, higher is better), named under it and its ms per call above
  it; a skipped competitor's slot says "skipped", and the reasons are
  written under the panels (``skip_lines``); fastattn's speed over the
  fastest competitor's is written over each group. Returns a
  ``matplotlib.figure.Figure`` (save it with ``savefig``)."""
  from matplotlib.figure import Figure

  phases = [p for p in PHASES if any(r["phase"] == p for r in rows)]
  batches = sorted({r["batch"] for r in rows})
  color = {n: f"C{i}" for i, n in enumerate(names)}
  fig = Figure(figsize=(5.5 * len(batches) + 0.5, 3.6 * len(phases) + 0.8),
               layout="constrained")
  width = 0.8 / len(names)
  for i, phase in enumerate(phases):
    for j, batch in enumerate(batches):
      ax = fig.add_subplot(len(phases), len(batches), i * len(batches) + j + 1)
      sel = sorted((r for r in rows if r["phase"] == phase and r["batch"] == batch),
                   key=lambda r: r["context"])
      top = max((res.get("tokens_per_s", 0) for r in sel for res in r["results"].values()),
                default=0) or 1.0
      ticks, labels = [], []
      for g, r in enumerate(sel):
        for k, n in enumerate(names):
          x = g + (k - (len(names) - 1) / 2) * width
          ticks.append(x)
          labels.append(n)
          res = r["results"][n]
          if "tokens_per_s" in res:
            ax.bar(x, res["tokens_per_s"], width * 0.9, color=color[n])
            ax.annotate(f"{res['ms']:.3g} ms", (x, res["tokens_per_s"]), xytext=(0, 2),
                        textcoords="offset points", ha="center", va="bottom", fontsize=8)
          else:
            ax.text(x, top * 0.02, "skipped", rotation=90, ha="center", va="bottom",
                    fontsize=8, color="gray")
        if r["ratio"]:
          ax.text(g, top * 1.22, f"{SUBJECT} {r['ratio']:.2f}x {r['best']}", ha="center",
                  va="bottom", fontsize=9, fontweight="bold",
                  color="green" if r["ratio"] >= 1 else "firebrick")
        ax.annotate(f"context {_context_label(r['context'])}", (g, 0),
                    xycoords=("data", "axes fraction"), xytext=(0, -30),
                    textcoords="offset points", ha="center", va="top", fontsize=9)
      ax.set_xticks(ticks, labels, fontsize=8)
      ax.set_xlim(-0.6, len(sel) - 0.4)
      ax.set_ylim(0, top * 1.4)
      ax.set_ylabel("tokens/s (higher is better)")
      ax.set_title(f"{phase}, B={batch}")
      ax.grid(True, axis="y", alpha=0.3)
  fig.suptitle(f"{title}\nover each context: the fastest competitor's time ÷ {SUBJECT}'s "
               f"(> 1: {SUBJECT} faster)")
  skips = skip_lines(rows, names)
  if skips:
    fig.supxlabel("\n".join(textwrap.shorten(line, 160) for line in skips), x=0.01,
                  ha="left", fontsize=7, color="dimgray")
  return fig


def main(argv=None) -> list[dict]:
  """Command line; see the module docstring. Returns the rows."""
  parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_model",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default="llama3-8b", choices=sorted(llama.PRESETS))
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--batch", type=int_list, default=(1, 8))
  parser.add_argument("--contexts", type=int_list, default=(4096, 32768),
                      help="prompt length P of prefill and train; cache positions of decode")
  parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
  parser.add_argument("--phases", default=",".join(PHASES),
                      help=f"comma-separated, of {', '.join(PHASES)}")
  parser.add_argument("--repeats", type=int, default=5,
                      help="timed calls per competitor of prefill and train")
  parser.add_argument("--steps", type=int, default=50, help="timed decode steps per competitor")
  parser.add_argument("--out", default="bench_results", help="output directory")
  args = parser.parse_args(argv)
  phases = args.phases.split(",")
  if not set(phases) <= set(PHASES):
    parser.error(f"--phases: choose among {', '.join(PHASES)}, got {args.phases}")

  device = jax.devices()[0]
  config = llama.preset(args.preset, num_layers=args.layers, dtype=args.dtype)
  env = environment()
  env["fastattn_path"] = resolve_implementation(dtype=args.dtype, head_dim=config.head_dim)
  for key, value in env.items():
    print(f"{key:>14}: {value}")
  sys.stdout.flush()
  params = llama.init_params(config, device=device)
  points = [(phase, b, c) for b in args.batch for c in args.contexts for phase in phases]
  rows = [run_point(phase, config, params, b, c, NAMES, args.repeats, args.steps, device)
          for phase, b, c in tqdm(points, desc="model bench", unit="point", file=sys.stderr)]

  print(format_table(rows, NAMES))
  os.makedirs(args.out, exist_ok=True)
  result = {"environment": env, "config": dataclasses.asdict(config), "repeats": args.repeats,
            "steps": args.steps, "rows": rows}
  json_path = os.path.join(args.out, "bench_model.json")
  with open(json_path, "w") as f:
    json.dump(result, f, indent=1)
  png_path = os.path.join(args.out, "bench_model.png")
  title = (f"{args.preset}, {args.layers} layers, {args.dtype}: fastattn ({env['fastattn_path']}) "
           f"against jax.nn\n{env['device']}, JAX {env['jax']}")
  plot(rows, NAMES, title=title).savefig(png_path, dpi=110)
  print(f"wrote {json_path} and {png_path}")
  return rows


if __name__ == "__main__":
  main()
