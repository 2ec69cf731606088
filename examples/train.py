"""Training a small Llama-style language model with ``fast_attention``, against jax.nn.

Run ``python -m examples.train [--steps 200] [--batch 4] [--seq 512]``.

The model is :mod:`fastattn_jax.models.llama`'s ``tiny`` preset (4 layers, width 256, 8
query heads sharing 2 key/value heads of head dim 32) in float32, reading
bytes (a 256-token vocabulary). The text is real English prose that every
Python installation carries: the Python language reference's topics as
``help()`` shows them (the standard library's ``pydoc_data.topics``, about
460 KB), cut into random windows of ``seq + 1`` bytes; the last 5% are held
out. Training minimizes next-byte cross-entropy with AdamW (``optax``).

The same initial weights are trained twice on the same batches: once with
:func:`fastattn_jax.fast_attention` (causal) and once with
``jax.nn.dot_product_attention`` (causal, its default implementation). The
gradients of attention come from fast_attention's fused backward (on CPUs;
float32 inputs on a GPU take the "xla" path, the reference math). The
script prints both loss curves side by side, the held-out losses and the
median wall time of a training step of each, and checks (exit status 1 if
not) that

* the curves agree step by step within ``--tolerance`` nats over the first
  ``--lockstep`` steps. Any error in a gradient shows there: the runs start
  from the same bits, and a wrong gradient changes the next loss at once;
* the held-out losses after training agree within 3%. Two float32 runs whose
  gradients differ only in rounding drift apart once training amplifies the
  difference (here within 1e-5 nats for the first 75 steps, then apart by up
  to 0.05 nats by step 200, both ways, as two correct runs do).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pydoc_data.topics

from fastattn_jax import fast_attention, resolve_implementation
from fastattn_jax.models import llama


def corpus() -> np.ndarray:
  """The text as bytes (uint8): every topic of ``pydoc_data.topics``, in key order."""
  topics = pydoc_data.topics.topics
  text = "\n\n".join(topics[key] for key in sorted(topics))
  return np.frombuffer(text.encode("utf-8"), np.uint8)


def windows(data: np.ndarray, batch: int, seq: int, steps: int, seed: int) -> np.ndarray:
  """``steps`` batches of ``batch`` random windows of ``seq + 1`` bytes: (steps, batch, seq + 1)."""
  starts = np.random.default_rng(seed).integers(0, len(data) - seq - 1, (steps, batch))
  return data[starts[..., None] + np.arange(seq + 1)].astype(np.int32)


def loss_fn(params, tokens, *, config, attention_fn):
  """Mean next-byte cross-entropy (nats) of (B, seq + 1) windows."""
  logits, _, _ = llama.forward(params, tokens[:, :-1], config=config, attention_fn=attention_fn)
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


class Run(NamedTuple):
  losses: np.ndarray      # (steps,) training loss before each step
  held_out: float         # loss on the held-out batch after training
  step_seconds: float     # median wall time of a step (compiled)


def train(attention_fn: Callable, config: llama.LlamaConfig, batches: np.ndarray,
          held_out: np.ndarray, *, learning_rate: float, seed: int) -> Run:
  """Trains ``config`` from ``init_params(config, seed)`` on ``batches``."""
  params = llama.init_params(config, seed)
  optimizer = optax.adamw(learning_rate)
  loss = functools.partial(loss_fn, config=config, attention_fn=attention_fn)

  @jax.jit
  def step(params, opt_state, tokens):
    value, grads = jax.value_and_grad(loss)(params, tokens)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  opt_state = optimizer.init(params)
  losses, seconds = [], []
  for tokens in batches:
    start = time.perf_counter()
    params, opt_state, value = step(params, opt_state, tokens)
    losses.append(float(value))  # waits for the step
    seconds.append(time.perf_counter() - start)
  held = float(jax.jit(loss)(params, held_out))
  return Run(np.asarray(losses), held, float(np.median(seconds[1:] or seconds)))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m examples.train", description=__doc__.split(
      "\n\n")[0])
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--seq", type=int, default=512, help="bytes per training window")
  parser.add_argument("--learning-rate", type=float, default=2e-3)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--tolerance", type=float, default=1e-3,
                      help="largest |loss difference| allowed over the first --lockstep steps")
  parser.add_argument("--lockstep", type=int, default=50,
                      help="steps over which the two runs must agree within --tolerance")
  parser.add_argument("--every", type=int, default=25, help="print every this many steps")
  args = parser.parse_args(argv)

  config = llama.preset("tiny", dtype="float32", vocab_size=256, max_context=args.seq)
  data = corpus()
  split = int(len(data) * 0.95)
  batches = windows(data[:split], args.batch, args.seq, args.steps, args.seed)
  held_out = windows(data[split:], 4 * args.batch, args.seq, 1, args.seed + 1)[0]
  print(f"text: pydoc_data.topics, {len(data):,} bytes; model: tiny Llama, "
        f"{config.num_layers} layers, N={config.num_heads}, K={config.num_kv_heads}, "
        f"H={config.head_dim}, float32; batches of {args.batch} x {args.seq} bytes; "
        f"fast_attention path {resolve_implementation(dtype=jnp.float32, head_dim=32)!r}")

  runs = {}
  for name, fn in (("fast_attention", functools.partial(fast_attention, is_causal=True)),
                   ("jax.nn", functools.partial(jax.nn.dot_product_attention, is_causal=True))):
    runs[name] = train(fn, config, batches, held_out, learning_rate=args.learning_rate,
                       seed=args.seed)
  ours, theirs = runs["fast_attention"], runs["jax.nn"]
  print(f"\n{'step':>6} {'fast_attention':>15} {'jax.nn':>10} {'difference':>11}")
  for i in list(range(0, args.steps, args.every)) + [args.steps - 1]:
    print(f"{i:>6} {ours.losses[i]:>15.4f} {theirs.losses[i]:>10.4f} "
          f"{ours.losses[i] - theirs.losses[i]:>11.2e}")
  lockstep = min(args.lockstep, args.steps)
  worst = float(np.max(np.abs(ours.losses[:lockstep] - theirs.losses[:lockstep])))
  held_gap = abs(ours.held_out / theirs.held_out - 1)
  print(f"\nlargest |difference| over the first {lockstep} steps: {worst:.2e} nats "
        f"(tolerance {args.tolerance}); over all {args.steps}: "
        f"{np.max(np.abs(ours.losses - theirs.losses)):.2e}")
  print(f"held-out loss: fast_attention {ours.held_out:.4f}, jax.nn {theirs.held_out:.4f} "
        f"({held_gap:.1%} apart; uniform over bytes: {np.log(256):.4f})")
  print(f"median step: fast_attention {ours.step_seconds * 1e3:.1f} ms, jax.nn "
        f"{theirs.step_seconds * 1e3:.1f} ms ({theirs.step_seconds / ours.step_seconds:.2f}x)")
  return 0 if worst <= args.tolerance and held_gap <= 0.03 else 1


if __name__ == "__main__":
  sys.exit(main())
