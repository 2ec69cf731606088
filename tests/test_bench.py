"""The prefill benchmark's picture (``benchmarks.bench.plot``), drawn from
synthetic rows without timing anything: one column of panels per (dtype, head
dim, causal), one line per implementation named at its end (no legend, no
two names on top of each other, all inside the figure), units that fit the
platform, ratios to the fastest competitor with the line at 1.0; and
``--plot-only`` redraws a saved ``bench.json``."""

import dataclasses
import json

import pytest

matplotlib = pytest.importorskip("matplotlib")
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402

from benchmarks import bench  # noqa: E402

LENGTHS = (512, 1024, 2048)


def row(case: bench.Case, **gflops) -> dict:
  """A ``run_case`` row: ``name=GFLOP/s`` per implementation, None for a skip;
  the compiled scratch is the T x S logits for xla, 4 KiB otherwise."""
  results = {}
  for name, value in gflops.items():
    memory = {"temp_size_in_bytes": case.logits_bytes() if name == "xla" else 4096}
    results[name] = ({"memory": memory, "skipped": "its logits exceed the budget"}
                     if value is None else
                     {"memory": memory, "skipped": None, "ms": case.flops() / value / 1e6,
                      "repeats": 3, "gflops": value})
  return {"case": dataclasses.asdict(case), "flops": case.flops(), "results": results,
          "speedup": {}}


def cpu_rows() -> list[dict]:
  rows = [row(bench.Case(1, n, n, 8, 8, 64, causal, "float32"),
              fastattn=100.0 + n / 100, xla=None if n == 2048 else 20.0)
          for n in LENGTHS for causal in (False, True)]
  return rows + [row(bench.Case(1, 1, 4096, 8, 8, 64, False, "float32"), fastattn=5.0, xla=1.0)]


def gpu_rows() -> list[dict]:
  """fastattn at 400 TFLOP/s (H=64) and 500 (H=128) against cuDNN at 500."""
  return [row(bench.Case(16384 // n, n, n, 2048 // h, 2048 // h, h, causal, dtype),
              fastattn=h * 1e3 + 3e5, xla=60e3, cudnn=5e5, fastattn_sm80=280e3)
          for dtype in ("bfloat16", "float16") for h in (64, 128) for n in LENGTHS
          for causal in (False, True)]


def draw(rows, platform_name):
  fig = bench.plot(rows, platform_name=platform_name, title="synthetic")
  canvas = FigureCanvasAgg(fig)
  canvas.draw()
  return fig, canvas.get_renderer()


def panels(fig, ylabel_part):
  return [ax for ax in fig.axes if ylabel_part in ax.get_ylabel()]


def assert_lines_named_apart(fig, renderer):
  """No legend; in every panel, one name per line, no two overlapping, each
  inside the figure."""
  assert not fig.legends
  for ax in fig.axes:
    drawn = [line for line in ax.lines if list(line.get_ydata()) != [1.0, 1.0]]
    boxes = [text.get_window_extent(renderer) for text in ax.texts]
    assert len(boxes) == len(drawn), ax.get_ylabel()
    for i, box in enumerate(boxes):
      assert fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1, ax.texts[i].get_text()
      assert not any(box.overlaps(other) for other in boxes[i + 1:]), ax.texts[i].get_text()


def assert_ratio_line_at_one(ax):
  assert any(list(line.get_ydata()) == [1.0, 1.0] for line in ax.lines)


def test_cpu_figure_gflops_ratio_and_memory():
  fig, renderer = draw(cpu_rows(), "cpu")
  assert len(fig.axes) == 6
  speeds = panels(fig, "GFLOP/s")
  ratios = panels(fig, "speed ÷ xla")
  memories = panels(fig, "memory")
  assert [ax.get_title() for ax in speeds] == ["float32, H=64, N=8, B=1, non-causal",
                                               "float32, H=64, N=8, B=1, causal"]
  for speed, ratio, memory in zip(speeds, ratios, memories):
    assert speed.get_xscale() == memory.get_xscale() == "log"
    # One line per implementation; the decode row (T=1) is not drawn.
    assert len(speed.lines) == 2 and len(memory.lines) == 2
    for line in speed.lines:
      assert set(line.get_xdata()) <= set(LENGTHS)
    # xla skipped at 2048: no ratio there.
    (line,) = [line for line in ratio.lines if list(line.get_ydata()) != [1.0, 1.0]]
    assert list(line.get_xdata()) == [512, 1024]
    assert line.get_ydata()[0] == pytest.approx((100 + 5.12) / 20)
    assert_ratio_line_at_one(ratio)
  assert [t.get_text() for t in speeds[0].texts] == ["xla", "fastattn"]
  assert [t.get_text() for t in ratios[0].texts] == ["fastattn 5.51x"]
  assert_lines_named_apart(fig, renderer)


def test_gpu_figure_tflops_per_dtype_head_dim_and_causal():
  fig, renderer = draw(gpu_rows(), "gpu")
  speeds = panels(fig, "TFLOP/s")
  ratios = panels(fig, "speed ÷ fastest of xla, cudnn")
  assert len(fig.axes) == 16 and len(speeds) == 8 and len(ratios) == 8
  assert not panels(fig, "GFLOP/s") and not panels(fig, "memory")
  assert [ax.get_title() for ax in speeds[:4]] == [
      "bfloat16, H=64, N=32, B·S=16384, non-causal", "bfloat16, H=64, N=32, B·S=16384, causal",
      "bfloat16, H=128, N=16, B·S=16384, non-causal", "bfloat16, H=128, N=16, B·S=16384, causal"]
  for ax, h in zip(speeds, (64, 64, 128, 128) * 2):
    assert len(ax.lines) == 4  # 4 implementations
    fastattn = ax.lines[0]
    assert list(fastattn.get_ydata()) == pytest.approx([h + 300] * len(LENGTHS))
  for ax, h in zip(ratios, (64, 64, 128, 128) * 2):
    assert_ratio_line_at_one(ax)
    # fastattn and fastattn_sm80 against cuDNN (the fastest rival).
    ys = sorted({round(y, 6) for line in ax.lines for y in line.get_ydata()} - {1.0})
    assert ys == [0.56, round((h + 300) / 500, 6)]
  assert_lines_named_apart(fig, renderer)


def test_close_lines_are_named_apart():
  """Five implementations within 1% of each other, as the forced older
  paths can be: their names are moved apart, not drawn over each other."""
  rows = [r for r in gpu_rows() if r["case"]["dtype"] == "bfloat16"]
  for r in rows:
    for name in ("fastattn", "cudnn", "fastattn_sm80"):
      r["results"][name]["gflops"] = 5e5
    r["results"]["fastattn_sm75"] = dict(r["results"]["fastattn_sm80"], gflops=4.99e5)
  fig, renderer = draw(rows, "gpu")
  assert len(panels(fig, "TFLOP/s")) == 4
  assert_lines_named_apart(fig, renderer)


def test_best_competitor_ratio_ignores_our_own_paths():
  results = row(bench.Case(1, 8, 8, 1, 1, 8, False, "float16"),
                fastattn=300.0, fastattn_sm80=900.0, xla=100.0, cudnn=None)["results"]
  assert bench.best_competitor_ratio(results, "fastattn") == pytest.approx(3.0)
  results["xla"] = {"memory": {}, "skipped": "does not run"}
  assert bench.best_competitor_ratio(results, "fastattn") is None


def test_plot_needs_square_rows():
  with pytest.raises(ValueError, match="T = S"):
    bench.plot(cpu_rows()[-1:], platform_name="cpu", title="decode only")


def test_plot_only_redraws_a_saved_run(tmp_path, capsys):
  env = {"platform": "gpu", "device": "a GPU (1 device(s), 16 CPU cores)", "jax": "0.10.2",
         "fastattn_path": "cuda_sm90"}
  path = tmp_path / "bench.json"
  path.write_text(json.dumps({"environment": env, "rows": gpu_rows()}))
  bench.main(["--plot-only", str(path)])
  png = tmp_path / "bench.png"
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert str(png) in capsys.readouterr().out
