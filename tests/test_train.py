"""The training example (``examples.train``): its command line passes on a
short run, and its lockstep check catches a wrong attention gradient."""

import functools

import jax
import numpy as np

from examples import train
from fastattn_jax.models import llama
from fastattn_jax import fast_attention


def test_command_line_trains_in_lockstep_with_jax_nn(capsys):
  assert train.main(["--steps", "8", "--batch", "2", "--seq", "64", "--every", "4",
                     "--lockstep", "8"]) == 0
  out = capsys.readouterr().out
  assert "largest |difference| over the first 8 steps" in out and "median step" in out


def test_a_wrong_key_gradient_breaks_the_lockstep():
  """Keys that get no gradient (as if dK were dropped): the losses part from
  jax.nn's within a few steps, by ten times more than fast_attention's do
  (1e-6 apart on the CPU; 2e-4 on an H100, whose float32 products run in TF32,
  against 1e-2 dropping dK) and by more than the script's 1e-3."""
  config = llama.preset("tiny", dtype="float32", vocab_size=256, max_context=64, num_layers=2)
  data = train.corpus()
  batches = train.windows(data, 2, 64, 6, seed=0)
  held_out = batches[0]
  causal = functools.partial(fast_attention, is_causal=True)
  no_key_grad = lambda q, k, v: causal(q, jax.lax.stop_gradient(k), v)
  runs = [train.train(fn, config, batches, held_out, learning_rate=2e-3, seed=0)
          for fn in (causal, no_key_grad,
                     functools.partial(jax.nn.dot_product_attention, is_causal=True))]
  good = np.max(np.abs(runs[0].losses - runs[2].losses))
  bad = np.max(np.abs(runs[1].losses - runs[2].losses))
  assert good < 1e-3 and bad > max(10 * good, 1e-3), (good, bad)
