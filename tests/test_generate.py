"""fastattn_jax.models.llama and fastattn_jax.generate with random-weight
presets: prefill and cached decoding against a float64 numpy forward pass over
the whole sequence, greedy tokens of offloaded runs equal to the all-on-device
run, the presets' parameter counts, and the command line (the real model:
test_models.py)."""

import gc
import json
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fastattn_jax import generate
from fastattn_jax.models import llama
from fastattn_jax import offload
from fastattn_jax._util import host_cpu_device
from fastattn_jax import decode
from fastattn_jax.decode import KVCache

TINY32 = llama.preset("tiny", dtype="float32")
#: Mode "host" computes on the host CPU device, which JAX lacks under JAX_PLATFORMS=cuda.
needs_cpu = pytest.mark.skipif(host_cpu_device() is None,
                               reason="JAX has no CPU device (JAX_PLATFORMS without cpu)")


@pytest.fixture(autouse=True)
def _exact_float32_matmuls():
  """GPUs run float32 matmuls in TF32 by default (1e-3 off); these tests
  compare float32 logits at 1e-4."""
  with jax.default_matmul_precision("highest"):
    yield


@pytest.fixture(scope="module")
def params():
  return llama.init_params(TINY32, seed=3)


def reference_logits(params, tokens, config):
  """Logits (B, S, V) of a float64 numpy forward pass over the whole sequence (no cache)."""
  p = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
  Bt, S = tokens.shape
  N, K, H = config.num_heads, config.num_kv_heads, config.head_dim

  def rms(x, w):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + config.norm_eps) * w

  angle = np.arange(S)[:, None] * config.rope_theta ** (-np.arange(H // 2) * 2.0 / H)

  def rope(x):  # (B, S, heads, H); the first and second halves form the rotated pairs
    c, s = np.cos(angle)[None, :, None], np.sin(angle)[None, :, None]
    a, b = x[..., :H // 2], x[..., H // 2:]
    return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)

  causal = np.tril(np.ones((S, S), bool))
  x = p["embed"][tokens]
  for w in p["layers"]:
    h = rms(x, w["attn_norm"])
    q = rope((h @ w["wq"]).reshape(Bt, S, N, H))
    k = np.repeat(rope((h @ w["wk"]).reshape(Bt, S, K, H)), N // K, axis=2)
    v = np.repeat((h @ w["wv"]).reshape(Bt, S, K, H), N // K, axis=2)
    logits = np.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(H)
    logits = np.where(causal, logits, -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    x = x + np.einsum("bnqk,bknh->bqnh", weights, v).reshape(Bt, S, N * H) @ w["wo"]
    h = rms(x, w["mlp_norm"])
    gate = h @ w["w_gate"]
    x = x + (gate / (1 + np.exp(-gate)) * (h @ w["w_up"])) @ w["w_down"]
  out = p["embed"].T if config.tie_embeddings else p["lm_head"]
  return rms(x, p["final_norm"]) @ out


def test_prefill_and_cached_decode_match_a_float64_forward_pass(params, rng):
  Bt, P, steps = 2, 11, 4
  tokens = rng.integers(0, TINY32.vocab_size, (Bt, P)).astype(np.int32)
  logits, ks, vs = llama.prefill(params, tokens, config=TINY32)
  assert logits.shape == (Bt, P, TINY32.vocab_size) and ks.shape == (4, Bt, P, 2, 32)
  np.testing.assert_allclose(logits, reference_logits(params, tokens, TINY32), atol=2e-4)

  S_max = P + steps
  cache = KVCache.from_prefill(ks, vs, np.full(Bt, P), S_max)
  sequence = tokens
  for _ in range(steps):
    new = np.argmax(np.asarray(logits[:, -1]), axis=-1).astype(np.int32)[:, None]
    sequence = np.concatenate([sequence, new], axis=1)
    logits, cache = llama.decode_step(params, cache, new, config=TINY32)
    expected = reference_logits(params, sequence, TINY32)[:, -1:]
    np.testing.assert_allclose(logits, expected, atol=2e-4)
    # The step recorded its lengths on the host (the next check_room reads
    # no device), and recorded them right.
    np.testing.assert_array_equal(decode.host_lengths(cache.lengths), np.asarray(cache.lengths))
    assert decode._KNOWN_LENGTHS[id(cache.lengths)][0]() is cache.lengths
  np.testing.assert_array_equal(cache.lengths, P + steps)
  with pytest.raises(ValueError, match="overflow"):
    llama.decode_step(params, cache, new, config=TINY32)


def _greedy(params, plan, fill, first, steps):
  cache = offload.OffloadedKVCache.build(plan, fill)
  if plan.mode == "none":
    cache = cache.device
  tokens, all_logits = first, []
  for _ in range(steps):
    logits, cache = llama.decode_step(params, cache, tokens, config=TINY32)
    all_logits.append(np.asarray(logits))
    tokens = jnp.argmax(logits[:, -1:], axis=-1).astype(jnp.int32)
  np.testing.assert_array_equal(cache.lengths, plan.context + steps)
  return np.concatenate(all_logits, axis=1)


@pytest.mark.parametrize("mode,host_layers", [
    ("stream", 2), pytest.param("host", 2, marks=needs_cpu), ("stream", 4),
    pytest.param("host", 1, marks=needs_cpu)])
def test_offloaded_greedy_decoding_gives_the_on_device_tokens(params, rng, mode, host_layers):
  Bt, P, context, steps = 2, 6, 90, 6
  prompt = rng.integers(0, TINY32.vocab_size, (Bt, P)).astype(np.int32)
  logits, ks, vs = llama.prefill(params, prompt, config=TINY32)
  noise = rng.standard_normal((TINY32.num_layers, 2, Bt, context - P, 2, 32)).astype(np.float32)

  def fill(layer, length):
    zeros = jnp.zeros((Bt, length - context, 2, 32), jnp.float32)
    return tuple(jnp.concatenate([x[layer], n, zeros], axis=1)
                 for x, n in ((ks, noise[layer, 0]), (vs, noise[layer, 1])))

  plan_args = (TINY32.num_layers, Bt, context, steps, 2, 32, "float32")
  budgets = dict(device_budget_bytes=1 << 40, host_budget_bytes=1 << 40)
  first = jnp.argmax(logits[:, -1:], axis=-1).astype(jnp.int32)
  on_device = _greedy(params, offload.plan_offload(*plan_args, **budgets, mode="none"), fill,
                      first, steps)
  plan = offload.plan_offload(*plan_args, **budgets, mode=mode, host_layers=host_layers)
  assert len(plan.host_layers) == host_layers
  offloaded = _greedy(params, plan, fill, first, steps)
  np.testing.assert_array_equal(offloaded.argmax(-1), on_device.argmax(-1))
  np.testing.assert_allclose(offloaded, on_device, atol=1e-4)


def test_presets_have_the_published_parameter_counts():
  # Llama-2-7B: 6,738,415,616 parameters; Llama-3-8B: 8,030,261,248 (bf16: 2 bytes each).
  assert llama.preset("llama2-7b").weight_bytes == 2 * 6_738_415_616
  assert llama.preset("llama3-8b").weight_bytes == 2 * 8_030_261_248
  assert llama.preset("llama3-8b").kv_bytes_per_token == 2 * 8 * 128 * 2
  with pytest.raises(ValueError, match="unknown Llama preset 'llama4'"):
    llama.preset("llama4")
  with pytest.raises(ValueError, match="num_heads=6 is not a multiple of num_kv_heads=4"):
    llama.preset("tiny", num_heads=6, num_kv_heads=4)


@needs_cpu
def test_command_line_offload_modes_agree(tmp_path, capsys):
  common = ["--preset", "tiny", "--context", "300", "--new-tokens", "5", "--batch", "2",
            "--no-progress", "--seed", "7"]
  runs = {}
  for mode in ("none", "stream", "host"):
    extra = [] if mode == "none" else ["--host-layers", "2"]
    runs[mode] = generate.main(common + ["--offload", mode, *extra, "--out",
                                         str(tmp_path / mode)])
    printed = capsys.readouterr().out
    assert f"chosen: {mode}" in printed and "tokens/s" in printed
  for mode, result in runs.items():
    saved = json.loads((tmp_path / mode / "results.json").read_text())
    assert saved["tokens"] == result["tokens"]
    assert np.asarray(saved["tokens"]).shape == (2, 5)
    assert saved["plan"]["mode"] == mode and saved["tokens_per_s"] > 0
    assert saved["plan"]["host_layers"] == ([] if mode == "none" else [2, 3])
    assert saved["memory"]["host_kv_bytes"] == saved["plan"]["host_kv_bytes"]
  assert runs["stream"]["tokens"] == runs["none"]["tokens"] == runs["host"]["tokens"]
  assert runs["stream"]["rates"]["h2d_bytes_per_s"] > 0


@pytest.mark.parametrize("argv,message", [
    (["--context", "70000"], r"--context 70000 \+ --new-tokens 32 exceeds the max_context"),
    (["--new-tokens", "1"], "--new-tokens must be at least 3"),
    (["--context", "8", "--prompt-len", "9"], "--prompt-len 9 exceeds --context 8"),
    (["--offload", "none", "--host-layers", "1"], "--host-layers needs --offload stream or host"),
    (["--offload", "host", "--host-layers", "5"], r"--host-layers must be in \[0, 4\]"),
    (["--context", "4096", "--device-memory-gb", "0.0001", "--host-memory-gb", "0.0001"],
     "does not fit.*a context of at most"),
])
def test_command_line_errors_name_the_argument(argv, message):
  with pytest.raises(SystemExit, match=message):
    generate.main(["--preset", "tiny", "--no-progress"] + argv)


def test_paged_decode_steps_read_no_page_counts_from_the_device(params, rng, monkeypatch):
  """Over a PagedKVCache of ragged lengths, each step records its lengths and
  page counts on the host, so the next check_room reads nothing from the
  device (any read-back fails here); the logits stay those of a float64
  forward pass, and running out of pages is still reported."""
  from fastattn_jax import PagedKVCache, paged
  Bt, P, steps, ps = 2, 30, 4, 16
  lengths = np.array([P, 15])
  tokens = rng.integers(0, TINY32.vocab_size, (Bt, P)).astype(np.int32)
  logits, ks, vs = llama.prefill(params, tokens, config=TINY32)
  # 2 + 1 pages for the prompts, 1 more as each sequence passes a page; none spare.
  cache = PagedKVCache.from_prefill(ks, vs, lengths, num_pages=5, page_size=ps, max_len=4 * ps)
  reads, device_get = [], jax.device_get
  monkeypatch.setattr(jax, "device_get", lambda x: reads.append(x) or device_get(x))
  sequences = [list(tokens[b, :n]) for b, n in enumerate(lengths)]
  last = np.asarray(logits)[np.arange(Bt), lengths - 1]
  for _ in range(steps):
    new = np.argmax(last, axis=-1).astype(np.int32)[:, None]
    for b in range(Bt):
      sequences[b].append(int(new[b, 0]))
    logits, cache = llama.decode_step(params, cache, new, config=TINY32)
    last = np.asarray(logits)[:, -1]
    for b in range(Bt):
      expected = reference_logits(params, np.asarray(sequences[b])[None], TINY32)[0, -1]
      np.testing.assert_allclose(last[b], expected, atol=2e-4)
    held, free = paged.host_pages(cache)
    np.testing.assert_array_equal(held, (np.asarray(cache.block_table) >= 0).sum(axis=1))
    assert free == int((np.asarray(cache.refs) == 0).sum())
  assert reads == [], "check_room read page counts back from the device"
  np.testing.assert_array_equal(paged.host_pages(cache)[0], [3, 2])
  assert paged.host_pages(cache)[1] == 0
  # Sequence 0 (34 positions) fits in its pages up to 48, sequence 1 (19) up to 32.
  cache.check_room(13)
  with pytest.raises(ValueError, match="out of pages"):
    cache.check_room(15)
  assert reads == []
  # The records do not keep the arrays they describe alive (a NumPy view of a
  # CPU array would), so they go with the cache.
  fresh = PagedKVCache.from_prefill(ks, vs, lengths, num_pages=5, page_size=ps)
  arrays = [weakref.ref(x) for x in (fresh.lengths, fresh.refs, fresh.block_table)]
  del fresh
  gc.collect()
  assert [ref() for ref in arrays] == [None] * 3


def test_command_line_paged_presets_give_the_contiguous_tokens(tmp_path, capsys):
  common = ["--preset", "tiny", "--context", "100", "--new-tokens", "4", "--batch", "2",
            "--no-progress", "--seed", "5"]
  want = generate.main(common + ["--offload", "none"])["tokens"]
  runs = [["--offload", "none", "--paged", "32"]]
  if host_cpu_device() is not None:
    runs += [["--offload", "host", "--host-layers", "2", "--paged", "16"],
             ["--offload", "host", "--host-layers", "4", "--paged", "64"]]
  for extra in runs:
    result = generate.main(common + extra + ["--out", str(tmp_path)])
    assert result["tokens"] == want, extra
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["page_size"] == saved["plan"]["page_size"] == int(extra[-1])
    assert saved["memory"]["host_kv_bytes"] == saved["plan"]["host_kv_bytes"]
  assert "pages of 64 positions" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--paged", "16", "--offload", "stream"], "--paged serves host-resident layers with "
                                               "--offload host"),
    (["--paged", "24"], "--paged: page_size must be a power of two >= 16, got 24"),
])
def test_command_line_paged_errors(argv, message, capsys):
  with pytest.raises(SystemExit) as err:
    generate.main(["--preset", "tiny", "--no-progress"] + argv)
  # argparse prints its errors (status 2); the checks of values exit with the message.
  assert message in capsys.readouterr().err + str(err.value)
