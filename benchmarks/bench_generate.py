"""Decode speed of a real model: fast_attention's decode path against the same
model with ``jax.nn.dot_product_attention``, in one run.

The model is SmolLM2-135M-Instruct (``fastattn_jax.models.gguf``: 30 layers,
9 query heads, 3 key/value heads, H = 64). For each context (cache positions
before decoding) the cache is filled by one prefill of a real text of that
many tokens (the recorded test prompts, repeated), copied to every sequence of
the batch; then both competitors decode greedily from it, one step each in
turn, each over its own copy of the cache:
* ``fastattn``: ``llama.decode_step`` (``decode_attention``, the platform's
  default path: the fused CPU kernel, or the CUDA decode kernel);
* ``jax.nn``: the same layers with ``jax.nn.dot_product_attention`` over the
  cache with ``key_value_seq_lengths`` (``jaxnn_decode_step``), the
  implementation JAX picks.
A step is one jitted call (cache donated) whose tokens are read back, as in
``fastattn_jax.generate``; tokens/s = B / the median step time after
``WARMUP_STEPS``.

Run::

  python -m benchmarks.bench_generate --out /tmp/generate
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from fastattn_jax import KVCache, decode, resolve_implementation
from fastattn_jax.models import gguf, llama

#: Decode steps of each competitor that compile and warm up, untimed.
WARMUP_STEPS = 2
_PROMPTS = pathlib.Path(__file__).resolve().parents[1] / "tests" / "data" / "smollm2"


@functools.partial(jax.jit, static_argnames=("config", "implementation"),
                   donate_argnames=("cache",))
def jaxnn_decode_step(params, cache: KVCache, tokens, *, config: llama.LlamaConfig,
                      implementation: str | None = None):
  """``llama.decode_step`` over a ``KVCache`` with ``jax.nn.dot_product_attention``
  as the attention: tokens (B, 1) -> (logits (B, 1, V), cache advanced by one).
  ``implementation`` is jax.nn's ("xla", "cudnn"; None: the one JAX picks)."""
  x = llama._embed(params, tokens)
  positions = cache.lengths[:, None]
  ks, vs = [], []
  for layer, p in enumerate(params["layers"]):
    q, k, v = llama._attention_inputs(config, p, x, positions)
    k, v = decode.write(cache.k[layer], cache.v[layer], cache.lengths, k, v)
    attn = jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=cache.lengths + 1,
                                        implementation=implementation)
    x = llama._attention_output_and_mlp(config, p, x, attn)
    ks.append(k)
    vs.append(v)
  cache = KVCache(k=tuple(ks), v=tuple(vs), lengths=cache.lengths + 1)
  return llama._logits(config, params, x), cache


def context_tokens(model: gguf.Model, context: int) -> list[int]:
  """``context`` token ids of real text: the recorded prompts' texts, repeated."""
  reference = json.loads((_PROMPTS / "reference.json").read_text())
  text = "\n\n".join(p["text"] for p in reference["prompts"])
  ids = model.encode(text)
  return (ids * (context // len(ids) + 1))[:context]


def filled_cache(model: gguf.Model, ids: list[int], batch: int, steps: int):
  """A ``KVCache`` holding the prefill of ``ids`` in each of ``batch``
  sequences, with room for ``steps`` more; and the prefill's greedy token."""
  logits, k, v = llama.prefill(model.params, jnp.asarray([ids]), config=model.config)
  k, v = (jnp.broadcast_to(x, (x.shape[0], batch, *x.shape[2:])) for x in (k, v))
  cache = KVCache.from_prefill(k, v, np.full(batch, len(ids)), len(ids) + steps)
  first = jnp.broadcast_to(jnp.argmax(logits[:, -1:], axis=-1).astype(jnp.int32), (batch, 1))
  return cache, first


def run_case(model: gguf.Model, batch: int, context: int, steps: int) -> dict:
  """Each competitor's decode steps at one batch and context: the timed steps'
  seconds (``step_times_s``), their median (``step_s``) and tokens/s."""
  config = model.config
  ids = context_tokens(model, context)
  steppers = {
      "fastattn": lambda c, t: llama.decode_step(model.params, c, t, config=config),
      "jax.nn": lambda c, t: jaxnn_decode_step(model.params, c, t, config=config),
  }
  state, times = {}, {name: [] for name in steppers}
  for name in steppers:
    state[name] = filled_cache(model, ids, batch, steps)
  for step in range(steps):
    for name, stepper in steppers.items():
      cache, tokens = state[name]
      start = time.perf_counter()
      logits, cache = stepper(cache, tokens)
      tokens = np.asarray(jnp.argmax(logits, axis=-1).astype(jnp.int32))
      elapsed = time.perf_counter() - start
      state[name] = cache, tokens
      if step >= WARMUP_STEPS:
        times[name].append(elapsed)
  medians = {name: float(np.median(t)) for name, t in times.items()}
  return {"batch": batch, "context": context, "steps": steps - WARMUP_STEPS,
          "step_times_s": times, "step_s": medians,
          "tokens_per_s": {name: batch / s for name, s in medians.items()},
          "speedup": medians["jax.nn"] / medians["fastattn"]}


def format_table(device: str, rows: list[dict]) -> str:
  lines = [f"| device | B | context | fastattn tok/s | jax.nn tok/s | fastattn / jax.nn |",
           "|---|---|---|---|---|---|"]
  for r in rows:
    t = r["tokens_per_s"]
    lines.append(f"| {device} | {r['batch']} | {r['context']} | {t['fastattn']:.1f} | "
                 f"{t['jax.nn']:.1f} | {r['speedup']:.2f}x |")
  return "\n".join(lines)


def main(argv=None) -> list[dict]:
  """Runs the benchmark (``--help``); prints the table and writes
  ``OUT/bench_generate.json``. Returns the rows."""
  def int_list(text):
    return [int(x) for x in text.split(",")]

  parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_generate",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int_list, default=[1, 8])
  parser.add_argument("--contexts", type=int_list, default=None,
                      help="cache positions before decoding (default: 64,1024 on CPU, "
                           "64,4096 on GPU)")
  parser.add_argument("--steps", type=int, default=None,
                      help=f"decode steps per competitor, {WARMUP_STEPS} untimed (default: 18 "
                           "on CPU, 66 on GPU)")
  parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                      help="default: float32 on CPU, bfloat16 on GPU")
  parser.add_argument("--out", default="bench_results", help="output directory")
  args = parser.parse_args(argv)
  device = jax.devices()[0]
  cpu = device.platform == "cpu"
  dtype = args.dtype or ("float32" if cpu else "bfloat16")
  contexts = args.contexts or ([64, 1024] if cpu else [64, 4096])
  steps = args.steps or (18 if cpu else 66)
  model = gguf.load("smollm2", dtype=dtype, device=device)
  path = resolve_implementation(None, dtype=dtype, head_dim=model.config.head_dim)
  rows = [run_case(model, b, c, steps) for b in args.batch for c in contexts]
  name = f"{device.device_kind} ({dtype}, fastattn path {path})"
  print(format_table(name, rows))
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "bench_generate.json"), "w") as f:
    json.dump({"device": device.device_kind, "dtype": dtype, "path": path,
               "jax_version": jax.__version__, "rows": rows}, f, indent=2)
  return rows


if __name__ == "__main__":
  main()
