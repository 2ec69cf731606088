"""The training-feature benchmark's harness, without timing: documents fill
each packed row exactly, and the tables carry the ratios the targets are
stated in."""

import numpy as np

from benchmarks import bench_features


def test_documents_fill_the_row():
  rng = np.random.default_rng(0)
  for T in (7, 2048, 16384):
    docs = bench_features.documents(rng, T)
    assert sum(docs) == T and min(docs) >= 1
    assert all(n <= T // 2 for n in docs[:-1])


def test_tables_give_the_ratios():
  packed = [{"T": 2048, "documents": [900, 1148], "packed": 2.0, "separate": 1.6,
             "dense mask": 5.0}]
  features = [{"T": 2048, "plain": 4.0, "sinks": 4.1, "alibi": 4.4}]
  table = bench_features.format_tables(packed, features)
  assert "| 2048 | 2 | 2.00 | 1.60 | 5.00 | 1.25x | 2.50x |" in table
  assert "| 2048 | 4.00 | 4.10 | 4.40 | 1.025 | 1.100 |" in table
