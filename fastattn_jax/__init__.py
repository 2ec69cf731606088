"""fastattn_jax: fused attention kernels for JAX as XLA custom calls.

``fast_attention`` is a drop-in for ``jax.nn.dot_product_attention`` that
picks the fastest path for the device; ``explain`` says which path a call
takes, forward and backward, and why. ``decode_attention``, ``KVCache`` and
``PagedKVCache`` serve decoding over KV caches, contiguous or paged;
``fastattn_jax.offload`` keeps long caches in host memory,
``fastattn_jax.parallel`` splits attention heads over devices,
``fastattn_jax.flax`` plugs ``fast_attention`` into Flax modules.
"""

from fastattn_jax.attention import Explanation, explain, fast_attention
from fastattn_jax.backends import (build_info, export_disabled_checks, implementations,
                                   resolve_implementation)
from fastattn_jax.decode import KVCache, decode_attention
from fastattn_jax.paged import PagedKVCache

__all__ = ["Explanation", "KVCache", "PagedKVCache", "build_info", "decode_attention",
           "explain", "export_disabled_checks", "fast_attention", "implementations",
           "resolve_implementation"]
__version__ = "0.1.0"
