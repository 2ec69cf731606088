"""Applications of fastattn_jax's public API: a Llama-architecture decoder
(``llama``), its loader from GGUF files (``gguf``) and the text generation
program ``python -m fastattn_jax.generate``.

An optional part of the package: ``pip install "fastattn-jax[models]"``
installs what the loader and the program need (``gguf``, ``tokenizers``,
``jinja2`` for chat templates, ``tqdm`` and ``humanize`` for the program's
output). ``import fastattn_jax`` never imports this package.
"""


def missing_extra(err: ImportError, what: str) -> ImportError:
  """The ImportError to raise when ``what`` lacks a package of the ``models`` extra."""
  return ImportError(f"{what} needs fastattn_jax's optional models part: pip install "
                     f"\"fastattn-jax[models]\" (missing: {err.name})")
