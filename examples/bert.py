"""A BERT sentence encoder in plain JAX, with a pluggable attention function.

The model is BERT (Devlin et al. 2019, "BERT: Pre-training of Deep
Bidirectional Transformers for Language Understanding"); the default
checkpoint is the sentence encoder all-MiniLM-L6-v2 (6 layers, 12 heads of
head dim 32, hidden size 384) from sentence-transformers, whose sentence
embedding is the mean of the final hidden states over the non-padding tokens,
L2-normalized. :func:`encode` and :func:`mean_pool_normalize` reproduce that.

Weights are read with ``safetensors`` and text is tokenized with
``tokenizers``; neither torch nor transformers is needed, and nothing here
contacts a model hub.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file
from tokenizers import Tokenizer

Params = dict[str, Any]

_ACTIVATIONS = {
  "gelu": lambda x: jax.nn.gelu(x, approximate=False),
  "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
  "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
  "relu": jax.nn.relu,
}


@dataclasses.dataclass(frozen=True)
class BertConfig:
  """Shape hyper-parameters of a BERT encoder, read from ``config.json``.

  ``max_seq_length`` is the truncation length in tokens: sentence-transformers'
  ``max_seq_length`` (``sentence_bert_config.json``, 256 for all-MiniLM-L6-v2)
  when the folder has one, else ``max_position_embeddings``.
  """

  hidden_size: int
  num_layers: int
  num_heads: int
  layer_norm_eps: float
  hidden_act: str
  max_position_embeddings: int
  max_seq_length: int

  @property
  def head_dim(self) -> int:
    """Width of one attention head: ``hidden_size // num_heads``."""
    return self.hidden_size // self.num_heads


MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def load_config(model_dir: str) -> BertConfig:
  """Reads the encoder hyper-parameters of the checkpoint in ``model_dir``.

  Raises:
    FileNotFoundError: ``model_dir/config.json`` does not exist.
    ValueError: the activation is not one of gelu (exact erf GELU),
      gelu_new / gelu_pytorch_tanh (tanh approximation) or relu, or the
      hidden size is not a multiple of the number of heads.
  """
  cfg = _read_json(os.path.join(model_dir, "config.json"))
  act = cfg.get("hidden_act", "gelu")
  if act not in _ACTIVATIONS:
    raise ValueError(
      f"{model_dir}/config.json: hidden_act={act!r} is not supported "
      f"(supported: {', '.join(_ACTIVATIONS)})"
    )
  if cfg["hidden_size"] % cfg["num_attention_heads"]:
    raise ValueError(
      f"{model_dir}/config.json: hidden_size {cfg['hidden_size']} is not "
      f"a multiple of num_attention_heads {cfg['num_attention_heads']}"
    )
  max_pos = cfg.get("max_position_embeddings", 512)
  st_path = os.path.join(model_dir, "sentence_bert_config.json")
  max_len = (
    _read_json(st_path).get("max_seq_length", max_pos) if os.path.exists(st_path) else max_pos
  )
  return BertConfig(
    hidden_size=cfg["hidden_size"],
    num_layers=cfg["num_hidden_layers"],
    num_heads=cfg["num_attention_heads"],
    layer_norm_eps=cfg.get("layer_norm_eps", 1e-12),
    hidden_act=act,
    max_position_embeddings=max_pos,
    max_seq_length=min(max_len, max_pos),
  )


def load_params(path: str, config: BertConfig) -> Params:
  """Loads BERT encoder weights from a ``model.safetensors`` file.

  Names follow the Hugging Face BertModel layout (``embeddings.*``,
  ``encoder.layer.{i}.*``), with or without a prefix such as ``bert.`` or
  ``model.``; other tensors (pooler, MLM head, ``position_ids``) are ignored.
  Linear weights are transposed to (in, out). All arrays are float32.

  Returns:
    ``{"embeddings": {...}, "layers": [{...} per layer]}`` of jnp arrays.

  Raises:
    FileNotFoundError: ``path`` does not exist.
    KeyError: a tensor the encoder needs is missing.
  """
  if not os.path.exists(path):
    raise FileNotFoundError(f"model weights not found: {path}")
  tensors = load_file(path)
  anchor = "embeddings.word_embeddings.weight"
  prefixes = [name[: -len(anchor)] for name in tensors if name.endswith(anchor)]
  if not prefixes:
    raise KeyError(f"{path}: no tensor named '*{anchor}'; not a BERT checkpoint?")
  prefix = prefixes[0]

  def get(name: str) -> jax.Array:
    if prefix + name not in tensors:
      raise KeyError(f"{path}: missing tensor {prefix + name!r}")
    return jnp.asarray(tensors[prefix + name], dtype=jnp.float32)

  def dense(name: str) -> dict[str, jax.Array]:
    return {"w": get(name + ".weight").T, "b": get(name + ".bias")}

  def norm(name: str) -> dict[str, jax.Array]:
    return {"scale": get(name + ".weight"), "bias": get(name + ".bias")}

  layers = []
  for i in range(config.num_layers):
    p = f"encoder.layer.{i}."
    layers.append(
      {
        "query": dense(p + "attention.self.query"),
        "key": dense(p + "attention.self.key"),
        "value": dense(p + "attention.self.value"),
        "attn_out": dense(p + "attention.output.dense"),
        "attn_norm": norm(p + "attention.output.LayerNorm"),
        "ffn_in": dense(p + "intermediate.dense"),
        "ffn_out": dense(p + "output.dense"),
        "ffn_norm": norm(p + "output.LayerNorm"),
      }
    )
  embeddings = {
    "word": get("embeddings.word_embeddings.weight"),
    "position": get("embeddings.position_embeddings.weight"),
    "token_type": get("embeddings.token_type_embeddings.weight"),
    "norm": norm("embeddings.LayerNorm"),
  }
  return {"embeddings": embeddings, "layers": layers}


def load_model(model_dir: str) -> tuple[Params, BertConfig, Tokenizer]:
  """Loads a BERT-family checkpoint folder: weights, config and tokenizer.

  ``model_dir`` must hold ``config.json``, ``model.safetensors`` and
  ``tokenizer.json`` (a Hugging Face fast-tokenizer file). The tokenizer is
  set to truncate to ``config.max_seq_length`` tokens and not to pad
  (:func:`tokenize` pads).

  Returns:
    ``(params, config, tokenizer)``; see :func:`load_params`,
    :func:`load_config`.

  Raises:
    FileNotFoundError: ``model_dir`` or one of the three files is missing
      (the message names it).
    ValueError, KeyError: as :func:`load_config`, :func:`load_params`.
  """
  if not os.path.isdir(model_dir):
    raise FileNotFoundError(f"model directory not found: {model_dir}")
  for name in MODEL_FILES:
    if not os.path.isfile(os.path.join(model_dir, name)):
      raise FileNotFoundError(
        f"{model_dir} lacks {name} (a BERT checkpoint folder needs {', '.join(MODEL_FILES)})"
      )
  config = load_config(model_dir)
  params = load_params(os.path.join(model_dir, "model.safetensors"), config)
  tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
  tokenizer.no_padding()
  tokenizer.enable_truncation(max_length=config.max_seq_length)
  return params, config, tokenizer


def tokenize(
  tokenizer: Tokenizer, sentences: Sequence[str]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Tokenizes ``sentences`` and right-pads them with id 0 to one length.

  The padded length is a bucket: the next power of two >= the longest
  sentence, at least 16 and at most the tokenizer's truncation length, so
  batches of similar lengths share one compiled program.

  Args:
    tokenizer: from :func:`load_model` (truncates, does not pad).
    sentences: the texts.

  Returns:
    ``(input_ids, token_type_ids, lengths)``: int32 arrays of shapes
    (n, length), (n, length) and (n,); ``lengths`` counts the real tokens
    of each sentence, [CLS] and [SEP] included.
  """
  encodings = tokenizer.encode_batch(list(sentences))
  lengths = np.array([len(e.ids) for e in encodings], np.int32)
  length = max(16, 1 << (int(lengths.max(initial=1)) - 1).bit_length())
  if tokenizer.truncation:
    length = min(length, tokenizer.truncation["max_length"])
  ids = np.zeros((len(encodings), length), np.int32)
  types = np.zeros((len(encodings), length), np.int32)
  for row, e in enumerate(encodings):
    ids[row, : len(e.ids)] = e.ids
    types[row, : len(e.ids)] = e.type_ids
  return ids, types, lengths


def _layer_norm(x: jax.Array, p: dict[str, jax.Array], eps: float) -> jax.Array:
  mean = x.mean(-1, keepdims=True)
  var = jnp.square(x - mean).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + eps) * p["scale"] + p["bias"]


def _dense(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
  return x @ p["w"] + p["b"]


def encode(
  params: Params,
  input_ids: jax.Array,
  token_type_ids: jax.Array,
  lengths: jax.Array,
  *,
  config: BertConfig,
  attention_fn: Callable[..., jax.Array],
) -> jax.Array:
  """Runs the BERT encoder (post-LayerNorm, as in Devlin et al. 2019).

  Args:
    params: weights from :func:`load_params`.
    input_ids, token_type_ids: int32 (B, T), right-padded; T must not exceed
      ``config.max_position_embeddings``.
    lengths: int32 (B,), number of real tokens per row. Padding is excluded
      from attention by passing ``lengths`` as both ``query_seq_lengths``
      and ``key_value_seq_lengths``.
    config: the encoder's :class:`BertConfig` (static under ``jax.jit``).
    attention_fn: an attention function with the signature and semantics of
      ``jax.nn.dot_product_attention`` (e.g. ``fastattn_jax.fast_attention``),
      called on (B, T, heads, head_dim) arrays with the default scale
      1/sqrt(head_dim).

  Returns:
    float32 (B, T, hidden) final hidden states. Rows of padding tokens are
    unspecified (attention implementations may return anything there).
  """
  B, T = input_ids.shape
  emb = params["embeddings"]
  x = emb["word"][input_ids] + emb["position"][:T][None] + emb["token_type"][token_type_ids]
  x = _layer_norm(x, emb["norm"], config.layer_norm_eps)
  act = _ACTIVATIONS[config.hidden_act]
  heads = (B, T, config.num_heads, config.head_dim)
  for layer in params["layers"]:
    q = _dense(x, layer["query"]).reshape(heads)
    k = _dense(x, layer["key"]).reshape(heads)
    v = _dense(x, layer["value"]).reshape(heads)
    attn = attention_fn(q, k, v, query_seq_lengths=lengths, key_value_seq_lengths=lengths)
    attn = _dense(attn.reshape(B, T, config.hidden_size), layer["attn_out"])
    x = _layer_norm(x + attn, layer["attn_norm"], config.layer_norm_eps)
    ffn = _dense(act(_dense(x, layer["ffn_in"])), layer["ffn_out"])
    x = _layer_norm(x + ffn, layer["ffn_norm"], config.layer_norm_eps)
  return x


def mean_pool_normalize(hidden: jax.Array, lengths: jax.Array) -> jax.Array:
  """Sentence embeddings as sentence-transformers computes them.

  Mean of ``hidden`` over the first ``lengths[b]`` tokens of each row (the
  attention-mask tokens), then division by the L2 norm (floored at 1e-12).

  Args:
    hidden: float32 (B, T, D) from :func:`encode`.
    lengths: int32 (B,) real-token counts.

  Returns:
    float32 (B, D), unit L2 norm per row (cosine similarity is a dot product).
  """
  valid = (jnp.arange(hidden.shape[1])[None, :] < lengths[:, None])[..., None]
  summed = jnp.where(valid, hidden, 0.0).sum(axis=1)
  mean = summed / jnp.maximum(lengths, 1)[:, None].astype(hidden.dtype)
  norm = jnp.linalg.norm(mean, axis=-1, keepdims=True)
  return mean / jnp.maximum(norm, 1e-12)


def _read_json(path: str) -> dict[str, Any]:
  if not os.path.exists(path):
    raise FileNotFoundError(f"not found: {path}")
  with open(path, encoding="utf-8") as f:
    return json.load(f)
