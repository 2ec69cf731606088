"""A real model end to end: SmolLM2-135M-Instruct from its GGUF file
(``fastattn_jax.models.gguf``) against Hugging Face transformers' run of the
same file (``tests/data/smollm2/``: teacher-forced logits, greedy tokens and
tokenizer ids, recorded by ``make_reference.py``), through every attention
path on the machine; and the loader on small GGUF files written here, whose
weights are known: each tensor type, llama.cpp's query/key row order, and the
errors for files it cannot use."""

import functools
import json
import pathlib

import gguf as gguf_package
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import pre_tokenizers

import fa_testutil as tu
from fastattn_jax import ascend, cuda, fast_attention, generate
from fastattn_jax.decode import KVCache
from fastattn_jax.models import gguf, llama

REFERENCE = json.loads(
    (pathlib.Path(__file__).parent / "data" / "smollm2" / "reference.json").read_text())
#: Logits of the float32 model against transformers' float32 run (the issue's
#: bound; measured: 9e-5).
LOGIT_ATOL = 1e-3

try:
  gguf.model_path("smollm2")
  _MISSING = None
except gguf.GGUFError as err:
  _MISSING = str(err)
needs_model = pytest.mark.skipif(_MISSING is not None, reason=f"no SmolLM2: {_MISSING}")


@pytest.fixture(scope="module")
def smollm2():
  return gguf.load("smollm2")


@pytest.fixture(autouse=True)
def float32_products():
  """float32 products in float32: on GPUs JAX's default precision multiplies
  float32 matrices in TF32, 1e-2 away from transformers' float32 logits."""
  with jax.default_matmul_precision("highest"):
    yield


def _prompt_ids():
  return [p["ids"] for p in REFERENCE["prompts"]]


def _padded(prompts):
  lengths = [len(p) for p in prompts]
  tokens = np.zeros((len(prompts), max(lengths)), np.int32)
  for b, p in enumerate(prompts):
    tokens[b, :len(p)] = p
  return tokens, lengths


def _check_logits(logits, lengths, atol, what):
  """max |logits - transformers'| over each prompt's positions, its 16 top
  tokens and the recorded vocabulary subset, at most ``atol``; returns it."""
  subset = np.asarray(REFERENCE["subset_ids"])
  worst = 0.0
  for b, (length, ref) in enumerate(zip(lengths, REFERENCE["logits"])):
    x = np.asarray(logits[b, :length], np.float64)
    top = np.take_along_axis(x, np.asarray(ref["top_ids"]), axis=1)
    worst = max(worst, np.abs(top - np.asarray(ref["top_logits"])).max(),
                np.abs(x[:, subset] - np.asarray(ref["subset_logits"])).max())
  assert worst <= atol, f"{what}: logits differ from transformers' by {worst:.3g} > {atol:.3g}"
  return worst


# --- the packaged model against transformers ----------------------------------------

@needs_model
def test_config_is_transformers(smollm2):
  c, ref = smollm2.config, REFERENCE["config"]
  assert (c.num_layers, c.d_model, c.num_heads, c.num_kv_heads, c.head_dim, c.ffn_dim,
          c.vocab_size) == (ref["num_layers"], ref["d_model"], ref["num_heads"],
                            ref["num_kv_heads"], ref["head_dim"], ref["ffn_dim"],
                            ref["vocab_size"])
  assert c.rope_theta == ref["rope_theta"] and c.norm_eps == pytest.approx(ref["rms_norm_eps"])
  assert c.tie_embeddings == ref["tie_word_embeddings"]
  assert (smollm2.bos_id, smollm2.eos_id) == (ref["bos_token_id"], ref["eos_token_id"])


@needs_model
def test_tokenizer_is_transformers(smollm2):
  for p in REFERENCE["prompts"]:
    if p["chat"]:
      assert smollm2.chat_text(p["text"]) == p["input_text"]
    assert smollm2.encode(p["text"], chat=p["chat"]) == p["ids"], p["text"]
    assert smollm2.decode(p["ids"]) == p["decoded"] == p["input_text"]
  for case in REFERENCE["tokenizer_cases"]:
    ids = smollm2.encode(case["text"])
    assert ids == case["ids"], case["text"]
    assert smollm2.decode(ids) == case["text"]


@needs_model
def test_logits_match_transformers(smollm2):
  """Teacher-forced logits with fast_attention and with jax.nn, the prompts
  in one right-padded batch (causal: padding is never seen)."""
  tokens, lengths = _padded(_prompt_ids())
  for name, attention_fn in (("fast_attention", fast_attention),
                             ("jax.nn", jax.nn.dot_product_attention)):
    forward = jax.jit(functools.partial(llama.forward, config=smollm2.config,
                                        attention_fn=functools.partial(attention_fn,
                                                                       is_causal=True)))
    _check_logits(forward(smollm2.params, tokens)[0], lengths, LOGIT_ATOL, name)


def _paths():
  """Every fused path this machine runs, each with the platform it runs on."""
  paths = [("cpu", "cpu"), ("xla", None), ("ascend_sim", "cpu")]
  if tu.has_gpu():
    cc = cuda.compute_capability()
    paths += [(name, "gpu") for name in cuda.IMPLEMENTATIONS if cuda.runs_on(name, cc)]
  return paths


@needs_model
@pytest.mark.parametrize("path, platform", _paths(), ids=[p for p, _ in _paths()])
def test_logits_through_every_path(smollm2, path, platform):
  """Each path's logits are within twice the error of XLA's attention (the
  reference math) given the path's product dtype (float32 in, float16
  products on the CUDA and Ascend paths), plus a floor: the FlashAttention
  rule, at the model's output. The simulated Ascend path takes the two short
  prompts (a functional simulator: seconds per call)."""
  if path == "ascend_sim" and (why := ascend.unavailable(path)):
    pytest.skip(f"ascend_sim unavailable: {why}")
  prompts = _prompt_ids()[:2] if path == "ascend_sim" else _prompt_ids()
  tokens, lengths = _padded(prompts)
  device = jax.devices(platform)[0] if platform else jax.devices()[0]
  params = jax.device_put(smollm2.params, device)
  computed = jnp.dtype(tu.computed_dtype(path, "float32"))

  def framework(q, k, v):
    return fast_attention(q.astype(computed), k.astype(computed), v.astype(computed),
                          is_causal=True, implementation="xla").astype(q.dtype)

  def run(fn):
    return jax.jit(functools.partial(llama.forward, config=smollm2.config, attention_fn=fn))(
        params, jax.device_put(tokens, device))[0]

  bound = _check_logits(run(framework), lengths, np.inf, f"XLA in {computed.name}")
  _check_logits(run(functools.partial(fast_attention, is_causal=True, implementation=path)),
                lengths, 2 * bound + LOGIT_ATOL / 10, path)


@needs_model
@pytest.mark.parametrize("page_size", [None, 16])
def test_greedy_tokens_are_transformers(smollm2, page_size):
  """All prompts in one batch (different lengths: padding through lengths),
  greedy, over a contiguous and a paged KV cache: the tokens transformers'
  generate gave."""
  gen = llama.generate(smollm2.params, _prompt_ids(), config=smollm2.config,
                       new_tokens=len(REFERENCE["greedy"][0]["ids"]), eos_id=smollm2.eos_id,
                       page_size=page_size)
  for got, ref in zip(gen.tokens, REFERENCE["greedy"]):
    assert got == ref["ids"]
    assert smollm2.decode(got) == ref["text"]


@needs_model
@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3fn"])
def test_greedy_tokens_from_a_quantized_cache(smollm2, kv_dtype):
  """Greedy decoding over an int8 cache (a scale per position and head) and a
  float8 cache (scale 1 per head) against transformers' recorded tokens (the
  float cache's): the tokens before the first that differs, per prompt, are
  printed (docs/validation.md gives them). Measured on the CPU, 2026-11-27:
  int8 24, 24, 24, 24, 17 of 24, float8 24, 13, 13, 18, 17; 2026-12-06 (the
  same CPU kernels, cause not established): int8 24 on all five, float8 24,
  13, 13, 18, 8. A float8 cache at scale 1 keeps 3 mantissa bits, and one near
  tie in the float logits flips the rest of a greedy continuation, so float8
  is checked on the prompts together: half of all their tokens, and at least
  12 on three prompts. int8: at least 16 of each prompt's and all of 4
  prompts'."""
  gen = llama.generate(smollm2.params, _prompt_ids(), config=smollm2.config,
                       new_tokens=len(REFERENCE["greedy"][0]["ids"]), eos_id=smollm2.eos_id,
                       kv_dtype=kv_dtype)
  kept = []
  for got, ref in zip(gen.tokens, REFERENCE["greedy"]):
    differs = [i for i, (a, b) in enumerate(zip(got, ref["ids"])) if a != b]
    kept.append(differs[0] if differs else len(ref["ids"]))
  print(f"{kv_dtype}: tokens equal to the float cache's before the first that differs: {kept} "
        f"of {[len(ref['ids']) for ref in REFERENCE['greedy']]}")
  if kv_dtype == "int8":
    assert min(kept) >= 16 and sum(k == len(r["ids"]) for k, r in
                                   zip(kept, REFERENCE["greedy"])) >= 4
  else:
    assert sum(kept) >= sum(len(r["ids"]) for r in REFERENCE["greedy"]) // 2
    assert sum(k >= 12 for k in kept) >= 3


@needs_model
def test_prefill_then_decode_is_one_forward(smollm2):
  """Logits of a prefill and decode steps over the KV cache equal one causal
  forward over the whole sequence."""
  prompt, continuation = REFERENCE["prompts"][1]["ids"], REFERENCE["greedy"][1]["ids"][:6]
  config = smollm2.config
  logits, k, v = llama.prefill(smollm2.params, jnp.asarray([prompt]), config=config)
  cache = KVCache.from_prefill(k, v, [len(prompt)], len(prompt) + len(continuation))
  steps = [logits[0, -1]]
  for token in continuation[:-1]:
    step, cache = llama.decode_step(smollm2.params, cache, jnp.asarray([[token]]), config=config)
    steps.append(step[0, 0])
  whole, _, _ = llama.prefill(smollm2.params, jnp.asarray([prompt + continuation[:-1]]),
                              config=config)
  np.testing.assert_allclose(np.stack(steps), whole[0, len(prompt) - 1:], atol=2e-4, rtol=0)


@needs_model
def test_generate_command(smollm2, tmp_path, capsys):
  """The contract's command line: batch of prompts, chat, results.json."""
  chat = [p for p in REFERENCE["prompts"] if p["chat"]]
  refs = [REFERENCE["greedy"][REFERENCE["prompts"].index(p)] for p in chat]
  argv = ["--model", "smollm2", "--chat", "--new-tokens", "5", "--dtype", "float32",
          "--out", str(tmp_path), "--no-progress"]
  for p in chat:
    argv += ["--prompt", p["text"]]
  result = generate.main(argv)
  saved = json.loads((tmp_path / "results.json").read_text())
  assert saved["tokens"] == [ref["ids"][:5] for ref in refs]
  assert saved["text"] == [smollm2.decode(ref["ids"][:5]) for ref in refs]
  assert saved["implementation"] == result["implementation"]
  assert saved["prefill_tokens_per_s"] > 0 and saved["decode_tokens_per_s"] > 0
  assert saved["text"][0] in capsys.readouterr().out  # streamed


def test_sampling_is_seeded_and_within_top_p():
  logits = jnp.asarray(np.random.default_rng(0).normal(size=(4, 50)) * 3, jnp.float32)
  key = jax.random.key(1)
  assert (llama.sample(logits, key) == jnp.argmax(logits, -1)).all()
  a = llama.sample(logits, key, temperature=0.8, top_p=0.5)
  assert (a == llama.sample(logits, key, temperature=0.8, top_p=0.5)).all()
  # top_p keeps the most likely tokens whose mass reaches 0.5: every draw is one of them.
  probs = np.asarray(jax.nn.softmax(logits / 0.8))
  for seed in range(20):
    ids = np.asarray(llama.sample(logits, jax.random.key(seed), temperature=0.8, top_p=0.5))
    for row, i in enumerate(ids):
      order = np.argsort(-probs[row])
      before = probs[row][order][:list(order).index(i)].sum()
      assert before < 0.5


@pytest.mark.parametrize("argv, message", [
    (["--model", "smollm2"], "--model needs at least one --prompt"),
    (["--model", "smollm2", "--prompt", "x", "--context", "64"], "--context applies only"),
    (["--prompt", "x"], "--prompt applies only with --model"),
    (["--model", "smollm2", "--prompt", "x", "--top-p", "0"], "--top-p in"),
])
def test_generate_command_errors(argv, message, capsys):
  with pytest.raises(SystemExit):
    generate.parse_args(argv)
  assert message in capsys.readouterr().err


# --- the loader on small files -------------------------------------------------------

D, N, K, F, V, L = 64, 4, 2, 96, 300, 2
H = D // N
Q = gguf_package.GGMLQuantizationType


def _permute_rope_rows(w, heads):
  """llama.cpp's converter's reordering of query/key rows (the inverse of
  ``gguf.unpermute_rope_rows``), written here from its definition."""
  return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
      w.shape)


def _write(path, *, arch="llama", qtype=Q.F32, overrides=None, drop=()):
  """A 2-layer Llama GGUF file of random weights; returns them in
  Hugging Face's (output, input) rotate-half layout, by GGUF tensor name."""
  rng = np.random.default_rng(0)
  weights = {"token_embd.weight": rng.normal(size=(V, D)), "output_norm.weight":
             1 + 0.1 * rng.normal(size=D), "output.weight": rng.normal(size=(V, D))}
  for i in range(L):
    weights.update({
        f"blk.{i}.attn_norm.weight": 1 + 0.1 * rng.normal(size=D),
        f"blk.{i}.attn_q.weight": rng.normal(size=(N * H, D)),
        f"blk.{i}.attn_k.weight": rng.normal(size=(K * H, D)),
        f"blk.{i}.attn_v.weight": rng.normal(size=(K * H, D)),
        f"blk.{i}.attn_output.weight": rng.normal(size=(D, N * H)),
        f"blk.{i}.ffn_norm.weight": 1 + 0.1 * rng.normal(size=D),
        f"blk.{i}.ffn_gate.weight": rng.normal(size=(F, D)),
        f"blk.{i}.ffn_up.weight": rng.normal(size=(F, D)),
        f"blk.{i}.ffn_down.weight": rng.normal(size=(D, F)),
    })
  weights = {name: (w * 0.1).astype(np.float32) for name, w in weights.items()}
  w = gguf_package.GGUFWriter(str(path), arch)
  w.add_block_count(L)
  w.add_context_length(256)
  w.add_embedding_length(D)
  w.add_feed_forward_length(F)
  w.add_head_count(N)
  w.add_head_count_kv(K)
  w.add_rope_freq_base(10000.0)
  w.add_layer_norm_rms_eps(1e-5)
  w.add_vocab_size(V)
  alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
  tokens = alphabet + ["Ġt", "he", "Ġthe"] + [f"<|extra_{i}|>" for i in range(V - 259)]
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre("default")
  w.add_token_list(tokens)
  w.add_token_merges(["Ġ t", "h e", "Ġt he"])
  w.add_token_types([1] * 259 + [3] * (V - 259))
  w.add_eos_token_id(V - 1)
  for key, value in (overrides or {}).items():
    w.add_string(key, value)
  for name, x in weights.items():
    if name in drop:
      continue
    if name.endswith(("attn_q.weight", "attn_k.weight")):
      x = _permute_rope_rows(x, N if "attn_q" in name else K)
    kind = qtype if x.ndim == 2 else Q.F32
    data = x if kind == Q.F32 else gguf_package.quants.quantize(x, kind)
    w.add_tensor(name, data, raw_dtype=kind)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return weights


#: Largest |dequantized - original| per type for weights of |w| <= ~0.45
#: (4-bit: a 16th of a 32-value block's range).
QUANT_ATOL = {Q.F32: 0, Q.F16: 2e-4, Q.BF16: 2e-3, Q.Q8_0: 3e-3, Q.Q4_0: 5e-2, Q.Q4_1: 4e-2}


@pytest.mark.parametrize("qtype", list(QUANT_ATOL), ids=lambda q: q.name)
def test_loader_reads_each_type_in_the_models_layout(tmp_path, qtype):
  weights = _write(tmp_path / "m.gguf", qtype=qtype)
  model = gguf.load(str(tmp_path / "m.gguf"))
  assert (model.config.num_layers, model.config.num_heads, model.config.num_kv_heads,
          model.config.head_dim, model.config.tie_embeddings) == (L, N, K, H, False)
  p = model.params
  pairs = [(p["embed"], weights["token_embd.weight"]), (p["lm_head"], weights["output.weight"].T)]
  for i, layer in enumerate(p["layers"]):
    pairs += [(layer["wq"], weights[f"blk.{i}.attn_q.weight"].T),
              (layer["wk"], weights[f"blk.{i}.attn_k.weight"].T),
              (layer["wo"], weights[f"blk.{i}.attn_output.weight"].T),
              (layer["w_down"], weights[f"blk.{i}.ffn_down.weight"].T),
              (layer["mlp_norm"], weights[f"blk.{i}.ffn_norm.weight"])]
  for got, want in pairs:
    np.testing.assert_allclose(np.asarray(got), want, atol=QUANT_ATOL[qtype] + 1e-7, rtol=0)


def test_tokenizer_from_metadata(tmp_path):
  _write(tmp_path / "m.gguf")
  model = gguf.load(str(tmp_path / "m.gguf"))
  ids = model.encode("the<|extra_3|> the")
  assert model.tokenizer.id_to_token(ids[0]) == "t" and "Ġthe" in [
      model.tokenizer.id_to_token(i) for i in ids]
  assert model.tokenizer.token_to_id("<|extra_3|>") in ids  # special: kept whole
  assert model.decode(ids) == "the<|extra_3|> the"


@pytest.mark.parametrize("case, message", [
    ("not_gguf", "is not a readable GGUF file"),
    ("truncated", "is not a readable GGUF file"),
    ("architecture", "architecture 'gpt2' is not supported"),
    ("tensor_type", "has type Q5_0"),
    ("missing_tensor", "tensor blk.1.ffn_up.weight is missing"),
    ("tokenizer", "tokenizer model 'llama' is not supported"),
    ("not_installed", "is neither a packaged model"),
])
def test_loader_errors(tmp_path, case, message):
  path = tmp_path / "m.gguf"
  if case == "not_gguf":
    path.write_bytes(np.random.default_rng(0).bytes(4096))
  elif case == "truncated":
    _write(path)
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
  elif case == "architecture":
    _write(path, arch="gpt2")
  elif case == "tensor_type":
    _write(path, qtype=Q.Q5_0)
  elif case == "missing_tensor":
    _write(path, drop=("blk.1.ffn_up.weight",))
  elif case == "tokenizer":
    _write(path, overrides={"tokenizer.ggml.model": "llama"})
  elif case == "not_installed":
    path = tmp_path / "absent.gguf"
  with pytest.raises(gguf.GGUFError, match=message.replace("(", r"\(")):
    gguf.load(str(path))
