"""Text generation with a Llama-architecture decoder: a real model, or random weights over a long KV cache.

A real model (``--model``): ``python -m fastattn_jax.generate --model smollm2
--prompt "The capital of France is" [--prompt ...] [--chat] --new-tokens 32``
loads a GGUF file (``fastattn_jax.models.gguf``; ``smollm2`` is the packaged
SmolLM2-135M-Instruct), tokenizes the prompts (``--chat``: in the model's chat
template), prefills them as one right-padded batch with ``fast_attention``,
then decodes over a ``KVCache`` (``--paged PAGE_SIZE``: a ``PagedKVCache``)
(``llama.generate``: greedy, or sampled with
``--temperature`` and ``--top-p``; ``--tensor-parallel P``: the heads split
over P devices, ``fastattn_jax.parallel``), streaming the first prompt's text as it
is produced, until end-of-sequence or ``--new-tokens``. It reports prefill
and decode tokens/s and the attention path, and writes ``tokens`` (the new ids
per prompt) and ``text`` to ``DIR/results.json`` with ``--out DIR``.

Random weights (``--preset``, the default): ``python -m fastattn_jax.generate
--preset llama3-8b --context 524288``, the example and benchmark of
``fastattn_jax.offload``:

1. random weights of the preset (``fastattn_jax.models.llama``: Llama-2-7B or
   Llama-3-8B shapes, or ``tiny``) are created on the device;
2. the rates of the machine are measured (``offload.measure_rates``) and the
   KV cache is planned (``offload.plan_offload``) within the device memory
   left after the weights, and the plan is printed;
3. a random prompt of ``--prompt-len`` tokens is prefilled with
   ``fast_attention`` (causal), and the cache is filled up to ``--context``
   positions: the prompt's keys and values, then random ones (generated on
   the device one layer at a time, host-resident layers moved to host memory
   layer by layer), which stands in for a long prefill;
4. ``--new-tokens`` tokens are generated greedily: the first from the
   prefill, the others by decode steps with ``decode_attention`` over the
   cache (``llama.decode_step``: one jitted call per step when the whole
   cache is on the device, the offload scheduler otherwise); the first step
   warms up (compiles) and is not timed. With ``--paged PAGE_SIZE`` every
   layer's cache is a pool of pages (``PagedKVCache``; host-resident layers'
   pools on the host CPU, ``--offload host``).

It prints and (with ``--out DIR``) writes to ``DIR/results.json``: decode
tokens/s and per-token latency, device memory in use
(``Device.memory_stats``, where the platform has it), host memory of the
host-resident KV cache, the plan and the predicted per-token time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fastattn_jax import offload, resolve_implementation
from fastattn_jax.models import missing_extra
from fastattn_jax.paged import check_page_size

#: How the program is run, for its usage line and error messages.
PROG = "python -m fastattn_jax.generate"

try:
  import humanize
  from tqdm.auto import tqdm

  from fastattn_jax.models import gguf, llama
except ImportError as err:
  if __name__ == "__main__":
    sys.exit(str(missing_extra(err, PROG)))
  raise missing_extra(err, "fastattn_jax.generate") from err
#: Device memory kept free beyond the plan (activations, logits, kernel
#: workspace), on top of one layer's KV for the fill's transient buffers.
DEVICE_MARGIN_BYTES = 3 << 29
#: Positions of random keys/values drawn per loop step when filling the cache.
FILL_CHUNK = 4096


def _format_bytes(nbytes: float) -> str:
  return humanize.naturalsize(nbytes, binary=True, format="%.2f")


def _positive_int(text: str) -> int:
  value = int(text)
  if value <= 0:
    raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
  return value


def _context(text: str) -> int | str:
  return "max" if text == "max" else _positive_int(text)


def _gib_arg(text: str) -> float:
  value = float(text)
  if not value > 0:
    raise argparse.ArgumentTypeError(f"must be a positive number of GiB, got {text}")
  return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  """Parses the command line (see ``--help``); exits with status 2 on malformed values."""
  parser = argparse.ArgumentParser(prog=PROG,
                                   description=__doc__.splitlines()[0])
  source = parser.add_mutually_exclusive_group()
  source.add_argument("--model", default=None,
                      help=f"a real model: {' or '.join(sorted(gguf.PACKAGED))} (packaged) or "
                           "the path of a Llama-architecture GGUF file")
  source.add_argument("--preset", default="tiny", choices=sorted(llama.PRESETS),
                      help="random weights of this shape (default: tiny)")
  parser.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                      help="weights, activations and KV cache (default: float32 with --model, "
                           "the preset's bfloat16 otherwise)")
  parser.add_argument("--prompt", action="append", default=None,
                      help="with --model: a prompt; repeat for a batch")
  parser.add_argument("--chat", action="store_true",
                      help="with --model: each prompt as a user turn in the model's chat template")
  parser.add_argument("--temperature", type=float, default=0.0,
                      help="with --model: sampling temperature; 0 is greedy (default: 0)")
  parser.add_argument("--top-p", type=float, default=1.0,
                      help="with --model: nucleus sampling's probability mass (default: 1)")
  parser.add_argument("--paged", type=_positive_int, default=None, metavar="PAGE_SIZE",
                      help="decode over a paged KV cache (PagedKVCache) of pages of PAGE_SIZE "
                           "positions, a power of two >= 16; with --preset, host-resident "
                           "layers' pages live on the host CPU (--offload host; not stream) "
                           "(default: a contiguous KVCache)")
  parser.add_argument("--kv-dtype", default=None, choices=("int8", "float8_e4m3fn"),
                      help="with --model: a quantized KV cache, int8 (scales per position and "
                           "head) or float8_e4m3fn (scale 1 per head) (default: --dtype)")
  parser.add_argument("--tensor-parallel", type=_positive_int, default=1, metavar="P",
                      help="with --model: split the heads over the first P devices (tensor "
                           "parallelism with FastAttention's tiling-AllReduce, "
                           "fastattn_jax.parallel; default: 1, one device)")
  parser.add_argument("--context", type=_context, default=4096,
                      help="cache positions before decoding, prompt included (tokens), or "
                           "'max': the longest that fits the budgets in the --offload mode "
                           "(default: 4096)")
  parser.add_argument("--prompt-len", type=_positive_int, default=None,
                      help="prompt tokens prefilled with fast_attention; the rest of the "
                           "context is random keys and values (default: min(16, context))")
  parser.add_argument("--new-tokens", type=_positive_int, default=32,
                      help="tokens to generate per prompt, the first from the prefill (default: "
                           "32; with --preset at least 3: the first decode step is a warm-up)")
  parser.add_argument("--batch", type=_positive_int, default=1, help="sequences B (default: 1)")
  parser.add_argument("--offload", default="auto", choices=("auto", *offload.MODES),
                      help="where host-resident layers' attention runs: auto (the planner "
                           "picks), none (all on the device), stream, host (default: auto)")
  parser.add_argument("--host-layers", type=int, default=None,
                      help="force L_CPU host-resident layers (with --offload stream or host)")
  parser.add_argument("--device-memory-gb", type=_gib_arg, default=None,
                      help="device memory the KV cache may take, GiB (2**30 bytes); default: "
                           "free device memory after the weights minus a margin of 1.5 GiB "
                           "and one layer's KV")
  parser.add_argument("--host-memory-gb", type=_gib_arg, default=None,
                      help="host memory the offloaded KV cache may take, GiB; default: 90%% "
                           "of the available host memory")
  parser.add_argument("--seed", type=int, default=0,
                      help="weights, prompt and cache fill (--preset); sampling (--model)")
  parser.add_argument("--implementation", default=None,
                      help="attention path, as in fast_attention (default: automatic)")
  parser.add_argument("--out", default=None, help="folder to write results.json into")
  parser.add_argument("--no-progress", action="store_true", help="no progress bars")
  args = parser.parse_args(argv)
  # Options of one kind of run only: given to the other, they are an error.
  preset_only = ("context", "prompt_len", "batch", "offload", "host_layers", "device_memory_gb",
                 "host_memory_gb")
  model_only = ("prompt", "chat", "temperature", "top_p", "tensor_parallel", "kv_dtype")
  wrong = [name for name in (preset_only if args.model else model_only)
           if getattr(args, name) != parser.get_default(name)]
  if wrong:
    parser.error(f"--{wrong[0].replace('_', '-')} applies only "
                 f"{'to --preset runs' if args.model else 'with --model'}")
  if args.model and not args.prompt:
    parser.error("--model needs at least one --prompt")
  if args.paged is not None and args.tensor_parallel > 1:
    parser.error("--paged runs on one device (no --tensor-parallel)")
  if args.paged is not None and args.offload == "stream":
    parser.error("--paged serves host-resident layers with --offload host (or auto, none), not "
                 "stream: a streamed layer keeps a contiguous tail apart from its prefix")
  if args.kv_dtype is not None and args.tensor_parallel > 1:
    parser.error("--kv-dtype runs on one device (no --tensor-parallel)")
  if not (args.temperature >= 0 and 0 < args.top_p <= 1):
    parser.error(f"--temperature must be >= 0 and --top-p in (0, 1], got {args.temperature} "
                 f"and {args.top_p}")
  return args


def _budgets(args, config, device):
  """(device budget as a function of the context, host budget, how the device budget is found).

  The device budget is for the KV cache and the stream buffers: the free
  device memory after the weights minus ``DEVICE_MARGIN_BYTES`` and one
  layer's KV at the context (the fill's transient buffers), or
  ``--device-memory-gb``. Bytes.
  """
  available = offload.available_host_bytes()
  stats = device.memory_stats() or {}
  per_position = args.batch * config.kv_bytes_per_token
  if args.device_memory_gb is not None:
    fixed = int(args.device_memory_gb * offload.GiB)
    budget, source = (lambda _context: fixed), "--device-memory-gb"
  elif "bytes_limit" in stats:
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)

    def budget(context):
      return max(free - DEVICE_MARGIN_BYTES - (context + args.new_tokens) * per_position, 0)

    source = (f"free device memory {_format_bytes(free)} after the weights, minus "
              f"{_format_bytes(DEVICE_MARGIN_BYTES)} and one layer's KV")
  else:
    # No memory statistics (the CPU backend): device and host share the RAM.
    fixed = int(0.45 * available)
    budget, source = (lambda _context: fixed), "45% of the available host memory"
  if args.host_memory_gb is not None:
    host_budget = int(args.host_memory_gb * offload.GiB)
  else:
    host_budget = int(0.9 * available) - (budget(0) if device.platform == "cpu" else 0)
  return budget, max(host_budget, 0), source


def _check_args(args, config):
  """Raises ValueError naming the argument for values that cannot run with ``config``."""
  if args.new_tokens < 3:
    raise ValueError(f"--new-tokens must be at least 3 (the prefill's token, a warm-up step, "
                     f"then timed steps), got {args.new_tokens}")
  if args.context != "max":
    if args.context + args.new_tokens > config.max_context:
      raise ValueError(
          f"--context {args.context} + --new-tokens {args.new_tokens} exceeds the "
          f"max_context of preset {config.name!r}, {config.max_context} positions")
    if args.prompt_len is not None and args.prompt_len > args.context:
      raise ValueError(f"--prompt-len {args.prompt_len} exceeds --context {args.context}")
  if args.paged is not None:
    check_page_size("--paged", args.paged)
  if args.host_layers is not None:
    if args.offload not in ("stream", "host"):
      raise ValueError(f"--host-layers needs --offload stream or host, got --offload "
                       f"{args.offload}")
    if not 0 <= args.host_layers <= config.num_layers:
      raise ValueError(f"--host-layers must be in [0, {config.num_layers}] for preset "
                       f"{config.name!r}, got {args.host_layers}")


def _rate_contexts(device, bytes_per_position):
  """Two cache lengths for ``measure_rates``: 64 and 256 MiB of KV on a GPU, 4 and 16 on a CPU."""
  small = (64 << 20) if device.platform != "cpu" else (4 << 20)
  S1 = max(256, small // bytes_per_position)
  return S1, 4 * S1


def _fill_layer(key, prompt_k, prompt_v, *, context, length):
  """One layer's cache (B, length, K, H): the prompt's keys/values, random ones up to ``context``.

  The random part is drawn ``FILL_CHUNK`` positions at a time into the output
  (in place in a loop), so the temporaries stay small next to a long cache;
  positions from ``context`` on are zero.
  """
  B, P, K, H = prompt_k.shape
  n = context - P
  chunk = min(FILL_CHUNK, n)

  def build(prompt, key):
    out = jnp.zeros((B, length, K, H), prompt.dtype).at[:, :P].set(prompt)
    if n == 0:
      return out

    def body(i, out):
      noise = jax.random.normal(jax.random.fold_in(key, i), (B, chunk, K, H), prompt.dtype)
      # The last chunk may overlap the one before; it never passes ``context``.
      start = jnp.minimum(P + i * chunk, context - chunk)
      return jax.lax.dynamic_update_slice(out, noise, (0, start, 0, 0))

    return jax.lax.fori_loop(0, -(-n // chunk), body, out)

  k_key, v_key = jax.random.split(key)
  return build(prompt_k, k_key), build(prompt_v, v_key)


def _build_cache(plan, prompt_k, prompt_v, key, *, device, host_device, progress):
  """The plan's cache: per layer the prompt's keys/values (L, B, P, K, H), then random ones."""
  fill_fn = jax.jit(_fill_layer, static_argnames=("context", "length"),
                    out_shardings=jax.sharding.SingleDeviceSharding(device))

  def fill(layer, length):
    return fill_fn(jax.random.fold_in(key, layer), prompt_k[layer], prompt_v[layer],
                   context=plan.context, length=length)

  with tqdm(total=plan.num_layers, desc="filling the KV cache", unit="layer",
            disable=not progress) as bar:
    return offload.OffloadedKVCache.build(plan, fill, device=device, host_device=host_device,
                                          on_layer=lambda _: bar.update())


def _memory_report(device, kv_bytes):
  stats = device.memory_stats() or {}
  report = {name: int(stats[name]) for name in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")
            if name in stats}
  report.update(kv_bytes)
  report["process_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  return report


def _plan_json(plan: offload.OffloadPlan) -> dict:
  return {
      "mode": plan.mode, "device_layers": list(plan.device_layers),
      "host_layers": list(plan.host_layers), "context": plan.context, "max_len": plan.max_len,
      "device_budget_bytes": plan.device_budget_bytes,
      "host_budget_bytes": plan.host_budget_bytes, "device_kv_bytes": plan.device_kv_bytes,
      "staging_bytes": plan.staging_bytes, "tail_bytes": plan.tail_bytes,
      "host_kv_bytes": plan.host_kv_bytes, "page_size": plan.page_size, "reason": plan.reason,
      "longest_device_context": plan.longest_device_context,
      "predicted_step_s": {p.mode: p.seconds for p in plan.predictions},
      "predicted_host_layers": {p.mode: p.host_layers for p in plan.predictions},
      "explain": plan.explain(),
  }


def main(argv: Sequence[str] | None = None) -> dict:
  """Runs the program; see the module docstring and ``--help``.

  Returns:
    The results (also printed, and written to ``--out``/results.json).
    With ``--model``: ``tokens`` (per prompt, the new ids, ending at the
    end-of-sequence id if produced), ``text`` (their decoded text, without
    that end-of-sequence token),
    ``prefill_tokens_per_s`` and ``decode_tokens_per_s`` (after the warm-up
    step, all prompts), ``step_ms``, ``implementation`` (the attention path)
    and ``timings_s``. With ``--preset``: ``tokens`` (B, new_tokens)
    generated ids, ``tokens_per_s`` (decode, after the warm-up step, all B
    sequences), ``step_ms`` (mean, p50, p90 of a decode step), ``plan``,
    ``rates``, ``memory`` (bytes) and ``timings_s``.

  Raises:
    SystemExit: malformed arguments (argparse, status 2), e.g. an option of
      the other kind of run; a model that cannot be loaded (status 1, the
      message says why: not installed, not a GGUF file, an unsupported
      architecture or tensor type); values that cannot run together, e.g. a
      context past the preset's ``max_context`` (status 1, the message names
      the arguments and their values); a KV cache that does not fit the
      budgets (status 1, the message says what would fit: the device budget,
      the host memory, the longest context).
  """
  args = parse_args(argv)
  if args.model:
    try:
      return _run_model(args)
    except ValueError as err:  # gguf.GGUFError and llama.generate's checks
      raise SystemExit(f"{PROG}: error: {err}") from None
  config = llama.preset(args.preset, **({"dtype": args.dtype} if args.dtype else {}))
  try:
    _check_args(args, config)
  except ValueError as err:
    raise SystemExit(f"{PROG}: error: {err}") from None
  try:
    return _run(args, config)
  except offload.OffloadError as err:
    raise SystemExit(f"{PROG}: {err}") from None


def _run(args, config: llama.LlamaConfig) -> dict:
  device = jax.devices()[0]
  host_device = offload.host_cpu_device()
  timings = {}
  start = time.perf_counter()
  params = jax.block_until_ready(llama.init_params(config, args.seed, device=device))
  timings["init_weights"] = time.perf_counter() - start
  print(f"{config.name}: {config.num_layers} layers, D={config.d_model}, N={config.num_heads}, "
        f"K={config.num_kv_heads}, H={config.head_dim}, {config.dtype}; weights "
        f"{_format_bytes(config.weight_bytes)} on {device} in "
        f"{timings['init_weights']:.1f} s")

  B, L = args.batch, config.num_layers
  device_budget_for, host_budget, source = _budgets(args, config, device)
  if args.context == "max":
    modes = ("none",) if args.offload == "none" else (
        offload.MODES if args.offload == "auto" else (args.offload,))

    def longest(context):
      return min(config.max_context - args.new_tokens, offload.longest_context(
          L, B, args.new_tokens, config.num_kv_heads, config.head_dim, config.dtype,
          device_budget_bytes=device_budget_for(context), host_budget_bytes=host_budget,
          modes=modes, page_size=args.paged))

    # The margin grows with the context: a second pass with the first answer's
    # margin is conservative (a smaller context needs a smaller margin).
    context = longest(longest(0))
    if context <= 0 or (args.prompt_len or 1) > context:
      raise SystemExit(f"{PROG}: error: the longest context that "
                       f"fits the budgets is {context} tokens, less than --prompt-len "
                       f"{args.prompt_len or 1}")
    print(f"--context max: {context} tokens fit")
  else:
    context = args.context
  device_budget = device_budget_for(context)
  prompt_len = args.prompt_len or min(16, context)
  print(f"device budget for the KV cache: {_format_bytes(device_budget)} ({source}); "
        f"host budget {_format_bytes(host_budget)}")

  rates = None
  if args.offload != "none":
    start = time.perf_counter()
    rates = offload.measure_rates(
        B, config.num_heads, config.num_kv_heads, config.head_dim, config.dtype, device=device,
        host_device=host_device,
        contexts=_rate_contexts(device, 2 * B * config.num_kv_heads * config.head_dim
                                * jnp.dtype(config.dtype).itemsize),
        transfer_bytes=(64 << 20) if device.platform != "cpu" else (16 << 20))
    timings["measure_rates"] = time.perf_counter() - start
  plan = offload.plan_offload(
      L, B, context, args.new_tokens, config.num_kv_heads, config.head_dim, config.dtype,
      device_budget_bytes=device_budget, host_budget_bytes=host_budget, rates=rates,
      mode=args.offload, host_layers=args.host_layers,
      weight_bytes_per_layer=config.layer_weight_bytes, page_size=args.paged)
  print(plan.explain(), flush=True)

  key = jax.random.key(args.seed)
  prompt = jax.random.randint(jax.random.fold_in(key, 1), (B, prompt_len), 0, config.vocab_size,
                              jnp.int32)
  start = time.perf_counter()
  logits, prompt_k, prompt_v = jax.block_until_ready(
      llama.prefill(params, prompt, config=config, implementation=args.implementation))
  timings["prefill"] = time.perf_counter() - start

  start = time.perf_counter()
  cache = _build_cache(plan, prompt_k, prompt_v, jax.random.fold_in(key, 2), device=device,
                       host_device=host_device, progress=not args.no_progress)
  del prompt_k, prompt_v
  timings["fill_cache"] = time.perf_counter() - start
  kv_bytes = {"device_kv_bytes": cache.device_bytes(), "host_kv_bytes": cache.host_bytes()}

  if plan.mode == "none":  # the device cache alone: a step is one jitted call
    cache = cache.device

  tokens = jnp.argmax(logits[:, -1:], axis=-1).astype(jnp.int32)  # (B, 1)
  del logits
  generated = [np.asarray(tokens)]
  step_s = []
  bar = tqdm(range(args.new_tokens - 1), desc="decoding", unit="tok", disable=args.no_progress)
  for i in bar:
    start = time.perf_counter()
    logits, cache = llama.decode_step(params, cache, tokens, config=config,
                                      implementation=args.implementation)
    tokens = jnp.argmax(logits[:, -1:], axis=-1).astype(jnp.int32)
    generated.append(np.asarray(tokens))  # waits for the step
    elapsed = time.perf_counter() - start
    if i == 0:
      timings["warmup_step"] = elapsed
    else:
      step_s.append(elapsed)
      bar.set_postfix(tok_s=f"{B * len(step_s) / sum(step_s):.2f}")
  bar.close()
  timings["decode"] = float(sum(step_s))

  step_ms = np.asarray(step_s) * 1e3
  results = {
      "preset": config.name, "dtype": config.dtype, "device": str(device),
      "device_kind": device.device_kind, "jax_version": jax.__version__,
      "batch": B, "context": context, "prompt_len": prompt_len, "new_tokens": args.new_tokens,
      "offload_requested": args.offload, "page_size": args.paged, "seed": args.seed,
      "tokens_per_s": B * len(step_s) / timings["decode"],
      "step_ms": {"mean": float(step_ms.mean()), "p50": float(np.percentile(step_ms, 50)),
                  "p90": float(np.percentile(step_ms, 90))},
      "predicted_step_ms": (None if plan.prediction(plan.mode).seconds is None
                            else plan.prediction(plan.mode).seconds * 1e3),
      "plan": _plan_json(plan),
      "rates": None if rates is None else vars(rates),
      "memory": _memory_report(device, kv_bytes),
      "timings_s": timings,
      "tokens": np.concatenate(generated, axis=1).tolist(),
  }
  _print_results(results)
  _write(args.out, results)
  return results


class _Stream:
  """Prints one prompt's text as its tokens come (whole characters only:
  a byte-level token may end inside a UTF-8 sequence)."""

  def __init__(self, model: gguf.Model, row: int):
    self.model, self.row, self.ids, self.shown = model, row, [], ""

  def __call__(self, tokens, active):
    if not active[self.row] or tokens[self.row] == self.model.eos_id:
      return
    self.ids.append(int(tokens[self.row]))
    text = self.model.decode(self.ids)
    if not text.endswith("\ufffd"):
      print(text[len(self.shown):], end="", flush=True)
      self.shown = text


def _run_model(args) -> dict:
  device = jax.devices()[0]
  timings = {}
  start = time.perf_counter()
  model = gguf.load(args.model, dtype=args.dtype or "float32", device=device)
  timings["load"] = time.perf_counter() - start
  config = model.config
  params, tp, where = model.params, None, str(device)
  if args.tensor_parallel > 1:
    devices = jax.devices()[:args.tensor_parallel]
    if len(devices) < args.tensor_parallel:
      raise ValueError(f"--tensor-parallel {args.tensor_parallel}: this machine has "
                       f"{len(devices)} {devices[0].platform} device(s)")
    tp = llama.tensor_parallel(config, jax.make_mesh((len(devices),), ("model",),
                                                     devices=devices))
    params = llama.shard_params(model.params, config, tp)
    where = f"{len(devices)} devices ({devices[0].device_kind}), heads split"
  path = resolve_implementation(args.implementation, dtype=config.dtype,
                                head_dim=config.head_dim)
  print(f"{config.name}: {config.num_layers} layers, D={config.d_model}, N={config.num_heads}, "
        f"K={config.num_kv_heads}, H={config.head_dim}, V={config.vocab_size}, {config.dtype}, "
        f"loaded in {timings['load']:.1f} s on {where}; attention: {path}")
  prompts = [model.encode(text, chat=args.chat) for text in args.prompt]
  print(f"prompt 0 ({len(prompts[0])} tokens): {args.prompt[0]}", flush=True)
  gen = llama.generate(params, prompts, config=config, new_tokens=args.new_tokens,
                       eos_id=model.eos_id, temperature=args.temperature, top_p=args.top_p,
                       seed=args.seed, implementation=args.implementation,
                       on_tokens=_Stream(model, 0), tp=tp, page_size=args.paged,
                       kv_dtype=args.kv_dtype)
  print(flush=True)
  timings.update(prefill_compile=gen.prefill_compile_s, prefill=gen.prefill_s)
  # Decode step j produces token j + 1 of the prompts still generating; the
  # first step (compiling) is not timed.
  timed = gen.step_s[1:]
  timed_tokens = sum(max(len(t) - 2, 0) for t in gen.tokens)
  if gen.step_s:
    timings["warmup_step"] = gen.step_s[0]
  timings["decode"] = float(sum(timed))
  step_ms = np.asarray(timed) * 1e3
  results = {
      "model": gguf.model_path(args.model), "name": config.name, "dtype": config.dtype,
      "device": str(device), "device_kind": device.device_kind, "jax_version": jax.__version__,
      "tensor_parallel": args.tensor_parallel, "page_size": args.paged,
      "kv_dtype": args.kv_dtype,
      "implementation": path, "chat": args.chat,
      "temperature": args.temperature,
      "top_p": args.top_p, "seed": args.seed, "prompts": args.prompt,
      "prompt_tokens": [len(p) for p in prompts],
      "prefill_tokens_per_s": sum(len(p) for p in prompts) / gen.prefill_s,
      "decode_tokens_per_s": timed_tokens / sum(timed) if timed else None,
      "step_ms": ({"mean": float(step_ms.mean()), "p50": float(np.percentile(step_ms, 50)),
                   "p90": float(np.percentile(step_ms, 90))} if timed else None),
      "timings_s": timings,
      "tokens": gen.tokens,
      "text": [model.decode(t[:-1] if t and t[-1] == model.eos_id else t) for t in gen.tokens],
  }
  for i, (prompt, text) in enumerate(zip(args.prompt, results["text"])):
    print(f"[{i}] {prompt!r} -> {text!r}")
  decode = ("no timed decode step" if results["decode_tokens_per_s"] is None else
            f"decode {results['decode_tokens_per_s']:.1f} tokens/s (B={len(prompts)}, "
            f"step p50 {results['step_ms']['p50']:.1f} ms)")
  print(f"prefill {results['prefill_tokens_per_s']:.1f} tokens/s "
        f"({sum(results['prompt_tokens'])} tokens, compiled in {gen.prefill_compile_s:.1f} s); "
        f"{decode}; attention: {path}", flush=True)
  _write(args.out, results)
  return results


def _write(out: str | None, results: dict) -> None:
  if out:
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "results.json")
    with open(path, "w") as f:
      json.dump(results, f, indent=2)
    print(f"wrote {path}")


def _print_results(r: dict) -> None:
  mem = r["memory"]
  predicted = ("" if r["predicted_step_ms"] is None
               else f" (predicted {r['predicted_step_ms']:.2f} ms)")
  lines = [
      f"decode: {r['tokens_per_s']:.2f} tokens/s (B={r['batch']}, context {r['context']}, "
      f"mode {r['plan']['mode']!r}); per-token latency mean {r['step_ms']['mean']:.2f} ms, "
      f"p50 {r['step_ms']['p50']:.2f} ms, p90 {r['step_ms']['p90']:.2f} ms" + predicted,
      f"device memory: KV cache {_format_bytes(mem['device_kv_bytes'])}; " + (
          ", ".join(f"{name} {_format_bytes(mem[name])}"
                    for name in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")
                    if name in mem) or "no allocator statistics on this platform"),
      f"host memory: KV cache {_format_bytes(mem['host_kv_bytes'])}, process peak RSS "
      f"{_format_bytes(mem['process_peak_rss_bytes'])}",
      "timings: " + ", ".join(f"{name} {sec:.2f} s" for name, sec in r["timings_s"].items()),
      f"tokens (sequence 0): {r['tokens'][0]}",
  ]
  print("\n".join(lines), flush=True)


if __name__ == "__main__":
  main()
