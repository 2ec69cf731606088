"""The package is the library: ``import fastattn_jax`` and its public modules
need JAX and NumPy alone, the applications (``fastattn_jax.models``,
``python -m fastattn_jax.generate``) come with the ``models`` extra and say
so without it, and the top level exports the public API.

Runs from a checkout and against an installed wheel (``make wheel-test``).
"""

import importlib.metadata
import re
import subprocess
import sys
import textwrap

import pytest

import fastattn_jax

#: Top-level packages of the optional parts and of the test and benchmark
#: tools, none of which the library may import.
APPLICATION_PACKAGES = ("gguf", "tokenizers", "jinja2", "tqdm", "humanize", "flax", "equinox",
                        "optax", "matplotlib", "safetensors", "torch", "transformers",
                        "hypothesis", "ziglang", "nanobind")
#: The library's modules: what ``import fastattn_jax`` and its public parts load.
LIBRARY_MODULES = ("fastattn_jax", "fastattn_jax.offload", "fastattn_jax.parallel",
                   "fastattn_jax.flax", "fastattn_jax.ascend", "fastattn_jax.timing",
                   "fastattn_jax.precompile")

_BLOCKER = textwrap.dedent(f"""
    import importlib.abc, sys
    BLOCKED = {APPLICATION_PACKAGES!r}

    class Blocker(importlib.abc.MetaPathFinder):
      def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCKED:
          raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)", name=name)

    sys.meta_path.insert(0, Blocker())
""")


def _run_blocked(code: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-c", _BLOCKER + textwrap.dedent(code)],
                        capture_output=True, text=True, timeout=300)


def test_library_imports_without_application_packages():
  done = _run_blocked(f"""
      import importlib
      for name in {LIBRARY_MODULES!r}:
        importlib.import_module(name)
      loaded = sorted({{m.split(".")[0] for m in sys.modules}} & set(BLOCKED))
      apps = sorted(m for m in sys.modules if m.startswith(("fastattn_jax.models",
                                                            "fastattn_jax.generate")))
      print("LOADED", loaded, apps)
  """)
  assert done.returncode == 0, done.stderr
  assert "LOADED [] []" in done.stdout


def test_generate_without_the_extra_names_it():
  done = _run_blocked("""
      import runpy
      sys.argv = ["python -m fastattn_jax.generate", "--help"]
      runpy.run_module("fastattn_jax.generate", run_name="__main__")
  """)
  assert done.returncode == 1
  assert 'pip install "fastattn-jax[models]"' in done.stderr, done.stderr
  imported = _run_blocked("""
      try:
        import fastattn_jax.models.gguf
      except ImportError as err:
        print("ERROR", err)
  """)
  assert 'needs fastattn_jax\'s optional models part: pip install "fastattn-jax[models]"' in (
      imported.stdout), imported.stdout + imported.stderr


def test_core_requirements_are_jax_and_numpy():
  try:
    requires = importlib.metadata.requires("fastattn-jax")
  except importlib.metadata.PackageNotFoundError:
    pytest.skip("fastattn-jax is not installed (no package metadata)")
  core = {re.split(r"[ <>=!~;\[]", r, maxsplit=1)[0].lower() for r in requires
          if "extra ==" not in r}
  assert core == {"jax", "jaxlib", "numpy"}


def test_top_level_exports_the_public_api():
  for name in ("fast_attention", "decode_attention", "KVCache", "explain", "Explanation",
               "implementations", "resolve_implementation", "build_info"):
    assert name in fastattn_jax.__all__ and hasattr(fastattn_jax, name), name
  assert set(fastattn_jax.__all__) <= set(dir(fastattn_jax))
