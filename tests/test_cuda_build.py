"""The CUDA kernels compile with NVRTC on a machine without a GPU, and the
kernel cache is safe: every shipped variant for sm_70, sm_75, sm_80, sm_86 and
sm_90 (register spills fail the main variants), concurrent processes filling
one cache, and a corrupt entry rebuilt.

NVRTC comes from PyPI (``nvidia-cuda-nvrtc-cu12``, in the ``test`` extra),
which targets sm_70..sm_90 with no GPU or toolkit.
"""

import concurrent.futures
import os
import subprocess
import sys

import pytest

import fa_testutil as tu
from fastattn_jax import _ffi, backends, cuda_kernels, precompile

ARCHS = ["sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]


@pytest.fixture
def cache(tmp_path):
  """An empty kernel cache for this test (restored afterwards)."""
  _ffi.set_cache_dir(str(tmp_path))
  yield tmp_path
  _ffi.set_cache_dir(cuda_kernels.cache_dir())


def _main_variant(v: cuda_kernels.Variant, arch: str) -> bool:
  """The variants that must not spill: the path the arch picks itself, no
  bias/mask/softcap, H <= 128; and every decode kernel."""
  return v.decode_rows > 0 or (
      v.path == max(cuda_kernels.paths_for_arch(arch)) and not v.general and v.head_dim <= 128)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_shipped_variant_compiles(arch, cache):
  if tu.has_gpu():
    pytest.skip("CPU-only check (a GPU machine compiles for its own arch in the GPU suite)")
  variants = cuda_kernels.shipped_variants(arch)
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    results = list(pool.map(lambda v: (v, v.compile(arch)), variants))
  spilling = [f"{v}: {precompile.spills(r['log'])} bytes" for v, r in results
              if precompile.spills(r["log"]) and _main_variant(v, arch)]
  assert not spilling, "register spills in main variants:\n" + "\n".join(spilling)
  assert all(r["cubin_bytes"] > 0 and not r["from_cache"] for _, r in results)
  assert len(os.listdir(cache)) == len(variants)


def _compile_in_subprocess(cache_dir):
  code = (
      "from fastattn_jax import _ffi, cuda_kernels as ck\n"
      f"_ffi.set_cache_dir({str(cache_dir)!r})\n"
      "r = ck.Variant(75, 64, 'float16', 'float16', False).compile('sm_75')\n"
      "print(r['from_cache'])\n")
  return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


def test_concurrent_processes_share_the_cache(cache):
  procs = [_compile_in_subprocess(cache) for _ in range(4)]
  outs = [p.communicate(timeout=300) for p in procs]
  assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
  entries = os.listdir(cache)
  assert len(entries) == 1 and entries[0].endswith(".cubin"), entries  # no temp files left
  assert _compile_in_subprocess(cache).communicate(timeout=300)[0].strip() == "True"


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty"])
def test_corrupt_entry_is_rebuilt(cache, damage):
  v = cuda_kernels.Variant(80, 32, "float16", "float32", True)
  first = v.compile("sm_80")
  assert not first["from_cache"] and v.compile("sm_80")["from_cache"]
  (entry,) = cache.iterdir()
  data = bytearray(entry.read_bytes())
  if damage == "truncate":
    data = data[: len(data) // 2]
  elif damage == "flip":
    data[len(data) // 2] ^= 0xFF
  else:
    data = bytearray()
  entry.write_bytes(bytes(data))
  rebuilt = v.compile("sm_80")
  assert not rebuilt["from_cache"] and rebuilt["cubin_bytes"] == first["cubin_bytes"]
  assert v.compile("sm_80")["from_cache"]


def test_unknown_arch_and_bad_variant_raise(cache):
  with pytest.raises(RuntimeError, match="sm_30"):
    cuda_kernels.Variant(70, 64, "float16", "float16", False).compile("sm_30")
  with pytest.raises(RuntimeError, match="head_dim"):
    cuda_kernels.Variant(80, 48, "float16", "float16", False).compile("sm_80")
  with pytest.raises(RuntimeError, match="bfloat16"):
    cuda_kernels.Variant(75, 64, "bfloat16", "float16", False).compile("sm_75")
  with pytest.raises(RuntimeError, match="multiple of 64"):
    cuda_kernels.Variant(90, 96, "bfloat16", "bfloat16", False).compile("sm_90")
  with pytest.raises(RuntimeError, match="sm_90 .* only"):
    cuda_kernels.Variant(90, 64, "bfloat16", "bfloat16", False).compile("sm_100")
  with pytest.raises(RuntimeError, match="decode_rows must be"):
    cuda_kernels.Variant(75, 128, "bfloat16", "bfloat16", False, 3).compile("sm_70")
  with pytest.raises(RuntimeError, match="path 75 or 80"):
    cuda_kernels.Variant(70, 128, "float16", "float16", False, 4).compile("sm_70")


def test_decode_kernel_reads_bfloat16_on_every_arch(cache):
  """The decode kernel runs on CUDA cores: bfloat16 needs no tensor core, so
  sm_70 and sm_75 read the cache as it is, with no conversion pass."""
  for arch in ("sm_70", "sm_75"):
    r = cuda_kernels.Variant(75, 128, "bfloat16", "bfloat16", False, 4).compile(arch)
    assert r["cubin_bytes"] > 0 and precompile.spills(r["log"]) == 0, r["log"]
  assert cuda_kernels.decode_rows(4) == 4 and cuda_kernels.decode_rows(5) == 8
  assert cuda_kernels.decode_rows(9) == 0


@pytest.mark.parametrize("capability, head_dim, path", [
    ((7, 0), 64, "cuda_sm70"), ((7, 2), 64, "cuda_sm70"), ((7, 5), 128, "cuda_sm75"),
    ((8, 0), 64, "cuda_sm80"), ((8, 6), 128, "cuda_sm80"), ((8, 9), None, "cuda_sm80"),
    ((9, 0), None, "cuda_sm90"), ((9, 0), 40, "cuda_sm90"), ((9, 0), 128, "cuda_sm90"),
    ((9, 0), 256, "cuda_sm90"), ((9, 0), 96, "cuda_sm80"), ((9, 0), 160, "cuda_sm80"),
    ((10, 0), 128, "cuda_sm80"), ((12, 0), 64, "cuda_sm80"),
])
def test_path_choice_by_compute_capability(capability, head_dim, path):
  """What implementation=None runs on each GPU generation (no GPU needed):
  sm_90a code runs on 9.0 only, and only for H that pads to a multiple of 64
  no further than to a multiple of 32."""
  assert backends._cuda_path_for(capability, head_dim) == path
  assert cuda_kernels.runs_on(cuda_kernels.PATHS[path], capability)


def test_sm90_variants_are_the_wgmma_kernel(cache):
  """Path 90 compiles for the arch-specific sm_90a target (wgmma exists
  nowhere else) and its head dims are rounded to multiples of 64."""
  assert cuda_kernels.paths_for_arch("sm_90") == [70, 75, 80, 90]
  assert 90 not in cuda_kernels.paths_for_arch("sm_100")
  assert {v.head_dim for v in cuda_kernels.shipped_variants("sm_90") if v.path == 90} == {
      64, 128, 192, 256}
  log = cuda_kernels.Variant(90, 128, "bfloat16", "bfloat16", False).compile("sm_90")["log"]
  assert "sm_90a" in log, log


def test_precompile_cli(cache, monkeypatch, capsys):
  monkeypatch.setenv("FASTATTN_CACHE_DIR", str(cache))
  assert precompile.main(["--arch", "sm_75", "--head-dims", "64", "--dtypes", "float16"]) == 0
  assert "8 ready (8 compiled" in capsys.readouterr().out
  assert precompile.main(["--arch", "75", "--head-dims", "40", "--dtypes", "float16"]) == 0
  assert "8 ready (0 compiled, 8 already cached)" in capsys.readouterr().out
