"""Programs built on fastattn_jax (models, demos), kept beside the library:
run them from the repository root as ``python -m examples.<name>``."""
