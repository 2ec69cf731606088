"""Benchmark: ``fast_attention`` against ``jax.nn.dot_product_attention`` (XLA, cuDNN)
and, on the CPU, PyTorch's ``scaled_dot_product_attention`` where torch is installed.

What it measures, for each shape of a grid chosen per platform (the forward
pass, or with ``--backward`` forward + backward, ``jax.grad`` of sum(out^2);
jitted, inputs already on the device):

* time: ``fastattn_jax.timing.median_seconds`` of the compiled function
  after a warm-up call: the median of loops of calls (20 on GPUs, 1 on the
  CPU) that wait for the last call; the number of loops adapts to the cost
  of one so that large shapes stay affordable;
* throughput: FLOP/s = FLOPs / time with FLOPs = 4 * B * N * H * (visible
  query-key pairs): two matrix products (Q K^T and P V) of 2 * H FLOPs per
  pair. The pairs are T * S without a mask; with ``is_causal`` only the
  visible ones count (T * (T + 1) / 2 for T = S), so causal FLOP/s are
  "useful" FLOP/s, comparable with the non-causal ones. Printed and drawn in
  TFLOP/s on GPUs, GFLOP/s on the CPU; ``bench.json`` holds GFLOP/s;
* speedup: competitor time / fast_attention time;
* memory: XLA's compile-time memory analysis of each jitted function
  (``temp_size_in_bytes``: the scratch buffers XLA allocates, e.g. the T x S
  logits of the unfused path). Workspace that a fused kernel allocates
  internally is not visible to XLA and not counted.

On a host with an Ascend NPU and torch_npu (``_ascend_competitors``), the
CPU grid adds fast_attention's "ascend" path and CANN's FlashAttentionScore
(``torch_npu.npu_fusion_attention``, the vendor baseline), both timed from
host arrays: each call copies its operands to the NPU and the result back.

Competitors that materialize the T x S logits are skipped (reported as
"skip", with the reason) where one float32 B x N x T x S buffer would exceed
``--memory-budget`` (default a quarter of the memory: RAM on CPU); they are
never run into an out-of-memory kill. Their compiled memory is still
reported.

Run::

  python -m benchmarks.bench                # full grid (about 10-15 min on 2 CPU cores)
  python -m benchmarks.bench --quick        # tiny grid, a smoke test
  python -m benchmarks.bench --seq-lens 512,1024 --decode-lens 4096 --out /tmp/b
  python -m benchmarks.bench --backward     # forward + backward (jax.grad), T = S rows

  python -m benchmarks.bench --plot-only gpu_run/bench.json   # redraw gpu_run/bench.png

It prints a table and writes ``bench.json`` (the environment and every row)
and ``bench.png`` (:func:`plot`: throughput and the ratio to the fastest
competitor per dtype, head dim and causality) to ``--out`` (default ``bench_results/``).
Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import sys
from typing import Callable, NamedTuple

import humanize
import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

import fastattn_jax
from fastattn_jax import ascend, fast_attention, resolve_implementation
from fastattn_jax.timing import median_seconds

SUBJECT = "fastattn"
# Each competitor runs this long before it is timed: GPU clocks fall while a
# case compiles, and short first loops would time them still rising (the
# H100, decode B = 1, S = 4K, 50 calls in 3 ms: 60 us per call, against 36
# us at S = 16K, timed after it).
WARMUP_SECONDS = 0.3


@dataclasses.dataclass(frozen=True)
class Case:
  """One benchmark shape: q (B, T, N, H), k and v (B, S, K, H)."""
  B: int
  T: int
  S: int
  N: int
  K: int
  H: int
  causal: bool
  dtype: str
  backward: bool = False  # time jax.grad of sum(out^2) (forward + backward) instead

  def visible_pairs(self) -> int:
    """Query-key pairs that attention computes (jax.nn's causal: key j <= query i)."""
    if not self.causal:
      return self.T * self.S
    diagonal = min(self.T, self.S)  # rows i < S see i + 1 keys, later rows all S
    return diagonal * (diagonal + 1) // 2 + (self.T - diagonal) * self.S

  def flops(self) -> int:
    """FLOPs: 4 * B * N * H per visible query-key pair for the forward pass;
    with ``backward``, 3.5 times that (the backward's five products, S and dP
    recomputed, dV, dK and dQ, counted as 2.5 forwards, as FlashAttention-2
    does)."""
    forward = 4 * self.B * self.N * self.H * self.visible_pairs()
    return forward * 7 // 2 if self.backward else forward

  def logits_bytes(self) -> int:
    """Size of one float32 B x N x T x S buffer, what an unfused path materializes."""
    return 4 * self.B * self.N * self.T * self.S


class Competitor(NamedTuple):
  """An attention function to time: ``make(case)`` returns ``f(q, k, v)``, a
  JAX function; with ``native``, ``make(case, q, k, v)`` returns a function of
  no arguments that runs the whole measured computation outside JAX (another
  framework's attention on its own copies of the inputs) and waits for it."""
  name: str
  make: Callable[..., Callable]
  materializes_logits: bool
  native: bool = False


def _format_bytes(nbytes: float) -> str:
  return humanize.naturalsize(nbytes, binary=True, format="%.2f")


def _fast(case: Case) -> Callable:
  return functools.partial(fast_attention, is_causal=case.causal)


def _jax_nn(implementation: str) -> Callable[[Case], Callable]:
  def make(case: Case) -> Callable:
    return functools.partial(jax.nn.dot_product_attention, is_causal=case.causal,
                             implementation=implementation)
  return make


def _deterministic(case: Case) -> Callable:
  return functools.partial(fast_attention, is_causal=case.causal, deterministic=True)


def _forced(path: str) -> Callable[[Case], Callable]:
  def make(case: Case) -> Callable:
    return functools.partial(fast_attention, is_causal=case.causal, implementation=path)
  return make


def competitors(platform_name: str, dtype: str, backward: bool = False) -> list[Competitor]:
  """fast_attention first, then what it is compared with on a JAX platform
  ("cpu", "gpu"), for inputs of ``dtype`` (a dtype name such as "bfloat16":
  it picks fast_attention's default path).

  Everywhere jax.nn with "xla"; on the CPU also PyTorch's fused
  scaled_dot_product_attention where torch is installed; on GPUs jax.nn with
  "cudnn", and
  fast_attention forced onto the older kernel paths the GPU also runs
  ("cuda_sm80" under a "cuda_sm90" default, "cuda_sm75" under either), to
  time them on the same silicon. With ``backward`` under a "cuda_sm90"
  default (the one backward that adds dQ by atomics), also fast_attention
  with ``deterministic=True``: its speedup column is the cost of the fixed
  order.
  """
  backend = "cuda" if platform_name == "gpu" else platform_name
  fast_path = resolve_implementation(backend=backend, dtype=dtype)
  comps = [
      Competitor(SUBJECT, _fast, materializes_logits=fast_path == "xla"),
      Competitor("xla", _jax_nn("xla"), materializes_logits=True),
  ]
  if backend == "cpu":
    comps += _torch_competitors()
  if backend == "cpu" and not backward:
    comps += _ascend_competitors()
  if backend == "cuda":
    comps.append(Competitor("cudnn", _jax_nn("cudnn"), materializes_logits=False))
    if fast_path == "cuda_sm90":
      comps.append(Competitor("fastattn_sm80", _forced("cuda_sm80"), materializes_logits=False))
    if fast_path in ("cuda_sm80", "cuda_sm90"):
      comps.append(Competitor("fastattn_sm75", _forced("cuda_sm75"), materializes_logits=False))
    if fast_path == "cuda_sm90" and backward:
      comps.append(Competitor("fastattn_deterministic", _deterministic, materializes_logits=False))
  return comps


def _torch_competitors() -> list[Competitor]:
  """PyTorch's ``scaled_dot_product_attention`` on the CPU (its fused
  FlashAttention-style CPU kernel), where torch is installed; forward, or
  with ``case.backward`` forward + backward of sum(out^2) by autograd, timed
  natively (no JAX in the loop) on the same inputs, BSND -> BNSD."""
  try:
    import torch
  except ImportError:
    return []

  def make(case: Case, q, k, v) -> Callable:
    def tensor(x):
      return torch.from_numpy(np.array(x.astype(jnp.float32))).to(
          getattr(torch, case.dtype)).transpose(1, 2).contiguous().requires_grad_(case.backward)

    tq, tk, tv = tensor(q), tensor(k), tensor(v)
    sdpa = functools.partial(torch.nn.functional.scaled_dot_product_attention,
                             is_causal=case.causal, enable_gqa=case.N != case.K)

    def run() -> None:
      if case.backward:
        torch.autograd.grad(sdpa(tq, tk, tv).float().square().sum(), (tq, tk, tv))
      else:
        with torch.no_grad():
          sdpa(tq, tk, tv)

    return run

  return [Competitor("torch_sdpa", make, materializes_logits=False, native=True)]


def _ascend_competitors() -> list[Competitor]:
  """fast_attention on the NPU ("ascend") and torch_npu's npu_fusion_attention
  (CANN's FlashAttentionScore, BSND layout, sparse_mode 3 for jax.nn's
  causal alignment at T = S), where torch_npu imports, an NPU is present and
  the "ascend" path can build; else none. The vendor call runs through
  ``jax.pure_callback`` (host arrays in and out, as the "ascend" custom call
  takes them)."""
  try:
    import torch
    import torch_npu
    present = torch.npu.is_available()
  except Exception:  # not installed, or installed without CANN
    return []
  if not present or ascend.unavailable("ascend"):
    return []

  def vendor(case: Case) -> Callable:
    causal_mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1).npu()

    def run(q, k, v):
      dtype = getattr(torch, case.dtype)
      t = lambda x: torch.from_numpy(np.asarray(x, np.float32)).to(dtype).npu()
      out = torch_npu.npu_fusion_attention(
          t(q), t(k), t(v), case.N, "BSND", scale=case.H ** -0.5,
          atten_mask=causal_mask if case.causal else None, sparse_mode=3 if case.causal else 0)[0]
      return out.float().cpu().numpy().astype(q.dtype)

    return lambda q, k, v: jax.pure_callback(run, jax.ShapeDtypeStruct(q.shape, q.dtype), q, k, v)

  return [Competitor("fastattn_ascend", _forced("ascend"), materializes_logits=False),
          Competitor("npu_fusion_attention", vendor, materializes_logits=False)]


def cpu_grid(dtype: str, seq_lens, decode_lens) -> list[Case]:
  """B=1, N=8, H=64: T = S, causal and not; then decode rows T=1 (non-causal:
  with jax.nn's top-left causal alignment a single query would see one key)."""
  cases = [Case(1, n, n, 8, 8, 64, causal, dtype)
           for n in seq_lens for causal in (False, True)]
  cases += [Case(1, 1, s, 8, 8, 64, False, dtype) for s in decode_lens]
  return cases


def gpu_grid(dtype: str, seq_lens, decode_lens) -> list[Case]:
  """The GPU grid, FlashAttention-3's (Shah et al., 2024, section 4.1):
  B * S = 16384 tokens and N * H = 2048 for H in {64, 128, 256}, T = S,
  causal and not, in float16 and bfloat16 (``dtype`` "both")."""
  del decode_lens  # decode has its own benchmark, benchmarks.bench_decode
  dtypes = ("bfloat16", "float16") if dtype == "both" else (dtype,)
  return [Case(16384 // n, n, n, 2048 // h, 2048 // h, h, causal, dt)
          for dt in dtypes for h in (64, 128, 256) for n in seq_lens
          for causal in (False, True)]


class Grid(NamedTuple):
  """A platform's grid: ``cases(dtype, seq_lens, decode_lens)`` and its defaults."""
  cases: Callable[..., list[Case]]
  dtype: str
  seq_lens: tuple[int, ...]
  decode_lens: tuple[int, ...]
  quick_seq_lens: tuple[int, ...]
  quick_decode_lens: tuple[int, ...]


#: Grid per JAX platform.
GRIDS = {
    "cpu": Grid(cpu_grid, "float32", seq_lens=(512, 1024, 2048, 4096, 8192, 16384, 32768),
                decode_lens=(4096, 32768), quick_seq_lens=(128, 256), quick_decode_lens=(512,)),
    "gpu": Grid(gpu_grid, "both", seq_lens=(512, 1024, 2048, 4096, 8192, 16384),
                decode_lens=(), quick_seq_lens=(512, 1024), quick_decode_lens=()),
}


def memory_budget(device) -> int:
  """A quarter of the device's memory (the RAM for CPU devices), in bytes."""
  stats = device.memory_stats() or {}
  total = stats.get("bytes_limit") or os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  return total // 4


def _inputs(case: Case):
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  dtype = jnp.dtype(case.dtype)
  q = jax.random.normal(kq, (case.B, case.T, case.N, case.H), dtype)
  k = jax.random.normal(kk, (case.B, case.S, case.K, case.H), dtype)
  v = jax.random.normal(kv, (case.B, case.S, case.K, case.H), dtype)
  return q, k, v


def _memory(compiled) -> dict:
  analysis = compiled.memory_analysis()
  fields = ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes",
            "generated_code_size_in_bytes")
  return {f: int(getattr(analysis, f)) for f in fields if hasattr(analysis, f)}


def time_compiled(compiled, args, time_budget_s: float, max_repeats: int,
                  calls_per_loop: int) -> tuple[float, int]:
  """Times ``compiled(*args)``: returns (median seconds per call, loops timed).

  Each timed loop issues ``calls_per_loop`` calls and waits for the last (on
  GPUs, 20: the launches queue up, so host dispatch stays out of the time).
  After warming up for WARMUP_SECONDS, one loop is timed to judge the cost;
  then as many loops as fit in ``time_budget_s`` are timed, at least 1 and at
  most ``max_repeats``.
  """
  call = lambda: compiled(*args)
  loop_s = median_seconds(call, 1, calls=calls_per_loop,
                          warmup_seconds=WARMUP_SECONDS) * calls_per_loop
  repeats = max(1, min(max_repeats, int(time_budget_s / loop_s)))
  return median_seconds(call, repeats, warmup=0, calls=calls_per_loop), repeats


def run_case(case: Case, comps: list[Competitor], budget_bytes: int,
             time_budget_s: float, max_repeats: int, calls_per_loop: int) -> dict:
  """Compiles and times every competitor on random ``case`` inputs.

  Returns a row of ``bench.json``: ``{"case": Case fields, "flops": int,
  "results": {name: {"memory": XLA memory analysis in bytes, "skipped":
  reason or None, and when timed "ms", "repeats", "gflops" (GFLOP/s)}},
  "speedup": {name: its ms / fastattn's ms}}``. A competitor that does not
  compile, or whose float32 logits exceed ``budget_bytes``, is reported as
  skipped; ``time_budget_s``, ``max_repeats`` and ``calls_per_loop`` go to
  :func:`time_compiled`.

  Raises:
    KeyError: fast_attention itself (``SUBJECT``) was not timed.
  """
  args = _inputs(case)
  results = {}
  for comp in comps:
    result = {"memory": {}, "skipped": None}
    results[comp.name] = result
    if comp.native:
      seconds, repeats = time_compiled(comp.make(case, *args), (), time_budget_s, max_repeats,
                                       calls_per_loop)
      result.update(ms=seconds * 1e3, repeats=repeats, gflops=case.flops() / seconds / 1e9)
      continue
    fn = comp.make(case)
    if case.backward:
      fn = jax.grad(lambda q, k, v, f=fn: jnp.sum(jnp.square(f(q, k, v).astype(jnp.float32))),
                    argnums=(0, 1, 2))
    try:
      compiled = jax.jit(fn).lower(*args).compile()
    except Exception as err:  # e.g. cuDNN refusing a shape: report, go on
      result["skipped"] = f"does not run: {str(err).splitlines()[0][:120]}"
      continue
    result["memory"] = _memory(compiled)
    if comp.materializes_logits and case.logits_bytes() > budget_bytes:
      result["skipped"] = (f"its {case.logits_bytes() / 2**30:.1f} GiB float32 logits "
                           f"exceed the {budget_bytes / 2**30:.1f} GiB budget")
    else:
      seconds, repeats = time_compiled(compiled, args, time_budget_s, max_repeats,
                                       calls_per_loop)
      result.update(ms=seconds * 1e3, repeats=repeats, gflops=case.flops() / seconds / 1e9)
    del compiled
  speedup = {name: r["ms"] / results[SUBJECT]["ms"] for name, r in results.items()
             if name != SUBJECT and "ms" in r}
  return {"case": dataclasses.asdict(case), "flops": case.flops(),
          "results": results, "speedup": speedup}


def throughput_unit(platform_name: str) -> tuple[str, float]:
  """The throughput unit for a JAX platform ("cpu", "gpu", ...): ("TFLOP/s",
  1e3) on GPUs, ("GFLOP/s", 1.0) elsewhere; the float is GFLOP/s per unit."""
  return ("TFLOP/s", 1e3) if platform_name == "gpu" else ("GFLOP/s", 1.0)


def format_table(rows: list[dict], names: list[str], platform_name: str) -> str:
  """A plain-text table of ``run_case`` rows: per implementation in ``names``
  the milliseconds and the throughput (``throughput_unit(platform_name)``),
  the speedups against fast_attention, XLA's compiled scratch, then one line
  per distinct reason for a skip."""
  unit, per_unit = throughput_unit(platform_name)
  others = [n for n in names if n != SUBJECT]
  header = ["dtype", "B", "T", "S", "N", "H", "causal"]
  for name in names:
    header += [f"{name} ms", f"{name} {unit}"]
  header += [f"speedup vs {n}" for n in others]
  header += [f"{name} temp mem" for name in names]
  lines = []
  for row in rows:
    c = row["case"]
    cells = [c["dtype"], c["B"], c["T"], c["S"], c["N"], c["H"], "yes" if c["causal"] else "no"]
    for name in names:
      r = row["results"][name]
      cells += ([f"{r['ms']:.3f}", f"{r['gflops'] / per_unit:.1f}"] if "ms" in r
                else ["skip", "-"])
    cells += [f"{row['speedup'][n]:.2f}x" if n in row["speedup"] else "-" for n in others]
    cells += [_format_bytes(row["results"][n]["memory"]["temp_size_in_bytes"])
              if "temp_size_in_bytes" in row["results"][n]["memory"] else "-" for n in names]
    lines.append([str(x) for x in cells])
  widths = [max(len(h), *(len(l[i]) for l in lines)) for i, h in enumerate(header)]
  fmt = lambda cells: "  ".join(x.rjust(w) for x, w in zip(cells, widths))
  out = [fmt(header), fmt(["-" * w for w in widths])] + [fmt(l) for l in lines]
  skips = {f"{n}: {row['results'][n]['skipped']}" for row in rows for n in names
           if row["results"][n]["skipped"]}
  out += [f"skip = {s}" for s in sorted(skips)]
  return "\n".join(out)


def best_competitor_ratio(results: dict, name: str) -> float | None:
  """``name``'s speed over the fastest competitor's at one point.

  ``results`` is a row's ``{implementation: result}``; competitors are the
  entries whose name does not start with "fastattn" (xla, cudnn). Returns
  None where ``name`` or every competitor was not timed.
  """
  rival = max((r["gflops"] for n, r in results.items()
               if not n.startswith(SUBJECT) and "gflops" in r), default=None)
  if rival is None or "gflops" not in results.get(name, {}):
    return None
  return results[name]["gflops"] / rival


def _length_label(n: int) -> str:
  return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def _panel_title(cases: list[dict]) -> str:
  """dtype, H and causality of a panel's cases, with N and the batch where they are fixed."""
  parts = [cases[0]["dtype"], f"H={cases[0]['H']}"]
  if len({c["N"] for c in cases}) == 1:
    parts.append(f"N={cases[0]['N']}")
  if len({c["B"] for c in cases}) == 1:
    parts.append(f"B={cases[0]['B']}")
  elif len({c["B"] * c["S"] for c in cases}) == 1:
    parts.append(f"B·S={cases[0]['B'] * cases[0]['S']}")
  parts.append("causal" if cases[0]["causal"] else "non-causal")
  return ", ".join(parts)


def _label_line_ends(ax, ends: list[tuple[float, float, str, str]]) -> None:
  """Writes each line's name right of its last point, (x, y, text, colour),
  moved apart vertically so that no two overlap (a legend-free plot)."""
  if not ends:
    return
  log = ax.get_yscale() == "log"
  to_axis = (lambda y: np.log10(y)) if log else (lambda y: y)
  from_axis = (lambda y: 10 ** y) if log else (lambda y: y)
  low, high = (to_axis(y) for y in ax.get_ylim())
  gap = 0.07 * (high - low)
  ends = sorted(ends, key=lambda e: e[1])
  placed = []
  for _, y, _, _ in ends:
    placed.append(max(to_axis(y), placed[-1] + gap) if placed else to_axis(y))
  # Pushed past the top: move the whole stack down, keeping the gaps.
  shift = max(0.0, placed[-1] - (high - gap / 2))
  for (x, _, text, color), y in zip(ends, placed):
    ax.annotate(text, (x, from_axis(max(y - shift, low))), xytext=(6, 0),
                textcoords="offset points", va="center", color=color, fontsize=9,
                annotation_clip=False, bbox=dict(fc="white", ec="none", alpha=0.8, pad=0.5))


def plot(rows: list[dict], *, platform_name: str, title: str):
  """Draws the T = S rows of a run (``run_case`` rows, as in ``bench.json``).

  One column of panels per (dtype, head dim H, causal); x is the sequence
  length T = S on a log2 axis. Top: throughput in
  ``throughput_unit(platform_name)`` (TFLOP/s on GPUs), one line per
  implementation, named at its end (no legend). Below: each fastattn entry's
  speed divided by the fastest competitor's at that point
  (``best_competitor_ratio``), with the line at 1.0. Off GPUs a third row
  shows XLA's compiled scratch memory (``temp_size_in_bytes``, log scale).
  Rows with T != S (decode) and untimed results are left out.

  Returns:
    a ``matplotlib.figure.Figure`` (not registered with pyplot; save it
    with ``savefig``).

  Raises:
    ValueError: no row has T = S.
  """
  from matplotlib.figure import Figure
  from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

  square = [r for r in rows if r["case"]["T"] == r["case"]["S"]]
  if not square:
    raise ValueError("plot: no row with T = S to draw")
  unit, per_unit = throughput_unit(platform_name)
  names = list(dict.fromkeys(n for r in square for n in r["results"]))
  ours = [n for n in names if n.startswith(SUBJECT)]
  rivals = [n for n in names if not n.startswith(SUBJECT)]
  rival_label = f"fastest of {', '.join(rivals)}" if len(rivals) > 1 else "".join(rivals)
  color = {n: f"C{i}" for i, n in enumerate(names)}
  groups = sorted({(r["case"]["dtype"], r["case"]["H"], r["case"]["causal"]) for r in square})
  panel_rows = 2 if platform_name == "gpu" else 3
  fig = Figure(figsize=(max(8.0, 5.2 * len(groups) + 0.6), 3.0 * panel_rows + 1.0),
               layout="constrained")
  grid = fig.add_gridspec(panel_rows, len(groups), height_ratios=(3, 2, 2)[:panel_rows])
  lengths = sorted({r["case"]["S"] for r in square})

  for col, group in enumerate(groups):
    sel = sorted((r for r in square
                  if (r["case"]["dtype"], r["case"]["H"], r["case"]["causal"]) == group),
                 key=lambda r: r["case"]["S"])
    axes = [fig.add_subplot(grid[0, col])]
    axes += [fig.add_subplot(grid[i, col], sharex=axes[0]) for i in range(1, panel_rows)]
    ends = [[] for _ in axes]
    for name in names:
      timed = [r for r in sel if "gflops" in r["results"].get(name, {})]
      if timed:
        xs = [r["case"]["S"] for r in timed]
        ys = [r["results"][name]["gflops"] / per_unit for r in timed]
        axes[0].plot(xs, ys, color=color[name], marker="o")
        ends[0].append((xs[-1], ys[-1], name, color[name]))
      if panel_rows == 3:  # compiled, even where not timed; 0 B drawn as 1 B (log scale)
        scratch = [(r["case"]["S"], max(r["results"][name]["memory"]["temp_size_in_bytes"], 1))
                   for r in sel if "temp_size_in_bytes" in r["results"][name]["memory"]]
        if scratch:
          axes[2].plot(*zip(*scratch), color=color[name], marker="o")
          ends[2].append((*scratch[-1], name, color[name]))
    for name in ours:
      ratios = [(r["case"]["S"], best_competitor_ratio(r["results"], name)) for r in sel]
      ratios = [(x, y) for x, y in ratios if y is not None]
      if ratios:
        axes[1].plot(*zip(*ratios), color=color[name], marker="o")
        ends[1].append((*ratios[-1], f"{name} {ratios[-1][1]:.2f}x", color[name]))
    axes[0].set(title=_panel_title([r["case"] for r in sel]), ylabel=f"{unit} (visible pairs)")
    axes[0].set_ylim(bottom=0)
    axes[1].axhline(1.0, color="black", lw=1)
    axes[1].set(ylabel=f"speed ÷ {rival_label}")
    axes[1].set_ylim(0, max(1.2, axes[1].get_ylim()[1]))
    if panel_rows == 3:
      axes[2].set(yscale="log", ylabel="compiled scratch memory\n(XLA memory analysis)")
      axes[2].yaxis.set_major_locator(LogLocator(base=2, numticks=8))
      axes[2].yaxis.set_minor_locator(NullLocator())
      axes[2].yaxis.set_major_formatter(FuncFormatter(lambda y, _: _format_bytes(y)))
    axes[-1].set_xlabel("sequence length T = S")
    for ax, labels in zip(axes, ends):
      ax.set_xscale("log", base=2)
      ax.set_xticks(lengths, [_length_label(n) for n in lengths])
      ax.xaxis.set_minor_locator(NullLocator())
      ax.set_xlim(lengths[0] / 1.3, lengths[-1] * 3.2)  # room for the line names
      ax.grid(True, alpha=0.3)
      _label_line_ends(ax, labels)
  fig.suptitle(title)
  return fig


def write_png(result: dict, path: str) -> None:
  """Draws a run (``bench.json``'s content: ``{"environment": ..., "rows":
  [...]}``) with :func:`plot` and writes the PNG to ``path``.

  Raises:
    KeyError: ``result`` lacks a field a run writes.
    ValueError: as :func:`plot`.
  """
  env = result["environment"]
  what = "forward + backward" if result["rows"][0]["case"].get("backward") else "forward"
  rivals = [name for name in result["rows"][0]["results"] if not name.startswith(SUBJECT)]
  title = (f"fast_attention ({env['fastattn_path']} path) against {', '.join(rivals)}, {what}\n"
           f"{env['device']}, JAX {env['jax']}")
  plot(result["rows"], platform_name=env["platform"], title=title).savefig(path, dpi=120)


def _cpu_model() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or "unknown CPU"


def environment() -> dict:
  """The run's context: platform ("cpu", "gpu"), device, versions, and the
  path ``fast_attention`` takes by default (float32 on CPUs, bfloat16 on
  GPUs)."""
  device = jax.devices()[0]
  kind = _cpu_model() if device.platform == "cpu" else device.device_kind
  return {
      "platform": device.platform,
      "device": f"{kind} ({jax.device_count()} device(s), {os.cpu_count()} CPU cores)",
      "jax": jax.__version__,
      "fastattn_jax": fastattn_jax.__version__,
      "fastattn_path": resolve_implementation(
          dtype="float32" if device.platform == "cpu" else "bfloat16"),
      "python": platform.python_version(),
  }


def int_list(text: str) -> tuple[int, ...]:
  """Comma-separated integers ("512,1024"; "" is empty); raises ValueError on
  anything else."""
  return tuple(int(x) for x in text.split(",") if x)


def main(argv=None) -> None:
  """Command line; see the module docstring.

  Raises:
    SystemExit: bad arguments, or a platform with no grid (``parser.error``).
    OSError, KeyError, ValueError: ``--plot-only`` of a file that cannot be
      read, is not a run's ``bench.json``, or has no T = S row.
  """
  parser = argparse.ArgumentParser(
      prog="python -m benchmarks.bench",
      description="Times fast_attention against jax.nn.dot_product_attention (and, on the "
                  "CPU, PyTorch's scaled_dot_product_attention).")
  parser.add_argument("--quick", action="store_true", help="tiny grid (smoke test)")
  parser.add_argument("--out", default="bench_results", help="output directory")
  parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16", "both"),
                      help="input dtype (default: the platform grid's; GPU: both 16-bit types)")
  parser.add_argument("--seq-lens", type=int_list, help="T = S values, comma-separated")
  parser.add_argument("--decode-lens", type=int_list,
                      help="S values of the T = 1 rows, comma-separated ('' for none)")
  parser.add_argument("--memory-budget", type=float,
                      help="GiB an unfused competitor's logits may take (default: 1/4 of memory)")
  parser.add_argument("--time-budget", type=float, default=3.0,
                      help="seconds of timed calls per measurement (default 3)")
  parser.add_argument("--max-repeats", type=int, default=10)
  parser.add_argument("--backward", action="store_true",
                      help="time forward + backward (jax.grad of sum(out^2) with respect to "
                           "q, k and v) on the T = S rows")
  parser.add_argument("--plot-only", metavar="BENCH_JSON",
                      help="time nothing: redraw a saved bench.json into the PNG beside it "
                           "(bench.json -> bench.png)")
  args = parser.parse_args(argv)

  if args.plot_only:
    with open(args.plot_only) as f:
      result = json.load(f)
    png_path = os.path.splitext(args.plot_only)[0] + ".png"
    write_png(result, png_path)
    print(f"wrote {png_path}")
    return

  env = environment()
  if env["platform"] not in GRIDS:
    parser.error(f"no benchmark grid for platform {env['platform']!r} yet")
  grid = GRIDS[env["platform"]]
  seq_lens = grid.quick_seq_lens if args.quick else grid.seq_lens
  decode_lens = grid.quick_decode_lens if args.quick else grid.decode_lens
  seq_lens = seq_lens if args.seq_lens is None else args.seq_lens
  decode_lens = decode_lens if args.decode_lens is None else args.decode_lens
  dtype = args.dtype or grid.dtype
  budget = (memory_budget(jax.devices()[0]) if args.memory_budget is None
            else int(args.memory_budget * 2**30))
  gpu = env["platform"] == "gpu"
  comps = competitors(env["platform"], "bfloat16" if dtype == "both" else dtype, args.backward)
  names = [c.name for c in comps]
  cases = grid.cases(dtype, seq_lens, decode_lens)
  if args.backward:
    cases = [dataclasses.replace(c, backward=True) for c in cases if c.T == c.S]

  env.update(dtype=dtype, memory_budget_gib=round(budget / 2**30, 2))
  for key, value in env.items():
    print(f"{key:>20}: {value}")
  sys.stdout.flush()

  rows = []
  for case in tqdm(cases, desc="bench", unit="shape", file=sys.stderr):
    rows.append(run_case(case, comps, budget, args.time_budget, args.max_repeats,
                         calls_per_loop=20 if gpu else 1))

  print()
  print(format_table(rows, names, env["platform"]))
  print(f"{throughput_unit(env['platform'])[0]} = 4*B*N*H*(visible query-key pairs) / time"
        f"{' times 3.5 (forward + backward)' if args.backward else ''}: "
        "causal counts only the visible pairs (about half).")
  os.makedirs(args.out, exist_ok=True)
  json_path = os.path.join(args.out, "bench.json")
  result = {"environment": env, "rows": rows}
  with open(json_path, "w") as f:
    json.dump(result, f, indent=1)
  png_path = os.path.join(args.out, "bench.png")
  write_png(result, png_path)
  print(f"wrote {json_path} and {png_path}")


if __name__ == "__main__":
  main()
