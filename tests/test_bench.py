"""The prefill benchmark's picture (``benchmarks.bench.plot``), drawn from
synthetic rows without timing anything: one column of panels per (dtype, head
dim), units that fit the platform, ratios to the fastest competitor with the
line at 1.0, the legend clear of every panel; and ``--plot-only`` redraws a
saved ``bench.json``."""

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


def assert_legend_clear_of_the_panels(fig, renderer):
  (legend,) = fig.legends
  box = legend.get_window_extent(renderer)
  for ax in fig.axes:
    assert not box.overlaps(ax.get_window_extent(renderer)), ax.get_title()
  assert fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1 and fig.bbox.y0 <= box.y0


def assert_ratio_line_at_one(ax):
  assert any(list(line.get_ydata()) == [1.0, 1.0] for line in ax.lines)


def test_cpu_figure_gflops_ratio_and_memory():
  fig, renderer = draw(cpu_rows(), "cpu")
  assert len(fig.axes) == 3
  (speed,) = panels(fig, "GFLOP/s")
  (ratio,) = panels(fig, "speed ÷ xla")
  (memory,) = panels(fig, "memory")
  assert speed.get_title() == "float32, H=64, N=8, B=1"
  assert speed.get_xscale() == memory.get_xscale() == "log"
  # One line per (implementation, causal); the decode row (T=1) is not drawn.
  assert len(speed.lines) == 4 and len(memory.lines) == 4
  for line in speed.lines:
    assert set(line.get_xdata()) <= set(LENGTHS)
  # xla skipped at 2048: no ratio there.
  ratios = [line for line in ratio.lines if list(line.get_ydata()) != [1.0, 1.0]]
  assert [list(line.get_xdata()) for line in ratios] == [[512, 1024]] * 2
  assert ratios[0].get_ydata()[0] == pytest.approx((100 + 5.12) / 20)
  assert_ratio_line_at_one(ratio)
  assert_legend_clear_of_the_panels(fig, renderer)


def test_gpu_figure_tflops_per_dtype_and_head_dim():
  fig, renderer = draw(gpu_rows(), "gpu")
  speeds = panels(fig, "TFLOP/s")
  ratios = panels(fig, "speed ÷ fastest of\nxla, cudnn")
  assert len(fig.axes) == 8 and len(speeds) == 4 and len(ratios) == 4
  assert not panels(fig, "GFLOP/s") and not panels(fig, "memory")
  assert [ax.get_title() for ax in speeds] == [
      "bfloat16, H=64, N=32, B·S=16384", "bfloat16, H=128, N=16, B·S=16384",
      "float16, H=64, N=32, B·S=16384", "float16, H=128, N=16, B·S=16384"]
  for ax, h in zip(speeds, (64, 128, 64, 128)):
    assert len(ax.lines) == 8  # 4 implementations x causal or not
    fastattn = ax.lines[0]  # the first implementation, non-causal
    assert list(fastattn.get_ydata()) == pytest.approx([h + 300] * len(LENGTHS))
  for ax, h in zip(ratios, (64, 128, 64, 128)):
    assert_ratio_line_at_one(ax)
    # fastattn and fastattn_sm80, causal or not, against cuDNN (the fastest rival).
    ys = sorted({round(y, 6) for line in ax.lines for y in line.get_ydata()} - {1.0})
    assert ys == [0.56, round((h + 300) / 500, 6)]
  assert_legend_clear_of_the_panels(fig, renderer)


def test_one_dtype_on_a_gpu_keeps_the_whole_legend_in_view():
  """Two columns of panels (one dtype) and five implementations, as
  ``--dtype bfloat16`` on an H100 draws them: the legend wraps into rows
  instead of running off the figure's edges."""
  rows = [r for r in gpu_rows() if r["case"]["dtype"] == "bfloat16"]
  for r in rows:
    r["results"]["fastattn_sm75"] = dict(r["results"]["fastattn_sm80"], gflops=190e3)
  fig, renderer = draw(rows, "gpu")
  assert len(panels(fig, "TFLOP/s")) == 2
  (legend,) = fig.legends
  assert len(legend.get_texts()) == 5 + 2 + 1
  assert_legend_clear_of_the_panels(fig, renderer)


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
