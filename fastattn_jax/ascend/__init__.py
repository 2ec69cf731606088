"""The Ascend kernel from Python: its plan, its build at first use, the custom calls.

One PTO-ISA source (``csrc/kernels/ascend/attention_ascend.cpp``, embedded in
the extension) serves two paths, both XLA custom calls on JAX's host platform
(JAX has no Ascend backend):

* ``"ascend_sim"``: the kernel built by clang for PTO-ISA's CPU simulator,
  which executes the Cube and Vector tile instructions functionally and
  checks every buffer against the Ascend 910B's capacities. It runs anywhere
  the toolchain is: clang >= 19 (the ``ziglang`` package ships one) and the
  PTO-ISA headers (``python -m fastattn_jax.ascend fetch`` takes them from the
  ``tilelang-ascend`` wheel on PyPI into the kernel cache; their licence, the
  CANN Open Software License, keeps them out of this package).
* ``"ascend"``: the kernel built by CANN's ``bisheng`` and run on NPU 0
  through the ACL runtime (operands copied to the device and back). Written
  to CANN's documentation; never run (no NPU or CANN was reachable).

Which tile serves a call, the padded shapes, the split-KV count and the
workspace come from one owner, ``csrc/ascend/ascend_plan.h``, asked through
the extension (``plan``). Builds are kept in the kernel cache
(``FASTATTN_CACHE_DIR``, shared with the CUDA kernels) under a key of the
sources, the compiler and its flags, written atomically once a process of
their own has loaded them (every symbol resolved), with their length and
SHA-256 at their end; a cached one that is damaged (cut short, not a regular
file) or does not load is built again. Where the cache folder cannot be
written, a warning says so, once, and the libraries are built in a temporary
folder of the process.

Environment:
  FASTATTN_PTO_ISA  the PTO-ISA ``include`` folder (default: the one
                    ``python -m fastattn_jax.ascend fetch`` put in the cache).
  ASCEND_HOME_PATH  CANN's install folder (set by its ``set_env.sh``), for
                    ``bisheng``.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import warnings
import zipfile

import jax
import jax.numpy as jnp

from fastattn_jax import _ffi, _util, cuda
from fastattn_jax.custom_calls import kernel_call
from fastattn_jax.shapes import DTYPE_CODES, AttentionConfig

logger = logging.getLogger("fastattn_jax")

#: The FFI targets, by implementation name.
TARGETS = {"ascend_sim": "fastattn_attention_ascend_sim", "ascend": "fastattn_attention_ascend"}
IMPLEMENTATIONS = tuple(TARGETS)

_LIMITS = _ffi.ascend_limits()
#: Largest head dim of the Ascend kernel.
MAX_HEAD_DIM = _LIMITS["max_head_dim"]
#: The 910B's buffer capacities in bytes, by buffer.
CAPACITIES = {name: _LIMITS[f"{name.lower()}_bytes"] for name in ("UB", "L1", "L0A", "L0B", "L0C")}

#: The registry package that ships the PTO-ISA headers, and their folder in it.
PTO_WHEEL = "tilelang-ascend==0.1.4"
_PTO_IN_WHEEL = "tilelang/3rdparty/pto-isa/include/"
#: The oldest clang that builds PTO-ISA's simulator (C++23).
_MIN_CLANG = 19


class Unavailable(RuntimeError):
  """A path's toolchain or device is missing; the message names it and how to get it."""


def operand_dtype(dtype) -> jnp.dtype:
  """The dtype the kernel multiplies ``dtype`` inputs in: float16 and
  bfloat16 as they are, float32 rounded to float16 (the Cube takes 16-bit
  operands; accumulation is float32 either way)."""
  return jnp.dtype(jnp.bfloat16 if jnp.dtype(dtype) == jnp.bfloat16 else jnp.float16)


def plan(q_shape, k_shape, dtype, tile: tuple[int, int, int, int] | None = None) -> dict:
  """How the Ascend kernel serves q (B, T, N, H) against k, v (B, S, K, H) in
  ``dtype``: tile (Br, Bc, Bb, Hp), padded Tp and Sp, split-KV ways, AI
  cores, workspace floats, and each buffer's offset and total in bytes
  (``l1_bytes``, ``ub_bytes``, ...). ``tile`` replaces the chosen tile
  (to study others: the notebook, the capacity tests).

  Raises:
    ValueError: the kernel cannot serve the call: H above 256, N not a
      multiple of K, or a tile that passes one of the 910B's buffers (the
      message names the buffer, the bytes needed and its capacity).
  """
  B, T, N, H = q_shape
  S, K = k_shape[1], k_shape[2]
  code = DTYPE_CODES[operand_dtype(dtype).name]
  return _ffi.ascend_plan(B, T, S, N, K, H, code, None if tile is None else list(tile))


# --- toolchains ------------------------------------------------------------------

def pto_include() -> str:
  """The PTO-ISA include folder (``FASTATTN_PTO_ISA``, else the fetched one).

  Raises:
    Unavailable: neither exists.
  """
  path = os.environ.get("FASTATTN_PTO_ISA") or _fetched_pto()
  if not os.path.isfile(os.path.join(path, "pto", "pto-inst.hpp")):
    raise Unavailable(
        f"the PTO-ISA headers are missing (looked in {path}): run `python -m "
        f"fastattn_jax.ascend fetch` (downloads {PTO_WHEEL} from PyPI) or set "
        f"FASTATTN_PTO_ISA to a pto-isa/include folder")
  return path


def _fetched_pto() -> str:
  return os.path.join(cuda.cache_dir() or tempfile.gettempdir(), "pto-isa",
                      PTO_WHEEL.replace("==", "-"), "include")


def fetch_pto() -> str:
  """Downloads the PTO-ISA headers from PyPI (the ``tilelang-ascend`` wheel,
  any platform's: the headers are the same) into the kernel cache; returns
  the include folder. Needs pip and the network once."""
  dest = _fetched_pto()
  if os.path.isfile(os.path.join(dest, "pto", "pto-inst.hpp")):
    return dest
  parent = os.path.dirname(dest)
  try:
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(dir=parent)  # same file system: atomic rename
  except OSError as err:
    raise RuntimeError(
        f"cannot write the PTO-ISA headers into {parent} ({err.strerror or err}): set "
        f"FASTATTN_CACHE_DIR to a writable folder, or FASTATTN_PTO_ISA to a pto-isa/include "
        f"folder") from err
  try:
    with tempfile.TemporaryDirectory() as tmp:
      subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                      "--only-binary=:all:", "--python-version", "3.11", "--platform",
                      "manylinux2014_aarch64", PTO_WHEEL, "-d", tmp], check=True)
      wheel = next(os.path.join(tmp, f) for f in os.listdir(tmp) if f.endswith(".whl"))
      with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
          if name.startswith(_PTO_IN_WHEEL) and not name.endswith("/"):
            z.extract(name, staging)
      os.replace(os.path.join(staging, _PTO_IN_WHEEL), dest)
  finally:
    shutil.rmtree(staging, ignore_errors=True)
  return dest


def sim_compiler() -> list[str]:
  """The command of a clang >= 19 C++ compiler for the baseline CPU of this
  machine's architecture: the ``ziglang`` package's, else ``clang++-19`` or
  newer, or ``clang++``, on PATH.

  Raises:
    Unavailable: none found.
  """
  try:
    import ziglang  # noqa: F401  (the package ships clang as `zig c++`)
    # zig compiles for the CPU it runs on unless told otherwise (clang does
    # not): then a library in a shared cache could use instructions another
    # host lacks, and which runtime functions it calls (the float -> bfloat16
    # conversion's, sim/stdfloat) would depend on the machine that built it.
    return [sys.executable, "-m", "ziglang", "c++", "-mcpu=baseline"]
  except ImportError:
    pass
  for name in [f"clang++-{v}" for v in range(30, _MIN_CLANG - 1, -1)] + ["clang++"]:
    path = shutil.which(name)
    if path and _clang_major(path) >= _MIN_CLANG:
      return [path]
  raise Unavailable(
      f"implementation='ascend_sim' needs clang >= {_MIN_CLANG} to build PTO-ISA's CPU "
      f"simulator: `pip install ziglang` (or install clang-{_MIN_CLANG})")


def _clang_major(path: str) -> int:
  out = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
  words = out.split("version ", 1)[-1].split(".", 1)[0]
  return int(words) if words.isdigit() else 0


def bisheng() -> list[str]:
  """CANN's ``bisheng`` compiler, from ``ASCEND_HOME_PATH`` or PATH.

  Raises:
    Unavailable: CANN is not installed (or its set_env.sh not sourced).
  """
  home = os.environ.get("ASCEND_HOME_PATH", "")
  for path in (os.path.join(home, "compiler", "ccec_compiler", "bin", "bisheng") if home else "",
               shutil.which("bisheng") or ""):
    if path and os.access(path, os.X_OK):
      return [path]
  raise Unavailable(
      "implementation='ascend' needs CANN: no `bisheng` compiler (install the CANN toolkit "
      "and source its set_env.sh; or use implementation='ascend_sim')")


def unavailable(implementation: str) -> str | None:
  """Why ``implementation`` cannot run on this machine, or None if it can."""
  try:
    _toolchain(implementation)
    if implementation == "ascend":
      ctypes.CDLL("libascendcl.so")
  except (Unavailable, OSError) as err:
    return str(err)
  return None


@functools.cache
def _toolchain(implementation: str) -> tuple[list[str], list[str], str]:
  """(compiler command, flags, the compiler's ``--version``) that build
  ``implementation``'s library; looked up once per process (a miss raises,
  and is looked up again next time)."""
  include = pto_include()
  if implementation == "ascend_sim":
    # {sources}: where the embedded sources are written (``_compile``);
    # their sim/ folder holds <stdfloat> for a C++ library without one.
    compiler = sim_compiler()
    flags = ["-std=c++23", "-O2", "-shared", "-fPIC", "-D__CPU_SIM", "-D__STDCPP_BFLOAT16_T__=1",
             "-isystem", "{sources}/ascend/sim", "-include", "stdint.h", "-include",
             "stddef.h", f"-I{include}"]
  else:
    # A mixed Cube + Vector kernel for A2/A3 (dav-c220), as a shared library
    # whose host function fa_ascend_launch launches it (csrc/ascend/acl_runtime.h).
    compiler = bisheng()
    flags = ["-xcce", "--cce-aicore-arch=dav-c220", "-O2", "-std=c++17", "-fPIC", "-shared",
             f"-I{include}"]
  version = subprocess.run([*compiler, "--version"], capture_output=True, text=True).stdout
  return compiler, flags, version


@functools.cache
def _sources() -> tuple[dict, str]:
  """The embedded kernel sources and their digest."""
  sources = _ffi.ascend_sources()
  return sources, _util.sources_digest(sources)


# --- building --------------------------------------------------------------------
#
# A cache entry is the library followed by a trailer: a magic string, the
# library's length (8 bytes, little-endian) and its SHA-256. The entry is
# verified before anything maps it (a file cut short, by a partial copy, a
# full disk or an interrupted sync, would otherwise be mapped past its end
# and kill the process with SIGBUS on first use); a damaged one, or anything
# but a regular file at the entry's path, is built again. The loader ignores
# bytes past the last segment, so the entry loads as it is.

_MAGIC = b"fastattn_jax ascend library v1\0\0"  # 32 bytes
_TRAILER = len(_MAGIC) + 8 + 32
#: Larger cache entries are taken for damaged rather than read.
_MAX_ENTRY_BYTES = 1 << 30

_built: dict[str, str] = {}  # key -> library path, this process
_handles: dict[str, ctypes.CDLL] = {}  # library path -> the loaded library, this process
_warned: set[str] = set()  # cache folders already warned about, this process
_lock = threading.Lock()


def library(implementation: str, plan_: dict) -> str:
  """The path of ``implementation``'s kernel library for ``plan_``'s tile,
  built at first use (seconds), kept in the kernel cache and loaded in this
  process (so what runs the kernel later is the library checked here,
  whatever becomes of the file).

  A cached library is used only whole (its checksum verified) and loadable;
  otherwise it is built again, in its place. Where the cache folder cannot
  be written (read-only, missing, full), a warning names it and why, once
  per folder, and the library is built in a temporary folder of this
  process instead.

  Raises:
    Unavailable: the toolchain is missing.
    RuntimeError: the compiler failed (its output in the message), or the
      library it linked does not load in a process of its own (an undefined
      symbol: the message names it); such a library is not cached. Or
      neither the cache nor the temporary folder can be written.
  """
  compiler, flags, _ = _toolchain(implementation)
  tile = _tile_flags(plan_)
  digest = _digest(implementation, plan_)
  name = f"{implementation}-{digest}.so"
  with _lock:
    if digest in _built:
      return _built[digest]
    root = cuda.cache_dir()
    entry = os.path.join(root, "ascend", name) if root else None
    if entry:
      why = _damage(entry) or _load_here(entry)
      if why is None:
        _built[digest] = entry
        return entry
      if why != "missing":
        logger.warning("fastattn_jax: building %s again: the cached one %s", entry, why)
    data = _build(compiler, flags + tile, _sources()[0])
    path = None
    if entry:
      try:
        _write(data, entry)
        path = entry
      except OSError as err:
        _warn_unwritable(os.path.dirname(entry), err)
    if path is None:
      path = os.path.join(_private_dir(), name)
      try:
        _write(data, path)
      except OSError as err:
        raise RuntimeError(f"cannot write the Ascend kernel library {path}: "
                           f"{err.strerror or err}") from err
    if why := _load_here(path):
      raise RuntimeError(f"the Ascend kernel library {path}, just built, {why}")
    _built[digest] = path
    return path


def cache_entry(implementation: str, plan_: dict) -> str | None:
  """Where the kernel cache keeps ``implementation``'s library for
  ``plan_``'s tile (None: the disk cache is off); it may not exist yet."""
  root = cuda.cache_dir()
  if not root:
    return None
  return os.path.join(root, "ascend", f"{implementation}-{_digest(implementation, plan_)}.so")


def _tile_flags(plan_: dict) -> list[str]:
  return [f"-DFA_BR={plan_['Br']}", f"-DFA_BC={plan_['Bc']}", f"-DFA_BB={plan_['Bb']}",
          f"-DFA_HP={plan_['Hp']}", f"-DFA_DTYPE={plan_['dtype']}"]


def _digest(implementation: str, plan_: dict) -> str:
  """The cache key of a build: the sources, the compiler, its flags, the
  tile, and the entry format (entries of an older one are not looked up)."""
  compiler, flags, version = _toolchain(implementation)
  return hashlib.sha256(repr((_sources()[1], compiler[-1], version, flags, _tile_flags(plan_),
                              _MAGIC)).encode()).hexdigest()[:24]


def _compile(compiler, flags, sources, path):
  """Builds the library of ``sources`` into ``path`` (a cache entry: see
  ``_build``; written atomically)."""
  _write(_build(compiler, flags, sources), path)


def _build(compiler, flags, sources) -> bytes:
  """The library ``compiler`` builds from ``sources`` with ``flags``, as a
  cache entry (the library and its trailer), once a process of its own has
  loaded it. Built in a temporary folder: nothing is written elsewhere.

  Raises:
    RuntimeError: the compiler failed, or its library does not load.
  """
  with tempfile.TemporaryDirectory(prefix="fastattn_ascend_build_") as tmp:
    for name, text in sources.items():
      os.makedirs(os.path.dirname(os.path.join(tmp, name)), exist_ok=True)
      with open(os.path.join(tmp, name), "w") as f:
        f.write(text)
    out = os.path.join(tmp, "library.so")
    cmd = [*compiler, *(f.format(sources=tmp) for f in flags), f"-I{tmp}",
           os.path.join(tmp, "ascend", "attention_ascend.cpp"), "-o", out]
    logger.info("fastattn_jax: building the Ascend kernel: %s", " ".join(cmd))
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
      raise RuntimeError(f"building the Ascend kernel failed ({' '.join(cmd)}):\n"
                         f"{done.stderr[-4000:]}")
    if why := _load_error(out):
      raise RuntimeError(f"building the Ascend kernel: {' '.join(compiler)} linked a "
                         f"library that does not load, so it is not cached: {why}")
    with open(out, "rb") as f:
      return _seal(f.read())


def _seal(library_bytes: bytes) -> bytes:
  """``library_bytes`` as a cache entry: followed by the trailer."""
  return (library_bytes + _MAGIC + len(library_bytes).to_bytes(8, "little") +
          hashlib.sha256(library_bytes).digest())


def _damage(path: str) -> str | None:
  """What is wrong with the cache entry at ``path`` ("missing", or "is
  damaged: " and why: not a regular file, cut short...), or None if it is
  whole. Reads it without
  mapping it, and without blocking on a FIFO."""
  try:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
  except (FileNotFoundError, NotADirectoryError):  # no file, or no folder (a file in the way)
    return "missing"
  except OSError as err:  # a loop of links, no permission...
    return f"is damaged: it cannot be read ({err.strerror or err})"
  try:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
      return "is damaged: not a regular file"
    if st.st_size < _TRAILER:
      return f"is damaged: cut short ({st.st_size} bytes)"
    if st.st_size > _MAX_ENTRY_BYTES:
      return f"is damaged: {st.st_size} bytes, more than a library"
    with os.fdopen(os.dup(fd), "rb") as f:
      f.seek(st.st_size - _TRAILER)
      trailer = f.read(_TRAILER)
      if len(trailer) != _TRAILER or not trailer.startswith(_MAGIC):
        return "is damaged: cut short (no checksum at its end)"
      size = int.from_bytes(trailer[len(_MAGIC):len(_MAGIC) + 8], "little")
      if size != st.st_size - _TRAILER:
        return f"is damaged: cut short ({st.st_size - _TRAILER} of {size} bytes)"
      f.seek(0)
      h = hashlib.sha256()
      left = size
      while left:
        chunk = f.read(min(left, 1 << 20))
        if not chunk:
          return f"is damaged: cut short while read ({size - left} of {size} bytes)"
        h.update(chunk)
        left -= len(chunk)
      if h.digest() != trailer[-32:]:
        return "is damaged: its checksum does not match"
  except OSError as err:
    return f"is damaged: it cannot be read ({err.strerror or err})"
  finally:
    os.close(fd)
  return None


def _write(data: bytes, path: str) -> None:
  """Writes ``data`` to ``path`` atomically: to a temporary file beside it,
  synced, then renamed over it (readers see the old file, the new one or
  none, never a partial one); a directory in the way is removed first.

  Raises:
    OSError: the folder cannot be created or written (the message names it).
  """
  folder = os.path.dirname(path)
  os.makedirs(folder, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.chmod(tmp, 0o644)
    if os.path.isdir(path) and not os.path.islink(path):
      shutil.rmtree(path)
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.remove(tmp)
    raise


def _warn_unwritable(folder: str, err: OSError) -> None:
  """Warns, once per folder, that the kernel cache cannot be written."""
  if folder in _warned:
    return
  _warned.add(folder)
  warnings.warn(
      f"fastattn_jax: cannot write the kernel cache folder {folder} "
      f"({err.strerror or err}{': ' + str(err.filename) if err.filename else ''}); "
      f"building the Ascend kernel in {_private_dir()} instead, for this process only "
      f"(set FASTATTN_CACHE_DIR to a writable folder to keep it)", RuntimeWarning, stacklevel=3)


@functools.cache
def _private_dir() -> str:
  """A temporary folder of this process, removed at its exit: the libraries
  built when the kernel cache is off or cannot be written."""
  path = tempfile.mkdtemp(prefix="fastattn_ascend_")
  atexit.register(shutil.rmtree, path, ignore_errors=True)
  return path


# Loads a library as the FFI handlers do (dlopen with RTLD_NOW), in an
# interpreter of its own: only the library's dependencies and a bare Python
# resolve its symbols, not whatever this process happens to have loaded.
_LOAD = """import ctypes, os, sys
try:
  ctypes.CDLL(sys.argv[1], os.RTLD_NOW)
except OSError as err:
  sys.exit(str(err))
"""


def _load_error(path: str) -> str | None:
  """Why a fresh Python process cannot load the library at ``path`` (the
  loader's message, e.g. ``undefined symbol: __truncsfbf2``), or None if it
  can."""
  done = subprocess.run([sys.executable, "-I", "-S", "-c", _LOAD, path], capture_output=True,
                        text=True)
  if done.returncode == 0:
    return None
  return done.stderr.strip() or f"the loading process ended with status {done.returncode}"


def _load_here(path: str) -> str | None:
  """Loads the library at ``path`` (whole: see ``_damage``) into this
  process, as the FFI handler will load it, and keeps it loaded: the
  handler's dlopen of the same path then finds it loaded and reads nothing
  more from the disk. Returns why it does not load, or None."""
  if path in _handles:
    return None
  try:
    _handles[path] = ctypes.CDLL(path, os.RTLD_NOW)
  except OSError as err:
    return f"does not load ({err})"
  return None


# --- the custom call -------------------------------------------------------------

def call(implementation: str, config: AttentionConfig, q, k, v, bias=None, mask=None,
         q_lens=None, kv_lens=None, *, features=None):
  """Runs the Ascend kernel of ``implementation``; returns (out, lse) of
  shapes (B, T, N, H) in q's dtype and (B, T, N) float32.

  The operands go to the kernel as ``kernel_operands`` prepares them (a
  bias or mask broadcast over T or S stays so: no T x S array).

  Raises:
    Unavailable: the toolchain (or, for "ascend", CANN or an NPU) is missing.
    ValueError: the plan refuses the call (``plan``), or ``features`` hold
      ALiBi slopes, which the Ascend kernel does not take (segment ids and
      sinks it does).
  """
  if features is not None and features.alibi_slopes is not None:
    raise ValueError(f"implementation={implementation!r} does not take alibi_slopes; use "
                     "implementation=None or 'cpu'")
  B, T, N, H = q.shape
  operands, p = kernel_operands(q, k, v, bias, mask, q_lens, kv_lens)
  if features is not None and features.q_segment_ids is not None:
    # Ids of the padded rows and keys: each side's last (padding stays sorted).
    edge = lambda ids, n: jnp.pad(ids, ((0, 0), (0, n - ids.shape[1])), mode="edge")
    features = features._replace(q_segment_ids=edge(features.q_segment_ids, p["Tp"]),
                                 kv_segment_ids=edge(features.kv_segment_ids, p["Sp"]))
  path = library(implementation, p)
  if implementation == "ascend" and (why := unavailable("ascend")):
    raise Unavailable(why)
  out, lse = kernel_call(TARGETS[implementation], (
      jax.ShapeDtypeStruct(operands[0].shape, operands[0].dtype),
      jax.ShapeDtypeStruct((B, p["Tp"], N), jnp.float32)), config, *operands, library=path,
      features=features)
  return out[:, :T, :, :H].astype(q.dtype), lse[:, :T]


def kernel_operands(q, k, v, bias=None, mask=None, q_lens=None, kv_lens=None):
  """The Ascend targets' operands for a call, and its plan: q (B, T, N, H),
  k and v (B, S, K, H) in the operand dtype, zero-padded to whole tiles (T
  to Tp, S to Sp, H to Hp: a copy), key and value rows at or past the key
  lengths zeroed in the same copy (they are never read: what they hold,
  NaN included, cannot reach the output); a bias (float32) or mask with its
  T and S dims padded likewise where they are not broadcast (size 1: the
  kernel broadcasts them), empty when absent; the lengths, T and S where
  absent, clipped to T and S."""
  B, T, N, H = q.shape
  S = k.shape[1]
  p = plan(q.shape, k.shape, q.dtype)
  dtype = operand_dtype(q.dtype)
  Tp, Sp, Hp = p["Tp"], p["Sp"], p["Hp"]
  q_lens = jnp.full((B,), T, jnp.int32) if q_lens is None else jnp.minimum(
      q_lens.astype(jnp.int32), T)
  if kv_lens is not None:
    kv_lens = jnp.minimum(kv_lens.astype(jnp.int32), S)
    live = jnp.arange(S)[None, :, None, None] < kv_lens[:, None, None, None]
    k, v = jnp.where(live, k, 0), jnp.where(live, v, 0)
  kv_lens = jnp.full((B,), S, jnp.int32) if kv_lens is None else kv_lens
  rows = lambda x, n: jnp.pad(x.astype(dtype), ((0, 0), (0, n - x.shape[1]), (0, 0), (0, Hp - H)))

  def tiles(x, dtype_, fill):
    pad = [(0, 0), (0, 0)] + [(0, 0 if d == 1 else n - d) for d, n in zip(x.shape[2:], (Tp, Sp))]
    return jnp.pad(x.astype(dtype_), pad, constant_values=fill)

  return (rows(q, Tp), rows(k, Sp), rows(v, Sp),
          jnp.zeros((0,), jnp.float32) if bias is None else tiles(bias, jnp.float32, 0),
          jnp.zeros((0,), jnp.bool_) if mask is None else tiles(mask, jnp.bool_, False),
          q_lens, kv_lens), p
