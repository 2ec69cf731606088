"""The whole-model benchmark (``benchmarks.bench_model``): a run on the host CPU
times every phase of fastattn and xla over equal work (their results agree)
and skips cuDNN with its reason; the table's ratio is against the fastest
competitor that ran."""

import json

import jax
import pytest

pytest.importorskip("matplotlib")

from benchmarks import bench_model  # noqa: E402

CONTEXTS = (64, 128)


@pytest.mark.skipif(jax.default_backend() != "cpu",
                    reason="checks a run on the host CPU, where cuDNN is skipped; on a GPU the "
                           "benchmark's own run is the check")
def test_tiny_run_on_the_host(tmp_path, capsys):
  bench_model.main(["--preset", "tiny", "--layers", "1", "--batch", "2", "--contexts",
                    ",".join(map(str, CONTEXTS)), "--dtype", "float32", "--steps", "2",
                    "--repeats", "1", "--out", str(tmp_path)])
  result = json.loads((tmp_path / "bench_model.json").read_text())
  assert (tmp_path / "bench_model.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert result["config"]["num_layers"] == 1 and result["environment"]["platform"] == "cpu"
  rows = result["rows"]
  assert sorted((r["phase"], r["context"]) for r in rows) == sorted(
      (p, c) for p in bench_model.PHASES for c in CONTEXTS)
  for r in rows:
    assert r["batch"] == 2
    assert r["tokens_per_call"] == (2 if r["phase"] == "decode" else 2 * r["context"])
    fast, cudnn, xla = (r["results"][n] for n in bench_model.NAMES)
    expected = 2 if r["phase"] == "decode" else 1
    for timed in (fast, xla):
      assert len(timed["times_ms"]) == expected and timed["ms"] > 0, r
      assert timed["tokens_per_s"] == pytest.approx(r["tokens_per_call"] / timed["ms"] * 1e3)
    assert "cuDNN" in cudnn["skipped"]
    # Equal work: the same logits (or loss) within float32 rounding.
    assert xla["rel_diff"] < 1e-4, r
    assert r["best"] == "xla" and r["ratio"] == pytest.approx(xla["ms"] / fast["ms"])
  out = capsys.readouterr().out
  assert "| decode | 2 | 128 |" in out
  assert "cudnn skipped (RuntimeError: cuDNN is not detected.) at every point" in out


def test_table_compares_with_the_fastest_competitor_that_ran():
  results = {"fastattn": {"times_ms": [2.0, 1.0, 3.0]}, "cudnn": {"times_ms": [2.5]},
             "xla": {"skipped": "needs 137.0 GiB (XLA memory analysis), 75.0 GiB free"}}
  row = {"phase": "prefill", "batch": 8, "context": 32768, "tokens_per_call": 8 * 32768,
         "results": results, **bench_model._summarize(results, 8 * 32768)}
  assert results["fastattn"]["ms"] == 2.0
  assert results["fastattn"]["tokens_per_s"] == pytest.approx(8 * 32768 / 2e-3)
  assert (row["best"], row["ratio"]) == ("cudnn", 1.25)
  lines = bench_model.format_table([row], bench_model.NAMES).splitlines()
  assert lines[2] == "| prefill | 8 | 32768 | 2.000 | 2.500 | skip | 131072000 | 1.25x (cudnn) |"
  assert lines[3] == ("xla skipped (needs 137.0 GiB (XLA memory analysis), 75.0 GiB free) at "
                      "every point")
