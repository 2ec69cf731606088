"""fastattn_jax's benchmarks, kept beside the library: run them from the
repository root as ``python -m benchmarks.<name>``."""
