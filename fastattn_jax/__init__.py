"""fastattn_jax: fused attention kernels for JAX as XLA custom calls.

``fast_attention`` is a drop-in for ``jax.nn.dot_product_attention`` that
picks the fastest path for the device (see ``resolve_implementation``).
"""

from fastattn_jax.attention import fast_attention
from fastattn_jax.backends import build_info, implementations, resolve_implementation

__all__ = ["build_info", "fast_attention", "implementations", "resolve_implementation"]
__version__ = "0.1.0"
