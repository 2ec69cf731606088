"""The on-disk kernel cache treats every entry it cannot use as a miss: a
directory at an entry's path, an unreadable entry, a cache folder that is a
file or cannot be written. The kernel then compiles in memory, a warning
says why, and nothing throws (the FFI handlers reach the cache).

Needs NVRTC only (no GPU): skips cleanly without it.
"""

import os

import pytest

from fastattn_jax import _ffi, cuda
from fastattn_jax.shapes import DTYPE_CODES

#: A small, quick variant: kernel 75, H = 32, float16, for sm_75.
CC = 75
KEY = _ffi.cuda_variant_key(75, 32, DTYPE_CODES["float16"], DTYPE_CODES["float16"], False, 0)


@pytest.fixture(autouse=True)
def nvrtc():
  cuda.configure()
  try:
    _ffi.nvrtc_version_for(CC)
  except RuntimeError as err:
    pytest.skip(f"no NVRTC compiles for sm_{CC} here: {err}")


@pytest.fixture
def cache(tmp_path, monkeypatch):
  """An empty kernel cache folder for this test (the user's restored after)."""
  folder = tmp_path / "cache"
  folder.mkdir()
  monkeypatch.setenv("FASTATTN_CACHE_DIR", str(folder))
  cuda.configure()
  yield folder
  monkeypatch.undo()
  cuda.configure()


def _entry(cache) -> str:
  """The entry's path: compiled once into the empty cache, then removed."""
  assert not cuda.compile_variant(KEY, CC)["from_cache"]
  (entry,) = cache.iterdir()
  entry.unlink()
  return entry


def test_directory_at_entry_path_is_a_miss(cache, capfd):
  entry = _entry(cache)
  entry.mkdir()
  (entry / "inside").write_text("x")  # a non-empty directory: rename cannot replace it
  for _ in range(2):  # neither the read nor the write throws; both times compiled
    r = cuda.compile_variant(KEY, CC)
    assert not r["from_cache"] and r["cubin_bytes"] > 0
  err = capfd.readouterr().err
  assert "not a regular file" in err and "cannot write the kernel cache entry" in err
  assert entry.is_dir() and not [p for p in cache.iterdir() if ".tmp." in p.name]


def test_empty_directory_at_entry_path_is_a_miss(cache, capfd):
  entry = _entry(cache)
  entry.mkdir()
  r = cuda.compile_variant(KEY, CC)
  assert not r["from_cache"] and r["cubin_bytes"] > 0
  assert "not a regular file" in capfd.readouterr().err


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_entry_is_a_miss(cache, capfd):
  entry = _entry(cache)
  assert not cuda.compile_variant(KEY, CC)["from_cache"]
  entry.chmod(0)
  try:
    r = cuda.compile_variant(KEY, CC)
    assert not r["from_cache"] and r["cubin_bytes"] > 0
    assert "cannot read the kernel cache entry" in capfd.readouterr().err
  finally:
    entry.chmod(0o644)


def test_cache_folder_that_is_a_file(tmp_path, monkeypatch, capfd):
  folder = tmp_path / "not-a-folder"
  folder.write_text("a file where the cache folder should be")
  monkeypatch.setenv("FASTATTN_CACHE_DIR", str(folder))
  cuda.configure()
  other = _ffi.cuda_variant_key(75, 64, DTYPE_CODES["float16"], DTYPE_CODES["float16"], False,
                                 0)
  try:
    for key in (KEY, other):
      r = cuda.compile_variant(key, CC)
      assert not r["from_cache"] and r["cubin_bytes"] > 0
    # Once per folder, as the Ascend cache warns: the second kernel adds nothing.
    assert capfd.readouterr().err.count("cannot write the kernel cache entry") == 1
  finally:
    monkeypatch.undo()
    cuda.configure()


def test_truncated_entry_is_a_miss_and_rewritten(cache):
  assert not cuda.compile_variant(KEY, CC)["from_cache"]
  (entry,) = cache.iterdir()
  entry.write_bytes(entry.read_bytes()[:5])
  assert not cuda.compile_variant(KEY, CC)["from_cache"]
  assert cuda.compile_variant(KEY, CC)["from_cache"]
