"""Prints ``fastattn_jax.build_info()`` as JSON: which build of the native
extension Python loads, its FFI targets and its embedded kernel sources.

    python -m fastattn_jax
"""

import json

from fastattn_jax import build_info

print(json.dumps(build_info(), indent=1, sort_keys=True))
