"""The CUDA kernels compile with NVRTC on a machine without a GPU, and the
kernel cache is safe: for sm_70, sm_75, sm_80 and sm_90, every shipped
variant of the kernels that GPU runs by default (register spills fail the
main variants, wgmma instructions that ptxas serializes or a warning of the
front end, such as a name no build uses, fail any),
concurrent processes filling one cache, and a corrupt entry rebuilt. The
older kernels a newer GPU runs only when forced (kernel 70 on sm_75 and
newer, kernel 75 on sm_80 and newer) are left out to keep CI within its
time: they were a third of the 992 compiles, and the GPU suite's forced
paths compile every one of them for sm_90 on the device. sm_86 compiles
kernel 80's sources as sm_80 does, with the same register file, and is left
out likewise; so are the variants a lower arch of the list runs by default
too (kernel 80's on sm_90, kernel 75's decode builds on sm_75), which that
arch's case compiles.

NVRTC comes from PyPI (``nvidia-cuda-nvrtc-cu12``, in the ``test`` extra),
which targets sm_70..sm_90 with no GPU or toolkit.
"""

import concurrent.futures
import dataclasses
import os
import subprocess
import sys

import jax.numpy as jnp
import pytest

import fa_testutil as tu
from fastattn_jax import _ffi, cuda, precompile
from fastattn_jax.shapes import DTYPE_CODES, AttentionConfig

#: The GPUs compiled for, by compute capability, and the kernels (forward,
#: backward and decode builds, by kernel_sm) each runs by default: kernel 80
#: on sm_90 too, for head dims that are not multiples of 64 and for the
#: decode kernel up to 16 rows.
DEFAULT_KERNELS = {70: {70, 75}, 75: {75}, 80: {80}, 90: {80, 90}}
CCS = list(DEFAULT_KERNELS)


@pytest.fixture
def cache(tmp_path, monkeypatch):
  """An empty kernel cache for this test (the user's restored afterwards)."""
  monkeypatch.setenv("FASTATTN_CACHE_DIR", str(tmp_path))
  cuda.configure()
  yield tmp_path
  monkeypatch.undo()
  cuda.configure()


def _key(kernel_sm, head_dim, dtype, out_dtype, extras=False, decode_rows=0):
  return _ffi.cuda_variant_key(kernel_sm, head_dim, DTYPE_CODES[dtype],
                               DTYPE_CODES[out_dtype], extras, decode_rows)


def _main_variant(v: dict, cc: int) -> bool:
  """The variants that must not spill: the kernel the GPU picks itself, no
  extras (bias, mask, soft cap), H <= 128; every backward kernel without
  extras; and every decode kernel."""
  own = max(k for k in cuda.IMPLEMENTATIONS.values() if _ffi.cuda_runs_on(k, cc))
  return v["decode_rows"] > 0 or (v["backward"] and not v["extras"]) or (
      v["kernel_sm"] == own and not v["extras"] and v["head_dim"] <= 128)


def _default_kernels(cc: int) -> set:
  """The kernel_sm of the forward, backward and decode plans that
  implementation=None makes on compute capability cc, over head dims and row
  counts."""
  config = AttentionConfig(scale=0.1, is_causal=True, end_aligned=True)
  kernels = set()
  for h in (32, 64, 96, 128, 160, 256):
    path = cuda.default_implementation(cc, h)
    for T in (1, 2, 4, 8, 16, 64):
      kernels.add(cuda.plan(path, config, (1, T, 32, h), (1, 4096, 8, h),
                            jnp.bfloat16 if cc >= 80 else jnp.float16)["kernel_sm"])
    if h <= 128:  # the backward kernels of every path
      kernels.add(cuda.plan(path, config, (1, 64, 8, h), (1, 64, 8, h), jnp.float16,
                            backward=True)["kernel_sm"])
  return kernels


def _default_variants(cc: int) -> list:
  return [key for key in cuda.shipped_variants(cc)
          if _ffi.cuda_variant(key)["kernel_sm"] in DEFAULT_KERNELS[cc]]


def _variants_to_compile(cc: int) -> list:
  """The shipped variants cc runs by default, less those a lower cc of CCS
  runs by default too (kernel 75's decode builds on sm_75, kernel 80's builds
  on sm_90): the same source for the same register file (64K registers per
  SM, 255 per thread), compiled and checked for spills in that cc's case; the
  GPU suite compiles them for its own GPU."""
  lower = set().union(*(_default_variants(c) for c in CCS if c < cc))
  return [key for key in _default_variants(cc) if key not in lower]


@pytest.mark.parametrize("cc", CCS)
def test_every_shipped_variant_compiles(cc, cache):
  assert _default_kernels(cc) == DEFAULT_KERNELS[cc]
  if tu.has_gpu():
    pytest.skip("CPU-only check (a GPU machine compiles for its own arch in the GPU suite)")
  keys = _variants_to_compile(cc)
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    results = list(pool.map(lambda key: (_ffi.cuda_variant(key), cuda.compile_variant(key, cc)),
                            keys))
  spilling = [f"{v['describe']}: {precompile.spills(r['log'])} bytes" for v, r in results
              if precompile.spills(r["log"]) and _main_variant(v, cc)]
  assert not spilling, "register spills in main variants:\n" + "\n".join(spilling)
  serialized = [v["describe"] for v, r in results if precompile.serialized_wgmma(r["log"])]
  assert not serialized, "ptxas serialized the wgmma of:\n" + "\n".join(serialized)
  warned = sorted({f"{v['describe']}: {line}" for v, r in results for line in r["log"].splitlines()
                   if "warning #" in line})
  assert not warned, "the compiler's front end warned:\n" + "\n".join(warned[:20])
  assert all(r["cubin_bytes"] > 0 and not r["from_cache"] for _, r in results)
  assert len(os.listdir(cache)) == len(keys)


def test_ptxas_reports_are_read():
  """The two ptxas findings that fail a compile above, as ptxas 12-13 words
  them (serialized wgmma: the notes C7514, C7520 and their kin; C7519 is
  harmless). A kernel-90 forward whose wgmma C7520 serialized ran 20-28%
  slower (H100, docs/performance.md)."""
  log = ("ptxas info    : (C7519) warpgroup.arrive is injected in around line 2312 by compiler\n"
         "ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are "
         "serialized due to non wgmma instructions reading accumulator registers\n"
         "ptxas         .     16 bytes stack frame, 20 bytes spill stores, 20 bytes spill loads\n")
  assert precompile.serialized_wgmma(log) and precompile.spills(log) == 40
  harmless = log.splitlines()[0]
  assert not precompile.serialized_wgmma(harmless) and precompile.spills(harmless) == 0
  divergent = ("ptxas info    : (C7520) Potential Performance Loss: wgmma.mma_async instructions "
               "are serialized due to program dependence on compiler-inserted WG.AR in "
               "divergent path in the function 'fa_forward'\n")
  assert precompile.serialized_wgmma(divergent)


def _compile_in_subprocess(cache_dir):
  code = (
      "from fastattn_jax import cuda\n"
      f"r = cuda.compile_variant({_key(75, 64, 'float16', 'float16')}, 75)\n"
      "print(r['from_cache'])\n")
  return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True,
                          env=tu.fresh_process_env(FASTATTN_CACHE_DIR=str(cache_dir)))


def test_concurrent_processes_share_the_cache(cache):
  procs = [_compile_in_subprocess(cache) for _ in range(4)]
  outs = [p.communicate(timeout=300) for p in procs]
  assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
  entries = os.listdir(cache)
  assert len(entries) == 1 and entries[0].endswith(".cubin"), entries  # no temp files left
  assert _compile_in_subprocess(cache).communicate(timeout=300)[0].strip() == "True"


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty"])
def test_corrupt_entry_is_rebuilt(cache, damage):
  key = _key(80, 32, "float16", "float32", extras=True)
  first = cuda.compile_variant(key, 80)
  assert not first["from_cache"] and cuda.compile_variant(key, 80)["from_cache"]
  (entry,) = cache.iterdir()
  data = bytearray(entry.read_bytes())
  if damage == "truncate":
    data = data[: len(data) // 2]
  elif damage == "flip":
    data[len(data) // 2] ^= 0xFF
  else:
    data = bytearray()
  entry.write_bytes(bytes(data))
  rebuilt = cuda.compile_variant(key, 80)
  assert not rebuilt["from_cache"] and rebuilt["cubin_bytes"] == first["cubin_bytes"]
  assert cuda.compile_variant(key, 80)["from_cache"]


def test_unknown_arch_and_bad_variant_raise(cache):
  with pytest.raises(RuntimeError, match="sm_30"):
    cuda.compile_variant(_key(70, 64, "float16", "float16"), 30)
  with pytest.raises(RuntimeError, match="head_dim"):
    cuda.compile_variant(_key(80, 48, "float16", "float16"), 80)
  with pytest.raises(RuntimeError, match="bfloat16"):
    cuda.compile_variant(_key(75, 64, "bfloat16", "float16"), 75)
  with pytest.raises(RuntimeError, match="multiple of 64"):
    cuda.compile_variant(_key(90, 96, "bfloat16", "bfloat16"), 90)
  with pytest.raises(RuntimeError, match="sm_90 .* only"):
    cuda.compile_variant(_key(90, 64, "bfloat16", "bfloat16"), 100)
  with pytest.raises(RuntimeError, match="decode_rows must be"):
    cuda.compile_variant(_key(75, 128, "bfloat16", "bfloat16", decode_rows=3), 70)
  with pytest.raises(RuntimeError, match="sm 75, 80 or 90"):
    cuda.compile_variant(_key(70, 128, "float16", "float16", decode_rows=4), 70)
  with pytest.raises(RuntimeError, match="more than 16 rows"):
    cuda.compile_variant(_key(90, 128, "bfloat16", "bfloat16", decode_rows=16), 90)
  with pytest.raises(ValueError, match="no kernel variant"):
    _ffi.cuda_variant(_key(80, 48, "float16", "float16"))


def test_decode_kernel_reads_bfloat16_on_every_arch(cache):
  """The decode kernel's sm75 build runs on CUDA cores: bfloat16 needs no
  tensor core, so sm_70 and sm_75 read the cache as it is, with no conversion
  pass (the owner plans bfloat16 operands for it on every kernel)."""
  try:
    _ffi.nvrtc_version_for(70)
  except RuntimeError as err:
    pytest.skip(f"no NVRTC here compiles for sm_70 (CUDA 13 dropped it): {err}")
  for cc in (70, 75):
    r = cuda.compile_variant(_key(75, 128, "bfloat16", "bfloat16", decode_rows=4), cc)
    assert r["cubin_bytes"] > 0 and precompile.spills(r["log"]) == 0, r["log"]
  config = AttentionConfig(scale=0.1, is_causal=False)
  for implementation in ("cuda_sm70", "cuda_sm75"):
    plan = cuda.plan(implementation, config, (1, 1, 4, 128), (1, 300, 1, 128), jnp.bfloat16)
    assert plan["decode_rows"] == 4 and plan["kernel_sm"] == 75
    assert plan["operand_dtype"] == DTYPE_CODES["bfloat16"]


def test_paged_decode_is_its_own_build(cache):
  """A paged cache gets the decode kernel's paged build (the contiguous build
  keeps no block-table code: it cost 13-19% at B = 1), which compiles without
  spills; above the decode kernel's rows the plan is the forward kernel's (the
  caller gathers the pages)."""
  if tu.has_gpu():
    pytest.skip("CPU-only check (a GPU machine compiles for its own arch in the GPU suite)")
  config = AttentionConfig(scale=0.1, is_causal=True, end_aligned=True, has_kv_lens=True,
                           has_block_table=True)
  for implementation, rows in (("cuda_sm90", 8), ("cuda_sm75", 8)):
    plan = cuda.plan(implementation, config, (2, 2, 32, 128), (2, 4096, 8, 128), jnp.bfloat16)
    assert (plan["decode_rows"], plan["paged"], cuda.reads_pages(plan)) == (rows, 1, True)
  plan = cuda.plan("cuda_sm90", config, (2, 17, 32, 128), (2, 4096, 8, 128), jnp.bfloat16)
  assert (plan["decode_rows"], plan["paged"], cuda.reads_pages(plan)) == (0, 0, False)
  contiguous = dataclasses.replace(config, has_block_table=False)
  assert cuda.plan("cuda_sm90", contiguous, (2, 2, 32, 128), (2, 4096, 8, 128),
                   jnp.bfloat16)["paged"] == 0
  for cc, build, rows, h in ((90, 80, 1, 128), (90, 80, 64, 256), (75, 75, 8, 128)):
    r = cuda.compile_variant(_ffi.cuda_variant_key(build, h, DTYPE_CODES["bfloat16"],
                                                   DTYPE_CODES["bfloat16"], False, rows, True),
                             cc)
    assert r["cubin_bytes"] > 0 and precompile.spills(r["log"]) == 0, r["log"]


def test_decode_build_90_serves_many_rows_on_sm90(cache):
  """On the sm90 path the decode kernel's wgmma build (90) serves more than 16
  rows per key/value head of a 16-bit cache, contiguous or paged, at kernel
  head dims rounded to 64; up to 16 rows, quantized caches and the sm80 path
  keep build 80. Build 90 compiles for sm_90a without spills."""
  config = AttentionConfig(scale=0.1, is_causal=True, end_aligned=True, has_kv_lens=True)
  k = (2, 4096, 8, 96)
  for implementation, T, build, rows in (("cuda_sm90", 4, 80, 16), ("cuda_sm90", 5, 90, 32),
                                         ("cuda_sm90", 16, 90, 64), ("cuda_sm80", 16, 80, 64)):
    plan = cuda.plan(implementation, config, (2, T, 32, 96), k, jnp.bfloat16)
    assert (plan["kernel_sm"], plan["decode_rows"]) == (build, rows)
    assert plan["head_dim"] == (128 if build == 90 else 96)
  quantized = dataclasses.replace(config, has_kv_scales=True)
  assert cuda.plan("cuda_sm90", quantized, (2, 16, 32, 128), (2, 4096, 8, 128), jnp.bfloat16,
                   kv_dtype=jnp.int8)["kernel_sm"] == 80
  paged = dataclasses.replace(config, has_block_table=True)
  assert cuda.plan("cuda_sm90", paged, (2, 16, 32, 128), (2, 4096, 8, 128),
                   jnp.bfloat16)["kernel_sm"] == 90
  if tu.has_gpu():
    return  # the GPU suite compiles for its own arch
  for rows, h, paged_build in ((32, 64, False), (64, 128, True), (64, 192, False),
                               (32, 256, True)):
    r = cuda.compile_variant(_ffi.cuda_variant_key(90, h, DTYPE_CODES["bfloat16"],
                                                   DTYPE_CODES["bfloat16"], False, rows,
                                                   paged_build), 90)
    assert r["target"] == "sm_90a" and precompile.spills(r["log"]) == 0, r["log"]


def test_quantized_decode_is_its_own_build(cache):
  """A quantized cache (int8 or float8) is read in place by builds of the
  decode kernel of their own (build 80, H a multiple of 16), which compile
  without spills; build 75, H = 40 and calls with more rows than the decode
  kernel holds plan no quantized build (the caller dequantizes)."""
  if tu.has_gpu():
    pytest.skip("CPU-only check (a GPU machine compiles for its own arch in the GPU suite)")
  config = AttentionConfig(scale=0.1, is_causal=True, end_aligned=True, has_kv_lens=True,
                           has_kv_scales=True)
  q, k = (1, 2, 32, 128), (1, 4096, 8, 128)
  for kv in (jnp.int8, jnp.float8_e4m3fn):
    code = DTYPE_CODES[jnp.dtype(kv).name]
    for implementation, quant in (("cuda_sm90", code), ("cuda_sm80", code), ("cuda_sm75", 0)):
      plan = cuda.plan(implementation, config, q, k, jnp.bfloat16, kv_dtype=kv)
      assert (plan["kv_quant"], cuda.reads_quantized(plan)) == (quant, bool(quant))
    assert cuda.plan("cuda_sm90", config, (1, 2, 32, 40), (1, 4096, 8, 40), jnp.bfloat16,
                     kv_dtype=kv)["kv_quant"] == 0
    assert cuda.plan("cuda_sm90", config, (1, 17, 32, 128), k, jnp.bfloat16,
                     kv_dtype=kv)["kv_quant"] == 0
  plain = dataclasses.replace(config, has_kv_scales=False)
  assert cuda.plan("cuda_sm90", plain, q, k, jnp.bfloat16)["kv_quant"] == 0
  for cc, rows, h, kv, paged in ((90, 1, 128, "int8", False), (90, 64, 256, "int8", True),
                                 (80, 8, 64, "float8_e4m3fn", True), (90, 2, 96, "float8_e4m3fn",
                                                                      False)):
    r = cuda.compile_variant(_ffi.cuda_variant_key(80, h, DTYPE_CODES["bfloat16"],
                                                   DTYPE_CODES["bfloat16"], False, rows, paged,
                                                   DTYPE_CODES[kv]), cc)
    assert r["cubin_bytes"] > 0 and precompile.spills(r["log"]) == 0, r["log"]


@pytest.mark.parametrize("implementation, decode", [
    ("cuda_sm70", False), ("cuda_sm75", False), ("cuda_sm80", True), ("cuda_sm90", True)])
def test_forward_for_backward_takes_a_kernel_the_backward_recomputes(implementation, decode):
  """The VJP's forward (AttentionConfig.for_backward) of a decode-shaped call
  (T * N / K <= 8 rows, no operands): the decode kernel's build 80 sums q . k
  on tensor cores as the backward does, so the sm80 and sm90 paths keep it;
  its build 75 sums on CUDA cores, so the sm70 and sm75 paths take their
  forward kernel, whose logits the backward recomputes bit for bit."""
  config = AttentionConfig(scale=0.1, window=(0, 0), for_backward=True)
  plan = cuda.plan(implementation, config, (2, 4, 2, 64), (2, 4, 1, 64), jnp.float32)
  assert bool(plan["decode_rows"]) == decode
  assert plan["kernel_sm"] == (80 if decode else cuda.IMPLEMENTATIONS[implementation])
  plain = cuda.plan(implementation, dataclasses.replace(config, for_backward=False),
                    (2, 4, 2, 64), (2, 4, 1, 64), jnp.float32)
  assert plain["decode_rows"] == 8


@pytest.mark.parametrize("cc, head_dim, implementation", [
    (70, 64, "cuda_sm70"), (72, 64, "cuda_sm70"), (75, 128, "cuda_sm75"),
    (80, 64, "cuda_sm80"), (86, 128, "cuda_sm80"), (89, None, "cuda_sm80"),
    (90, None, "cuda_sm90"), (90, 40, "cuda_sm90"), (90, 128, "cuda_sm90"),
    (90, 256, "cuda_sm90"), (90, 96, "cuda_sm80"), (90, 160, "cuda_sm80"),
    (100, 128, "cuda_sm80"), (120, 64, "cuda_sm80"),
])
def test_path_choice_by_compute_capability(cc, head_dim, implementation):
  """What implementation=None runs on each GPU generation (no GPU needed):
  sm_90a code runs on 9.0 only, and only for H that pads to a multiple of 64
  no further than to a multiple of 32."""
  assert cuda.default_implementation(cc, head_dim) == implementation
  assert cuda.runs_on(implementation, cc)


def test_sm90_variants_are_the_wgmma_kernel(cache):
  """Kernel 90 compiles for the arch-specific sm_90a target (wgmma exists
  nowhere else) and its head dims are rounded to multiples of 64."""
  assert [k for k in cuda.IMPLEMENTATIONS if cuda.runs_on(k, 90)] == [
      "cuda_sm70", "cuda_sm75", "cuda_sm80", "cuda_sm90"]
  assert not cuda.runs_on("cuda_sm90", 100)
  assert {v["head_dim"] for v in map(_ffi.cuda_variant, cuda.shipped_variants(90))
          if v["kernel_sm"] == 90 and not v["decode_rows"]} == {64, 128, 192, 256}
  r = cuda.compile_variant(_key(90, 128, "bfloat16", "bfloat16"), 90)
  assert r["target"] == "sm_90a", r["target"]


def test_precompile_cli(cache, monkeypatch, capsys):
  monkeypatch.setenv("FASTATTN_CACHE_DIR", str(cache))
  # Kernels 70 and 75, forward and backward, with and without extras, and the
  # decode kernel at 1, 2, 4 and 8 rows.
  assert precompile.main(["--arch", "sm_75", "--head-dims", "64", "--dtypes", "float16"]) == 0
  assert "12 ready (12 compiled" in capsys.readouterr().out
  assert precompile.main(["--arch", "75", "--head-dims", "40", "--dtypes", "float16"]) == 0
  assert "12 ready (0 compiled, 12 already cached)" in capsys.readouterr().out
