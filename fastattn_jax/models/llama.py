"""A Llama-style decoder in plain JAX: prefill with ``fast_attention``, decode over KV caches.

The architecture is Llama's (Touvron et al. 2023, "LLaMA: Open and Efficient
Foundation Language Models" and "Llama 2: Open Foundation and Fine-Tuned Chat
Models"; Meta, "The Llama 3 Herd of Models", 2024): pre-normalization with
RMSNorm (Zhang and Sennrich 2019), rotary position embeddings (RoPE, Su et al.
2021) on queries and keys, grouped-query attention (GQA, Ainslie et al. 2023:
N query heads share K key/value heads), a SwiGLU feed-forward block (Shazeer
2020) and no biases. RoPE rotates the two halves of each head (the
"rotate-half" layout of the Hugging Face port); Llama 3.1's long-context
frequency scaling is not applied.

Weights are random (from a seed), created directly on the target device. The
presets have the shapes of Llama-2-7B and Llama-3-8B, plus a ``tiny`` one for
tests and CPU demos. Prefill runs ``fastattn_jax.fast_attention`` with
``is_causal=True``; decoding writes each step's keys and values into a
``fastattn_jax.decode.KVCache`` or a host-offloaded
``fastattn_jax.offload.OffloadedKVCache`` (``decode_step``, which supplies the
layer functions to the scheduler ``fastattn_jax.offload.decode_step``) and
attends with ``decode_attention``.

Shapes: B batch, T new tokens per step, P prompt tokens, D model width, N
query heads, K key/value heads, H head dim, F feed-forward width, V vocabulary,
L layers.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from fastattn_jax import KVCache, PagedKVCache, fast_attention, offload, parallel

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Shape hyper-parameters of a Llama-style decoder.

  Attributes:
    name: preset name.
    num_layers: L.
    d_model: D, the residual stream width.
    num_heads: N query heads.
    num_kv_heads: K key/value heads (N a multiple of K).
    head_dim: H.
    ffn_dim: F, the SwiGLU hidden width.
    vocab_size: V.
    rope_theta: RoPE base (10000 in Llama 2, 500000 in Llama 3).
    norm_eps: RMSNorm epsilon.
    tie_embeddings: the output projection is the transposed embedding.
    max_context: the longest sequence (cache positions) this example accepts.
      The checkpoints were trained at 4096 (Llama 2) and 8192 (Llama 3)
      tokens; with random weights, longer contexts measure speed and memory
      only, so the large presets allow 2**20 positions (integer positions
      stay exact in the float32 RoPE angles).
    dtype: dtype name of the weights, activations and KV cache.
  """

  name: str
  num_layers: int
  d_model: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  ffn_dim: int
  vocab_size: int
  rope_theta: float = 10000.0
  norm_eps: float = 1e-5
  tie_embeddings: bool = False
  max_context: int = 1 << 20
  dtype: str = "bfloat16"

  def __post_init__(self):
    for field in ("num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim", "ffn_dim",
                  "vocab_size", "max_context"):
      if getattr(self, field) <= 0:
        raise ValueError(f"LlamaConfig {self.name!r}: {field} must be positive, got "
                         f"{getattr(self, field)}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"LlamaConfig {self.name!r}: num_heads={self.num_heads} is not a "
                       f"multiple of num_kv_heads={self.num_kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"LlamaConfig {self.name!r}: RoPE needs an even head_dim, got "
                       f"{self.head_dim}")
    if self.dtype not in ("bfloat16", "float16", "float32"):
      raise ValueError(f"LlamaConfig {self.name!r}: dtype must be bfloat16, float16 or "
                       f"float32, got {self.dtype!r}")

  @property
  def kv_bytes_per_token(self) -> int:
    """Bytes of keys and values one position takes in one layer's cache (B = 1)."""
    return 2 * self.num_kv_heads * self.head_dim * jnp.dtype(self.dtype).itemsize

  @property
  def layer_weight_bytes(self) -> int:
    """Bytes of one decoder layer's weights."""
    D, N, K, H, F = (self.d_model, self.num_heads, self.num_kv_heads, self.head_dim,
                     self.ffn_dim)
    count = D * N * H * 2 + D * K * H * 2 + 3 * D * F + 2 * D
    return count * jnp.dtype(self.dtype).itemsize

  @property
  def weight_bytes(self) -> int:
    """Bytes of all weights (layers, embedding, final norm, output projection)."""
    embed = self.vocab_size * self.d_model * (1 if self.tie_embeddings else 2)
    return (self.num_layers * self.layer_weight_bytes
            + (embed + self.d_model) * jnp.dtype(self.dtype).itemsize)


#: Presets by name: the shapes of Llama-2-7B and Llama-3-8B, and a small one.
PRESETS = {
    "tiny": LlamaConfig("tiny", num_layers=4, d_model=256, num_heads=8, num_kv_heads=2,
                        head_dim=32, ffn_dim=512, vocab_size=512, tie_embeddings=True,
                        max_context=1 << 16),
    "llama2-7b": LlamaConfig("llama2-7b", num_layers=32, d_model=4096, num_heads=32,
                             num_kv_heads=32, head_dim=128, ffn_dim=11008, vocab_size=32000),
    "llama3-8b": LlamaConfig("llama3-8b", num_layers=32, d_model=4096, num_heads=32,
                             num_kv_heads=8, head_dim=128, ffn_dim=14336, vocab_size=128256,
                             rope_theta=500000.0),
}


def preset(name: str, **overrides) -> LlamaConfig:
  """The preset ``name`` ("tiny", "llama2-7b", "llama3-8b"), with fields replaced.

  Raises:
    ValueError: unknown name (the message lists the presets), or replaced
      fields that make no valid config.
  """
  if name not in PRESETS:
    raise ValueError(f"unknown Llama preset {name!r}; choose one of {sorted(PRESETS)}")
  return dataclasses.replace(PRESETS[name], **overrides)


# --- weights -----------------------------------------------------------------

def _normal(key, shape, std, dtype):
  return (jax.random.normal(key, shape, jnp.float32) * std).astype(dtype)


#: Standard deviation of the random embedding (the usual 0.02): with tied
#: embeddings, a larger one lets a token's own embedding dominate its logits, and
#: greedy decoding of random weights repeats the input token.
EMBED_STD = 0.02


def _init_layer(config: LlamaConfig, key) -> Params:
  D, N, K, H, F = (config.d_model, config.num_heads, config.num_kv_heads, config.head_dim,
                   config.ffn_dim)
  dt = jnp.dtype(config.dtype)
  ks = jax.random.split(key, 7)
  return {
      "attn_norm": jnp.ones((D,), dt),
      "wq": _normal(ks[0], (D, N * H), D ** -0.5, dt),
      "wk": _normal(ks[1], (D, K * H), D ** -0.5, dt),
      "wv": _normal(ks[2], (D, K * H), D ** -0.5, dt),
      "wo": _normal(ks[3], (N * H, D), (N * H) ** -0.5, dt),
      "mlp_norm": jnp.ones((D,), dt),
      "w_gate": _normal(ks[4], (D, F), D ** -0.5, dt),
      "w_up": _normal(ks[5], (D, F), D ** -0.5, dt),
      "w_down": _normal(ks[6], (F, D), F ** -0.5, dt),
  }


def _init_top(config: LlamaConfig, key) -> Params:
  dt = jnp.dtype(config.dtype)
  k_embed, k_head = jax.random.split(key)
  top = {"embed": _normal(k_embed, (config.vocab_size, config.d_model), EMBED_STD, dt),
         "final_norm": jnp.ones((config.d_model,), dt)}
  if not config.tie_embeddings:
    top["lm_head"] = _normal(k_head, (config.d_model, config.vocab_size),
                             config.d_model ** -0.5, dt)
  return top


def init_params(config: LlamaConfig, seed: int = 0, *, device=None) -> Params:
  """Random weights of ``config``, created on ``device`` without passing through the host.

  Projections are normal with standard deviation 1/sqrt(fan_in), the
  embedding normal with ``EMBED_STD``, norm scales 1; each layer's weights come from
  ``fold_in(key(seed), layer)`` by one jitted function (compiled once) whose
  outputs are placed on ``device`` (``out_shardings``).

  Args:
    config: the model shape.
    seed: integer seed.
    device: a ``jax.Device`` (default: ``jax.devices()[0]``).

  Returns:
    ``{"embed": (V, D), "final_norm": (D,), ["lm_head": (D, V) when untied,]
    "layers": [per layer {"attn_norm": (D,), "wq": (D, N*H), "wk": (D, K*H),
    "wv": (D, K*H), "wo": (N*H, D), "mlp_norm": (D,), "w_gate": (D, F),
    "w_up": (D, F), "w_down": (F, D)}]}``, arrays of ``config.dtype``.
  """
  sharding = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
  key = jax.random.key(seed)
  layer_init = jax.jit(functools.partial(_init_layer, config), out_shardings=sharding)
  params = jax.jit(functools.partial(_init_top, config), out_shardings=sharding)(
      jax.random.fold_in(key, config.num_layers))
  params["layers"] = [layer_init(jax.random.fold_in(key, layer))
                      for layer in range(config.num_layers)]
  return params


def tensor_parallel(config: LlamaConfig, mesh: jax.sharding.Mesh,
                    axis: str = "model") -> parallel.TensorParallel:
  """The head layout of ``config`` over ``axis`` of ``mesh`` (``parallel.TensorParallel``;
  its ValueError when the heads do not split over the axis)."""
  return parallel.TensorParallel(mesh, axis, config.num_heads, config.num_kv_heads,
                                 config.head_dim)


def shard_params(params: Params, config: LlamaConfig, tp: parallel.TensorParallel) -> Params:
  """``params`` split for tensor parallelism over ``tp``'s axis (Megatron-LM's layout).

  Attention weights as ``parallel.shard_attention_weights`` (wk, wv of
  ``tp.kv_heads`` heads: repeated when K < P); the feed-forward w_gate and w_up
  by columns, w_down by rows; norms, embedding and output head replicated.
  The result feeds ``prefill``, ``decode_step`` and ``generate`` with the same
  ``tp``.
  """
  replicated = tp.sharding()
  mlp = _mlp_specs(tp)
  out = {name: jax.device_put(value, replicated) for name, value in _top(params).items()}
  out["layers"] = []
  for p in params["layers"]:
    layer = parallel.shard_attention_weights(tp, p["wq"], p["wk"], p["wv"], p["wo"])
    for name, value in p.items():
      if name not in layer:
        layer[name] = jax.device_put(
            value, tp.sharding(*mlp[name]) if name in mlp else replicated)
    out["layers"].append(layer)
  return out


def _mlp_specs(tp: parallel.TensorParallel) -> dict[str, PartitionSpec]:
  """Specs of the feed-forward block's weights over ``tp.axis``: the hidden
  layer's columns split (w_gate, w_up by columns, w_down by rows)."""
  columns = PartitionSpec(None, tp.axis)
  return {"mlp_norm": PartitionSpec(), "w_gate": columns, "w_up": columns,
          "w_down": PartitionSpec(tp.axis, None)}


# --- the blocks ----------------------------------------------------------------

def _rms_norm(x, scale, eps):
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
  return (x32 * scale.astype(jnp.float32)).astype(x.dtype)


def _rope(x, positions, theta):
  """Rotates (B, T, heads, H) by the angles of integer positions (B, T), rotate-half layout."""
  H = x.shape[-1]
  inv_freq = theta ** (-np.arange(0, H, 2, dtype=np.float64) / H)
  angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
  cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
  x32 = x.astype(jnp.float32)
  x1, x2 = x32[..., :H // 2], x32[..., H // 2:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _embed(top, tokens):
  return top["embed"][tokens]


def _attention_inputs(config: LlamaConfig, p, x, positions):
  """(B, T, D) -> q (B, T, N, H), k and v (B, T, K, H), RoPE applied at ``positions``."""
  B, T, _ = x.shape
  N, K, H = config.num_heads, config.num_kv_heads, config.head_dim
  h = _rms_norm(x, p["attn_norm"], config.norm_eps)
  q = (h @ p["wq"]).reshape(B, T, N, H)
  k = (h @ p["wk"]).reshape(B, T, K, H)
  v = (h @ p["wv"]).reshape(B, T, K, H)
  return _rope(q, positions, config.rope_theta), _rope(k, positions, config.rope_theta), v


def _attention_output_and_mlp(config: LlamaConfig, p, x, attn):
  """The rest of a layer: output projection, residual, SwiGLU block, residual."""
  B, T, _ = x.shape
  return _mlp(config, p, x + (attn.reshape(B, T, -1) @ p["wo"]).astype(x.dtype))


def _mlp(config: LlamaConfig, p, x, tp: parallel.TensorParallel | None = None):
  """The SwiGLU block and its residual; with ``tp``, each device computes its
  columns of the hidden layer (weights split by ``shard_params``) and the
  partial products are summed across the axis."""
  if tp is None:
    return x + _swiglu(config, p, x)
  specs = _mlp_specs(tp)
  return jax.shard_map(
      lambda x, w: x + jax.lax.psum(_swiglu(config, w, x), tp.axis), mesh=tp.mesh,
      in_specs=(PartitionSpec(), specs), out_specs=PartitionSpec())(
          x, {name: p[name] for name in specs})


def _swiglu(config: LlamaConfig, p, x):
  h = _rms_norm(x, p["mlp_norm"], config.norm_eps)
  return ((jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]).astype(x.dtype)


def _parallel_layer(config: LlamaConfig, tp: parallel.TensorParallel, p, x, positions, *,
                    cache=None, schedule="auto", num_tiles=None, implementation=None):
  """A whole layer with tensor-parallel attention (``parallel.attention_block``):
  ``(x, k, v)``, k and v the new keys and values (or the updated ``cache``'s)."""
  h = _rms_norm(x, p["attn_norm"], config.norm_eps)
  attn, k, v = parallel.attention_block(
      h, p, tp, positions=positions, rotary=functools.partial(_rope, theta=config.rope_theta),
      is_causal=True, cache=cache, schedule=schedule, num_tiles=num_tiles,
      implementation=implementation)
  return _mlp(config, p, x + attn, tp), k, v


def _logits(config: LlamaConfig, top, x):
  h = _rms_norm(x, top["final_norm"], config.norm_eps)
  w = top["embed"].T if config.tie_embeddings else top["lm_head"]
  return jnp.matmul(h, w, preferred_element_type=jnp.float32)


def _top(params):
  return {name: value for name, value in params.items() if name != "layers"}


def _check_tokens(tokens, what):
  if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(f"{what}: tokens must be an integer array (B, T), got {tokens.shape} "
                     f"{tokens.dtype}")


# --- prefill -------------------------------------------------------------------

def forward(params: Params, tokens, *, config: LlamaConfig, attention_fn=None,
            tp: parallel.TensorParallel | None = None, schedule: str = "auto",
            num_tiles: int | None = None, implementation=None):
  """The decoder over whole sequences.

  Attention by ``attention_fn`` on one device, or, with ``tp``, tensor-parallel:
  each layer's attention through ``parallel.attention_block`` (causal, in
  ``schedule`` with ``num_tiles``: FastAttention's tiling-AllReduce) and its
  feed-forward block split as ``shard_params`` placed it.

  Args:
    params: from ``init_params`` (with ``tp``: through ``shard_params``).
    tokens: (B, P) integer token ids in [0, V).
    config: the model shape (static).
    attention_fn: without ``tp``, called as ``attention_fn(q, k, v)`` with q
      (B, P, N, H), k and v (B, P, K, H); returns (B, P, N, H): causal
      attention, e.g. ``functools.partial(fast_attention, is_causal=True)``
      or the same of ``jax.nn.dot_product_attention``.
    tp: the tensor-parallel layout (``tensor_parallel``), or None.
    schedule, num_tiles, implementation: with ``tp``, passed to
      ``parallel.attention_block``.

  Returns:
    ``(logits, k, v)``: logits (B, P, V) float32 (position i predicts token
    i + 1); k and v (L, B, P, K', H) of ``config.dtype``, every layer's keys
    (RoPE applied) and values; K' = K, or ``tp.kv_heads`` split by heads
    with ``tp``.

  Raises:
    ValueError: tokens not a 2-D integer array, P > ``config.max_context``,
      neither or both of ``attention_fn`` and ``tp``.
  """
  tokens = jnp.asarray(tokens)
  _check_tokens(tokens, "forward")
  B, P = tokens.shape
  if P > config.max_context:
    raise ValueError(f"forward: P={P} tokens exceed max_context={config.max_context} "
                     f"of preset {config.name!r}")
  if (attention_fn is None) == (tp is None):
    raise ValueError("forward: pass attention_fn (one device) or tp (tensor-parallel)")
  positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
  x = _embed(params, tokens)
  ks, vs = [], []
  for p in params["layers"]:
    if tp is None:
      q, k, v = _attention_inputs(config, p, x, positions)
      x = _attention_output_and_mlp(config, p, x, attention_fn(q, k, v))
    else:
      x, k, v = _parallel_layer(config, tp, p, x, positions, schedule=schedule,
                                num_tiles=num_tiles, implementation=implementation)
    ks.append(k)
    vs.append(v)
  return _logits(config, params, x), jnp.stack(ks), jnp.stack(vs)


@functools.partial(jax.jit, static_argnames=("config", "implementation", "tp", "schedule",
                                             "num_tiles"))
def prefill(params: Params, tokens, *, config: LlamaConfig, implementation=None,
            tp: parallel.TensorParallel | None = None, schedule: str = "auto",
            num_tiles: int | None = None):
  """Runs the decoder over whole prompts with causal ``fast_attention``
  (``forward``; its shapes, results and errors).

  Args:
    params: from ``init_params`` (with ``tp``: through ``shard_params``).
    tokens: (B, P) integer token ids in [0, V).
    config: the model shape (static).
    implementation: passed to ``fast_attention`` (None: the platform's best).
    tp, schedule, num_tiles: tensor parallelism, as in ``forward``.

  Returns:
    ``(logits, k, v)`` as ``forward``: k and v to be written into a KV cache
    at positions [0, P).
  """
  if tp is not None:
    return forward(params, tokens, config=config, tp=tp, schedule=schedule,
                   num_tiles=num_tiles, implementation=implementation)
  return forward(params, tokens, config=config, attention_fn=functools.partial(
      fast_attention, is_causal=True, implementation=implementation))


# --- decode --------------------------------------------------------------------

@functools.cache
def decoder(config: LlamaConfig, tp: parallel.TensorParallel | None = None) -> offload.Decoder:
  """The layer functions of ``config`` for ``fastattn_jax.offload.decode_step``
  (with ``tp``: whole tensor-parallel layers, ``Decoder.layer``).

  One object per config and layout (cached), so the jitted steps compile once per shape.
  """
  if tp is not None:
    def layer(p, x, cache_k, cache_v, lengths, positions, implementation):
      return _parallel_layer(config, tp, p, x, positions, cache=(cache_k, cache_v, lengths),
                             implementation=implementation)
    return offload.Decoder(embed=_embed, attention_inputs=None, attention_output=None,
                           head=functools.partial(_logits, config), layer=layer)
  return offload.Decoder(embed=_embed,
                         attention_inputs=functools.partial(_attention_inputs, config),
                         attention_output=functools.partial(_attention_output_and_mlp, config),
                         head=functools.partial(_logits, config))


def decode_step(params: Params, cache: KVCache | PagedKVCache | offload.OffloadedKVCache,
                tokens, *, config: LlamaConfig, implementation=None,
                tp: parallel.TensorParallel | None = None):
  """One decode step over a KV cache, on the device or partly offloaded to host memory.

  Writes the keys and values of the T new tokens of every layer at positions
  ``cache.lengths[b] + t`` and attends with ``decode_attention`` (causal
  among the new tokens), scheduled by ``fastattn_jax.offload.decode_step``:
  a ``KVCache`` runs as a single jitted call; an ``offload.OffloadedKVCache``
  runs its device-resident layers as jitted calls and serves its
  host-resident ones as its plan's mode says (streamed to the device, or
  computed on the host CPU; FastAttention's CPU-GPU cooperative strategy, Lin
  et al. 2024). The cache is donated: the passed ``cache`` must not be used
  afterwards.

  Args:
    params: from ``init_params``, on the device.
    cache: a ``KVCache``, ``PagedKVCache`` or ``offload.OffloadedKVCache`` of
      ``config.num_layers`` layers of (B, S_max, K, H) (paged: pools of
      pages of K, H) in ``config.dtype``.
    tokens: (B, T) integer, the new tokens (T = 1 for plain decoding).
    config: the model shape.
    implementation: passed to ``decode_attention`` for device-resident and
      streamed layers (host-computed layers use the fused "cpu" kernel).
    tp: tensor parallelism (``tensor_parallel``): ``params`` from
      ``shard_params``, a ``KVCache`` of ``tp.kv_heads`` heads split by heads
      (as ``prefill`` with ``tp`` returns them); each layer runs as
      ``parallel.attention_block`` over its cache (one tile: the all-reduce of
      B x T rows is latency-bound) and the split feed-forward block.

  Returns:
    ``(logits, cache)``: logits (B, T, V) float32, on the device; the cache
    with the new positions written and ``lengths`` grown by T.

  Raises:
    ValueError: tokens not (B, T) integer, a cache whose layer count or
      shape does not match ``config``, positions past S_max (as
      ``decode.write`` and ``OffloadedKVCache.check_room``), or ``tp`` with
      an ``OffloadedKVCache``.
  """
  # Host tokens stay on the host: the jitted step takes them with its other
  # arguments, where an eager transfer here was one more round trip a step.
  tokens = tokens if isinstance(tokens, jax.Array) else np.asarray(tokens)
  _check_tokens(tokens, "decode_step")
  if isinstance(cache, offload.OffloadedKVCache):
    plan = cache.plan
    layer_shape = (plan.batch, plan.max_len, plan.kv_heads, plan.head_dim)
  elif isinstance(cache, PagedKVCache):
    layer_shape = (cache.block_table.shape[0], cache.max_len, *cache.k[0].shape[2:])
  else:
    layer_shape = cache.k[0].shape
  kv_heads = config.num_kv_heads if tp is None else tp.kv_heads
  expected = (tokens.shape[0], kv_heads, config.head_dim)
  if cache.num_layers != config.num_layers or (layer_shape[0], *layer_shape[2:]) != expected:
    raise ValueError(
        f"KV cache of {cache.num_layers} layers of {tuple(layer_shape)} does not match preset "
        f"{config.name!r}: expected {config.num_layers} layers of (B={tokens.shape[0]}, S_max, "
        f"K={kv_heads}, H={config.head_dim})")
  return offload.decode_step(decoder(config, tp), params["layers"], _top(params), cache, tokens,
                             implementation=implementation)


# --- generation ----------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("temperature", "top_p"))
def sample(logits, key, *, temperature: float = 0.0, top_p: float = 1.0):
  """The next token of each row of ``logits`` (B, V): greedy (``temperature``
  0), else drawn from softmax(logits / temperature) restricted to the
  smallest set of most likely tokens whose probability reaches ``top_p``
  (nucleus sampling; Holtzman et al. 2020, "The Curious Case of Neural Text
  Degeneration"). Returns (B,) int32."""
  if temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  probs = jax.nn.softmax(logits.astype(jnp.float32) / temperature, axis=-1)
  order = jnp.argsort(-probs, axis=-1)
  sorted_probs = jnp.take_along_axis(probs, order, axis=-1)
  # A token stays if the ones before it have not reached top_p (the first always does).
  keep = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs < top_p
  choice = jax.random.categorical(key, jnp.where(keep, jnp.log(sorted_probs), -jnp.inf))
  return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Generation:
  """What ``generate`` produced and how long it took.

  Attributes:
    tokens: per prompt, the new token ids, ending with the end-of-sequence
      id where the model produced it.
    prefill_compile_s: compiling the prefill (seconds).
    prefill_s: running it over the padded batch.
    step_s: each decode step's seconds (the first one compiles: a warm-up).
  """

  tokens: list
  prefill_compile_s: float
  prefill_s: float
  step_s: list


def generate(params: Params, prompts, *, config: LlamaConfig, new_tokens: int,
             eos_id: int | None = None, temperature: float = 0.0, top_p: float = 1.0,
             seed: int = 0, implementation=None, on_tokens=None,
             tp: parallel.TensorParallel | None = None,
             page_size: int | None = None, kv_dtype=None) -> Generation:
  """Continues prompts of different lengths: one prefill with
  ``fast_attention``, then decode steps over a ``KVCache`` (or, with
  ``page_size``, a ``PagedKVCache``; with ``kv_dtype`` int8 or
  float8_e4m3fn, a quantized one).

  The prompts are right-padded to the longest, P; causal attention keeps a
  prompt's positions blind to its padding, the cache's ``lengths`` start at
  each prompt's length, and each decode step writes at ``lengths`` (over the
  padding) and attends within them. The first new token comes from the
  prefill's logits at each prompt's last position.

  Args:
    params: weights of ``config`` on the device.
    prompts: B sequences of token ids in [0, V), each non-empty.
    config: the model shape.
    new_tokens: tokens to generate per prompt (at most; fewer after ``eos_id``).
    eos_id: the end-of-sequence id; a prompt stops after producing it.
    temperature, top_p: ``sample``'s (temperature 0: greedy).
    seed: the sampling key's seed.
    implementation: the attention path, as in ``fast_attention``.
    on_tokens: called after each step as ``on_tokens(tokens, active)`` with
      the step's ids (B,) and which prompts were still generating (B,) bool,
      as numpy arrays (e.g. to stream text).
    tp: tensor parallelism (``tensor_parallel``; ``params`` from
      ``shard_params``): the prefill's attention in FastAttention's
      tiling-AllReduce (``parallel.attention_block``, schedule "auto"), the
      steps over a KV cache split by heads.
    page_size: None for a contiguous cache; else the page size of a
      ``PagedKVCache`` whose pool holds every prompt's pages and its new
      tokens' (not with ``tp``).
    kv_dtype: the cache's dtype, default the model's; int8 (scales per
      position and head) or float8_e4m3fn (scale 1 per head) quantize it
      (``decode.quantize``; not with ``tp``).

  Returns:
    A ``Generation``.

  Raises:
    ValueError: an empty prompt, an id outside [0, V), ``new_tokens`` < 1,
      or a prompt plus ``new_tokens`` past ``config.max_context``.
  """
  lengths = np.asarray([len(p) for p in prompts], np.int32)
  if not len(prompts) or lengths.min() < 1:
    raise ValueError(f"generate: every prompt needs a token, got lengths {lengths.tolist()}")
  if new_tokens < 1:
    raise ValueError(f"generate: new_tokens must be positive, got {new_tokens}")
  if lengths.max() + new_tokens > config.max_context:
    raise ValueError(f"generate: a prompt of {lengths.max()} tokens + {new_tokens} new ones "
                     f"exceeds the model's context, {config.max_context}")
  B, P = len(prompts), int(lengths.max())
  tokens = np.zeros((B, P), np.int32)
  for b, prompt in enumerate(prompts):
    ids = np.asarray(prompt)
    if ids.min() < 0 or ids.max() >= config.vocab_size:
      raise ValueError(f"generate: prompt {b} has ids outside [0, {config.vocab_size})")
    tokens[b, :len(ids)] = ids

  start = time.perf_counter()
  options = None if tp is None else parallel.compiler_options(
      tp.mesh.devices.flat[0].platform)  # the tiled prefill's all-reduces overlap on GPUs
  compiled = prefill.lower(params, tokens, config=config, implementation=implementation,
                           tp=tp).compile(compiler_options=options)
  prefill_compile_s = time.perf_counter() - start
  start = time.perf_counter()
  logits, k, v = jax.block_until_ready(compiled(params, tokens))
  prefill_s = time.perf_counter() - start

  if page_size is None:
    cache = KVCache.from_prefill(k, v, lengths, P + new_tokens, dtype=kv_dtype)
  else:
    pages = int(sum(-(-(n + new_tokens) // page_size) for n in lengths))
    cache = PagedKVCache.from_prefill(k, v, lengths, num_pages=pages, page_size=page_size,
                                      max_len=P + new_tokens, dtype=kv_dtype)
  del k, v
  key = jax.random.key(seed)
  last = logits[jnp.arange(B), jnp.asarray(lengths) - 1]
  next_ids = sample(last, jax.random.fold_in(key, 0), temperature=temperature, top_p=top_p)
  del logits
  out = [[] for _ in range(B)]
  active = np.ones(B, bool)
  step_s = []
  for step in range(new_tokens):
    ids = np.asarray(next_ids)
    for b in np.flatnonzero(active):
      out[b].append(int(ids[b]))
    if on_tokens is not None:
      on_tokens(ids, active.copy())
    if eos_id is not None:
      active &= ids != eos_id
    if step == new_tokens - 1 or not active.any():
      break
    start = time.perf_counter()
    logits, cache = decode_step(params, cache, ids[:, None], config=config,
                                implementation=implementation, tp=tp)
    next_ids = sample(logits[:, 0], jax.random.fold_in(key, step + 1), temperature=temperature,
                      top_p=top_p)
    next_ids.block_until_ready()
    step_s.append(time.perf_counter() - start)
  return Generation(tokens=out, prefill_compile_s=prefill_compile_s, prefill_s=prefill_s,
                    step_s=step_s)
