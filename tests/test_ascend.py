"""The Ascend kernel on PTO-ISA's CPU simulator (``implementation="ascend_sim"``).

The kernel source that would run on a 910B runs here tile instruction by tile
instruction, with the simulator checking every buffer against the 910B's
capacities, through the package's own XLA custom call. Skipped, with the
reason, where the toolchain is missing (``python -m fastattn_jax.ascend
check``; ``make test`` installs it). ``FASTATTN_TEST_IMPLEMENTATION=ascend_sim``
runs the rest of the suite on this path too (slow).

The NPU path (``"ascend"``) cannot run here: the tests check that it says
what is missing.
"""

import functools
import os
import re
import shutil
import signal
import stat
import struct
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa_testutil as tu
from fastattn_jax import _ffi, ascend, custom_calls, fast_attention
from fastattn_jax.decode import decode_attention
from fastattn_jax.shapes import AttentionConfig

SIM = "ascend_sim"


@pytest.fixture(autouse=True)
def on_the_host():
  """Both Ascend targets are custom calls of JAX's host platform: arrays live
  on the CPU device, also where a GPU is the default one."""
  with jax.default_device(jax.devices("cpu")[0]):
    yield
_MISSING = ascend.unavailable(SIM)
needs_sim = pytest.mark.skipif(_MISSING is not None, reason=f"ascend_sim unavailable: {_MISSING}")

# The grid of every path (fa_testutil.PATH_GRID), plus a few new tokens over a
# cache of two lengths and rows no key reaches (T > S, causal, a window).
CASES = tu.PATH_GRID + [
    dict(B=2, T=3, S=700, N=4, K=2, H=64,
         opts=dict(is_causal=True, key_value_seq_lengths=(700, 333))),
    dict(B=1, T=300, S=40, N=2, K=2, H=20,
         opts=dict(is_causal=True, local_window_size=(5, 0), query_seq_lengths=(250,))),
]


@needs_sim
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{B}T{T}S{S}N{N}K{K}H{H}".format(**c))
def test_ascend_sim_path(rng, dtype, case):
  tu.check_case(rng, case, dtype, SIM)


@needs_sim
@pytest.mark.parametrize("bias_shape, mask_shape", [
    ((1, 3, 1, 77), (2, 1, 33, 1)),   # bias over S only, mask over T only
    ((2, 1, 33, 1), (1, 3, 1, 77)),   # and the other way round
    ((1, 1, 1, 1), (1, 1, 1, 1)),     # scalars
    ((2, 3, 33, 77), (2, 3, 33, 77)),
])
def test_broadcast_bias_and_mask(rng, bias_shape, mask_shape):
  """Bias and mask broadcast over T or S are read as a row, a column or a
  scalar per slice (no T x S copy), each agreeing with the reference."""
  q, k, v = tu.qkv(rng, 2, 33, 77, 3, 1, 64, jnp.bfloat16)
  mask = tu.random_mask(rng, mask_shape, 0.8)
  if mask_shape == (1, 1, 1, 1):
    mask = jnp.ones(mask_shape, bool)
  tu.check_call(q, k, v, tu.random_bias(rng, bias_shape), mask, implementation=SIM,
                is_causal=True)


@needs_sim
@pytest.mark.parametrize("order, sinks", [("sorted", True), ("shuffled", False),
                                          ("scattered", True)])
def test_segment_ids_and_sinks(rng, order, sinks):
  """Segment ids (packed documents; runs whose ids reappear later in the row;
  an id drawn per position) and sinks on the simulator, against the float64
  definition given their dense forms (the mask of equal ids, an extra logit
  with a zero value row), with query lengths and GQA, in bfloat16."""
  B, T, N, K, H = 2, 150, 4, 2, 64
  q, k, v = tu.qkv(rng, B, T, T, N, K, H, jnp.bfloat16)
  ids = tu.random_ids(rng, B, T, 5, order)
  features = dict(segment_ids=ids)
  ref = {}
  if sinks:
    features["sinks"] = rng.normal(0.0, 2.0, N).astype(np.float32)
    ref["sinks"] = features["sinks"][None]
  opts = dict(is_causal=True, query_seq_lengths=jnp.array([150, 97], jnp.int32))
  run = lambda impl, q, k, v: jax.jit(functools.partial(
      fast_attention, return_residual=True, implementation=impl, **opts, **features))(q, k, v)
  out, lse = run(SIM, q, k, v)
  xout, xlse = run("xla", q, k, v)
  mask = ids[:, None, :, None] == ids[:, None, None, :]
  ref_out, ref_lse = tu.reference64(q, k, v, None, mask, **opts, **ref)
  tu.assert_accepted(out, xout, ref_out, tu.OUT_ATOL["bfloat16"], tu.XLA_MAX_ERR["bfloat16"],
                     "output")
  tu.assert_accepted(lse, xlse, ref_lse, tu.LSE_ATOL["bfloat16"],
                     2 * tu.XLA_MAX_ERR["bfloat16"], "LSE")


def test_alibi_is_refused_by_name():
  """The kernel takes no ALiBi: the call says so when it is traced."""
  q = jnp.zeros((1, 16, 2, 32), jnp.bfloat16)
  with pytest.raises(ValueError, match="alibi_slopes"):
    jax.jit(functools.partial(fast_attention, implementation=SIM,
                              alibi_slopes=jnp.ones((2,)))).lower(q, q, q)


@needs_sim
def test_decode_splits_the_keys(rng):
  """One query row over a long cache: too few units for the 20 AI cores, so
  the plan splits the keys (split-KV) and the merge runs; the result still
  passes the acceptance rule."""
  q, k, v = tu.qkv(rng, 2, 1, 2000, 4, 1, 64, jnp.float16)
  lengths = jnp.array([1500, 2000], jnp.int32)
  got = decode_attention(q, k, v, lengths, implementation=SIM).block_until_ready()
  ran = _ffi.recorded_plans()["ascend_sim"]
  want = decode_attention(q, k, v, lengths, implementation="xla")
  assert tu.max_err(got, want) <= tu.JAXNN_TOL["float16"]
  assert ran["splits"] > 1 and ran["Br"] == 16, ran


@needs_sim
def test_outputs_fully_written(rng):
  """Every element of the kernel's (padded) outputs is written: the custom
  call runs as the root of a computation whose donated NaN-filled inputs
  alias its results (as in test_poison.py, checked the same way)."""
  q, k, v = tu.qkv(rng, 2, 37, 150, 4, 2, 40, jnp.bfloat16)
  q_lens = jnp.array([37, 0], jnp.int32)
  operands, p = ascend.kernel_operands(q, k, v, q_lens=q_lens)
  path = ascend.library(SIM, p)
  attrs = custom_calls.rule_attrs(AttentionConfig(scale=1 / np.sqrt(40), is_causal=True))
  out_shape = jax.ShapeDtypeStruct(operands[0].shape, operands[0].dtype)
  lse_shape = jax.ShapeDtypeStruct(operands[0].shape[:3], jnp.float32)

  def run(out0, lse0, *ops):
    del out0, lse0
    return jax.ffi.ffi_call(ascend.TARGETS[SIM], (out_shape, lse_shape))(
        *ops, *custom_calls.feature_operands(None), **attrs, library=path)

  poisoned = (jnp.full(out_shape.shape, jnp.nan, out_shape.dtype),
              jnp.full(lse_shape.shape, jnp.nan, jnp.float32))
  pointers = [x.unsafe_buffer_pointer() for x in poisoned]
  fn = jax.jit(run, donate_argnums=(0, 1), keep_unused=True)
  assert "input_output_alias" in fn.lower(*poisoned, *operands).as_text("hlo")
  out, lse = fn(*poisoned, *operands)
  assert [out.unsafe_buffer_pointer(), lse.unsafe_buffer_pointer()] == pointers
  assert not np.isnan(np.asarray(out, np.float32)).any()
  assert not np.isnan(np.asarray(lse)).any()
  ref_out, ref_lse = tu.reference64(q, k, v, is_causal=True, query_seq_lengths=q_lens)
  T, H = q.shape[1], q.shape[3]
  assert tu.max_err(out[:, :T, :, :H], ref_out) < 2e-2
  np.testing.assert_array_equal(np.isinf(lse[:, :T]), np.isinf(ref_lse))


# --- the simulator library: what it needs to load ------------------------------

@needs_sim
def test_kernel_library_resolves_every_symbol():
  """The bfloat16 kernel (whose float -> bfloat16 conversions clang lowers to
  compiler-rt's __truncsfbf2 on the baseline CPU) leaves no symbol undefined
  that its own dependencies (the C library) do not define: ``ldd -r``
  resolves them as the loader does, without this process's libraries."""
  if shutil.which("ldd") is None:
    pytest.skip("no ldd (glibc's) to resolve the library's symbols")
  path = ascend.library(SIM, ascend.plan((2, 37, 4, 40), (2, 150, 2, 40), jnp.bfloat16))
  done = subprocess.run(["ldd", "-r", path], capture_output=True, text=True)
  assert done.returncode == 0 and "undefined symbol" not in done.stdout + done.stderr, (
      done.stdout + done.stderr)


@needs_sim
def test_build_refuses_a_library_with_an_undefined_symbol(tmp_path):
  """A library the toolchain links with a symbol nothing it loads defines
  raises, naming the symbol and the compiler, and does not enter the cache."""
  folder = tmp_path / "ascend"
  source = 'extern "C" void fastattn_absent();\nextern "C" void f() { fastattn_absent(); }\n'
  compiler = ascend.sim_compiler()
  with pytest.raises(RuntimeError, match=re.escape(" ".join(compiler)) +
                     r" linked a library that does not load.*undefined symbol: fastattn_absent"):
    ascend._compile(compiler, ["-shared", "-fPIC"], {"ascend/attention_ascend.cpp": source},
                    str(folder / "lib.so"))
  assert not folder.exists() or os.listdir(folder) == []


@needs_sim
def test_a_cached_library_that_does_not_load_is_built_again(tmp_path, monkeypatch, caplog):
  """A whole cache entry (its checksum right) whose library does not load
  (here not even an ELF file) is built again in its place, not handed to
  the FFI handler."""
  monkeypatch.setenv("FASTATTN_CACHE_DIR", str(tmp_path))
  monkeypatch.setattr(ascend, "_built", {})
  p = ascend.plan((1, 16, 2, 32), (1, 16, 2, 32), jnp.float16)
  entry = ascend.cache_entry(SIM, p)
  os.makedirs(os.path.dirname(entry))
  with open(entry, "wb") as f:
    f.write(ascend._seal(b"not an ELF file"))
  assert ascend._damage(entry) is None
  assert ascend.library(SIM, p) == entry
  assert "the cached one does not load" in caplog.text
  assert ascend._damage(entry) is None and ascend._load_error(entry) is None


# --- the kernel cache: damaged entries, unwritable folders ---------------------

# Runs a call on the simulator (the kernel cache as the environment says)
# and prints the largest difference from XLA's result: in a process of its
# own, so that a library mapped past its end (SIGBUS) ends that process, not
# pytest's.
_RUN_FROM_CACHE = """import jax, jax.numpy as jnp
jax.config.update("jax_platforms", "cpu")
from fastattn_jax import fast_attention
q, k, v = (jax.random.normal(jax.random.key(i), (1, 16, 2, 32), jnp.float16) for i in range(3))
got = fast_attention(q, k, v, implementation="ascend_sim")
want = fast_attention(q, k, v, implementation="xla")
print(float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)))))
"""


def _loaded_bytes(elf: bytes) -> int:
  """How many leading bytes of a 64-bit little-endian ELF file its loadable
  segments map (what follows, debug sections, is never mapped)."""
  phoff, = struct.unpack_from("<Q", elf, 0x20)
  phentsize, phnum = struct.unpack_from("<HH", elf, 0x36)
  end = 0
  for i in range(phnum):
    p_type, _, p_offset, _, _, p_filesz = struct.unpack_from("<IIQQQQ", elf, phoff + i * phentsize)
    if p_type == 1:  # PT_LOAD
      end = max(end, p_offset + p_filesz)
  return end


def _good_library():
  """A whole library of the ``_RUN_FROM_CACHE`` call's tile, from the user's
  kernel cache (built there once): its path."""
  return ascend.library(SIM, ascend.plan((1, 16, 2, 32), (1, 16, 2, 32), jnp.float16))


@needs_sim
@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_a_damaged_cached_library_is_built_again(tmp_path, damage):
  """A cache entry cut short (a partial copy, a full disk, an interrupted
  sync) inside what the loader maps, which it would map past its end, or
  with one byte of its code changed, is detected before it is loaded and
  built again: the call's results are right and the entry is whole after
  it. In a process of its own: a regression dies of SIGBUS there, failing
  this test, not the suite."""
  good = _good_library()
  entry = tmp_path / "ascend" / os.path.basename(good)
  entry.parent.mkdir()
  data = bytearray(open(good, "rb").read())
  cut = _loaded_bytes(data) // 2
  if damage == "truncated":
    data = data[:cut]
  else:
    data[cut] ^= 0xFF
  entry.write_bytes(bytes(data))
  env = tu.fresh_process_env(FASTATTN_CACHE_DIR=str(tmp_path), FASTATTN_PTO_ISA=ascend.pto_include())
  done = subprocess.run([sys.executable, "-c", _RUN_FROM_CACHE], capture_output=True, text=True,
                        env=env, timeout=600)
  assert done.returncode == 0, (
      f"the call ended with status {done.returncode}"
      f"{' (' + signal.Signals(-done.returncode).name + ')' if done.returncode < 0 else ''}:\n"
      f"{done.stderr[-3000:]}")
  assert float(done.stdout.split()[-1]) <= tu.JAXNN_TOL["float16"]
  assert "the cached one is damaged" in done.stderr
  assert ascend._damage(str(entry)) is None
  assert open(entry, "rb").read() != bytes(data)


@pytest.fixture
def reuse_build(monkeypatch):
  """``ascend._build`` that hands back the user's cached library of the
  ``_RUN_FROM_CACHE`` tile instead of compiling it (seconds); records its calls."""
  path = _good_library()
  assert ascend._damage(path) is None
  good = open(path, "rb").read()
  calls = []

  def build(compiler, flags, sources):
    calls.append(flags)
    return good

  monkeypatch.setattr(ascend, "_build", build)
  monkeypatch.setattr(ascend, "_built", {})
  monkeypatch.setattr(ascend, "_warned", set())
  monkeypatch.setenv("FASTATTN_PTO_ISA", ascend.pto_include())
  return calls


def _check_runs(path):
  """The library at ``path`` runs the ``_RUN_FROM_CACHE`` call right."""
  q, k, v = (jax.random.normal(jax.random.key(i), (1, 16, 2, 32), jnp.float16) for i in range(3))
  operands, p = ascend.kernel_operands(q, k, v)
  attrs = custom_calls.rule_attrs(AttentionConfig(scale=1 / np.sqrt(32)))
  out, _ = jax.ffi.ffi_call(ascend.TARGETS[SIM], (
      jax.ShapeDtypeStruct(operands[0].shape, operands[0].dtype),
      jax.ShapeDtypeStruct((1, p["Tp"], 2), jnp.float32)))(
          *operands, *custom_calls.feature_operands(None), **attrs, library=path)
  want = fast_attention(q, k, v, implementation="xla")
  assert tu.max_err(out[:, :16, :, :32], want) <= tu.JAXNN_TOL["float16"]


@needs_sim
@pytest.mark.parametrize("thing", ["directory", "fifo"])
def test_something_else_at_the_entry_path_is_replaced(tmp_path, monkeypatch, reuse_build,
                                                      caplog, thing):
  """A directory (or a FIFO: reading it must not block) where the cache
  entry belongs is a damaged entry: the library is built and written in
  its place."""
  monkeypatch.setenv("FASTATTN_CACHE_DIR", str(tmp_path))
  p = ascend.plan((1, 16, 2, 32), (1, 16, 2, 32), jnp.float16)
  entry = ascend.cache_entry(SIM, p)
  os.makedirs(os.path.dirname(entry))
  if thing == "directory":
    os.makedirs(os.path.join(entry, "inside"))
  else:
    os.mkfifo(entry)
  assert ascend.library(SIM, p) == entry
  assert len(reuse_build) == 1 and "not a regular file" in caplog.text
  assert stat.S_ISREG(os.lstat(entry).st_mode) and ascend._damage(entry) is None
  _check_runs(entry)


@needs_sim
@pytest.mark.parametrize("how", ["under_a_file", "read_only"])
def test_an_unwritable_cache_folder_warns_once_and_builds_privately(tmp_path, monkeypatch,
                                                                    reuse_build, how):
  """With a kernel cache folder that cannot be created (a path under a
  file) or written (read-only), the library is built in a temporary folder
  of the process, with one warning naming the folder and why."""
  if how == "under_a_file":
    (tmp_path / "file").write_text("")
    root = tmp_path / "file" / "cache"
  else:
    root = tmp_path / "cache"
    root.mkdir()
    root.chmod(0o500)
    if os.access(root, os.W_OK):
      pytest.skip("chmod does not stop this user writing (root)")
  monkeypatch.setenv("FASTATTN_CACHE_DIR", str(root))
  p = ascend.plan((1, 16, 2, 32), (1, 16, 2, 32), jnp.float16)
  try:
    with pytest.warns(RuntimeWarning, match=re.escape(f"kernel cache folder {root}")) as caught:
      path = ascend.library(SIM, p)
      monkeypatch.setattr(ascend, "_built", {})
      assert ascend.library(SIM, p) == path  # the second time, no warning
  finally:
    root.chmod(0o700) if root.exists() else None
  assert len([w for w in caught if "kernel cache folder" in str(w.message)]) == 1
  assert path.startswith(ascend._private_dir()) and not path.startswith(str(root))
  assert len(reuse_build) == 2
  _check_runs(path)


# --- the plan: tiles against the 910B's buffers -------------------------------

@pytest.mark.parametrize("H, tile", [(64, (128, 128, 32, 64)), (128, (128, 128, 32, 128)),
                                     (256, (64, 64, 32, 256)), (20, (128, 128, 32, 32))])
def test_plan_fits_the_910b(H, tile):
  p = ascend.plan((2, 1000, 8, H), (2, 1000, 2, H), jnp.bfloat16)
  assert (p["Br"], p["Bc"], p["Bb"], p["Hp"]) == tile
  for buffer, capacity in ascend.CAPACITIES.items():
    assert 0 < p[f"{buffer.lower()}_bytes"] <= capacity, (buffer, p)
  assert p["Tp"] == 1024 and p["Sp"] == 1024 and p["splits"] == 1


def test_plan_shrinks_br_for_short_queries():
  assert ascend.plan((1, 1, 8, 128), (1, 4096, 1, 128), jnp.float16)["Br"] == 16
  assert ascend.plan((1, 40, 8, 128), (1, 4096, 1, 128), jnp.float16)["Br"] == 48


@pytest.mark.parametrize("tile, buffer", [((256, 128, 32, 128), "L0A"),
                                          ((64, 256, 32, 128), "L0B"),
                                          ((128, 128, 128, 128), "UB")])
def test_tile_past_a_buffer_is_rejected(tile, buffer):
  with pytest.raises(ValueError, match=rf"needs \d+ bytes of the 910B's {buffer}, which holds"):
    ascend.plan((1, 512, 2, 128), (1, 512, 2, 128), jnp.float16, tile=tile)


def test_plan_refuses_what_the_kernel_cannot_do():
  with pytest.raises(ValueError, match="H=288"):
    ascend.plan((1, 8, 2, 288), (1, 8, 2, 288), jnp.float16)
  with pytest.raises(ValueError, match="not a 910B Cube tile"):
    ascend.plan((1, 8, 2, 64), (1, 8, 2, 64), jnp.float16, tile=(120, 128, 40, 64))


# --- the FFI handler's checks -------------------------------------------------

def _target_call(q, k, v, bias, mask, q_lens, kv_lens, out_dtype=None):
  B, T, N, _ = q.shape
  return jax.ffi.ffi_call(ascend.TARGETS[SIM], (
      jax.ShapeDtypeStruct(q.shape, out_dtype or q.dtype),
      jax.ShapeDtypeStruct((B, T, N), jnp.float32)))(
          q, k, v, bias, mask, q_lens, kv_lens, *custom_calls.feature_operands(None),
          scale=np.float32(1), softcap=np.float32(0),
          is_causal=np.int64(0), end_aligned=np.int64(0), window_left=np.int64(-1),
          window_right=np.int64(-1), library="/nonexistent.so")


@pytest.mark.parametrize("change, message", [
    (dict(q=jnp.zeros((1, 20, 2, 64), jnp.float16)), "not padded to whole tiles"),
    (dict(q=jnp.zeros((1, 32, 2, 64), jnp.float32), k=jnp.zeros((1, 128, 2, 64), jnp.float32),
          v=jnp.zeros((1, 128, 2, 64), jnp.float32)), "F16, BF16"),
    (dict(k=jnp.zeros((1, 128, 3, 64), jnp.float16),
          v=jnp.zeros((1, 128, 3, 64), jnp.float16)), "do not fit"),
    (dict(q_lens=jnp.zeros((2,), jnp.int32)), r"shape \(B,\)"),
    (dict(bias=jnp.zeros((1, 2, 5, 128), jnp.float32)), "does not broadcast"),
    (dict(), "cannot load the simulated Ascend kernel /nonexistent.so"),
])
def test_handler_checks_its_operands(change, message):
  ops = dict(q=jnp.zeros((1, 32, 2, 64), jnp.float16), k=jnp.zeros((1, 128, 2, 64), jnp.float16),
             v=jnp.zeros((1, 128, 2, 64), jnp.float16), bias=jnp.zeros((0,), jnp.float32),
             mask=jnp.zeros((0,), jnp.bool_), q_lens=jnp.ones((1,), jnp.int32),
             kv_lens=jnp.ones((1,), jnp.int32))
  ops.update(change)
  with pytest.raises(Exception, match=message):
    jax.block_until_ready(jax.jit(_target_call)(**ops))


# --- the NPU path ---------------------------------------------------------------

def test_npu_path_names_what_is_missing(rng):
  why = ascend.unavailable("ascend")
  if why is None:
    pytest.skip("CANN and an NPU are present: the NPU path runs (not this test's subject)")
  assert "CANN" in why or "PTO-ISA" in why or "libascendcl" in why, why
  q, k, v = tu.qkv(rng, 1, 8, 8, 2, 2, 64, jnp.float16)
  with pytest.raises(ascend.Unavailable, match="implementation='ascend' needs|PTO-ISA"):
    jax.jit(lambda q, k, v: fast_attention(q, k, v, implementation="ascend")).lower(q, k, v)


def test_check_command_reports_each_path(capsys):
  from fastattn_jax.ascend import __main__ as cli
  assert cli.main(["check"]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert [line.split(":")[0] for line in lines] == list(ascend.IMPLEMENTATIONS)
