"""The only module that touches JAX internals (``jax._src``); keep it small.

``fast_attention_p`` lowers through ``custom_partitioning`` when a
computation spans several devices, and that lowering needs the concrete
device assignment, which jit hands to the lowering only for primitives
registered here (as ``custom_partitioning_p`` itself is).
"""

from jax._src import dispatch


def require_devices_during_lowering(primitive) -> None:
  dispatch.prim_requires_devices_during_lowering.add(primitive)
