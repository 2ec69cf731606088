"""The native extension is the one this checkout builds, whichever build made it.

CMake (``pip install``) and Bazel (``make bazel``) build the same module: the
same FFI targets, registered and called by the Python side, and the same
embedded kernel sources, which are this checkout's files as
``csrc/embed_sources.py`` selects them. ``make bazel-test`` runs this file and
the CPU numerics against the Bazel build, with ``FASTATTN_TEST_BUILD`` naming
the CMake build's ``python -m fastattn_jax`` report to compare against.
"""

import importlib.util
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa_testutil as tu
import fastattn_jax
from fastattn_jax import _ffi, _util, ascend, backends, cuda

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _embed_sources():
  spec = importlib.util.spec_from_file_location("embed_sources", ROOT / "csrc" / "embed_sources.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize("kind", ["cuda", "ascend"])
def test_embedded_sources_are_the_checkouts(kind):
  expected = _embed_sources().sources(kind)
  embedded = getattr(_ffi, f"{kind}_sources")()
  assert sorted(embedded) == sorted(expected), "the extension embeds other files"
  stale = [name for name in expected if embedded[name] != expected[name]]
  assert not stale, f"the extension was built from other versions of {stale}: rebuild it"
  assert fastattn_jax.build_info()["kernel_sources"][kind] == _util.sources_digest(expected)


def test_sources_set_names():
  sets = {kind: _embed_sources().sources(kind) for kind in ("cuda", "ascend")}
  # NVRTC includes the shared rules and dtype codes by file name; the Ascend
  # compile keeps the folders under csrc/kernels.
  assert {"attention_dtypes.h", "attention_rules.h"} <= set(sets["cuda"])
  assert {"attention_dtypes.h", "attention_rules.h", "ascend/attention_ascend.cpp",
          "ascend/sim/stdfloat"} <= set(sets["ascend"])
  assert all(name.endswith((".cu", ".cuh", ".h")) for name in sets["cuda"])


def test_python_calls_only_registered_targets():
  """Every target the Python side calls is registered, and nothing else is."""
  registered = {(platform.lower(), name)
                for platform, targets in _ffi.registrations().items() for name in targets}
  called = {("cpu", backends.CPU_TARGET), ("cpu", backends.CPU_BACKWARD_TARGET),
            ("cuda", cuda.TARGET), ("cuda", cuda.BACKWARD_TARGET),
            *(("cpu", target) for target in ascend.TARGETS.values())}
  assert registered == called


def test_cpu_targets_run_under_jit():
  """The CPU forward and backward targets are in the compiled program and
  give the float64 reference's values and gradients."""
  rng = np.random.default_rng(tu.seed_of("build"))
  q, k, v = tu.qkv(rng, 2, 37, 45, 4, 2, 32)
  cpu = jax.devices("cpu")[0]
  q, k, v = (jax.device_put(x, cpu) for x in (q, k, v))

  def loss(q, k, v):
    out = fastattn_jax.fast_attention(q, k, v, is_causal=True, implementation="cpu")
    return jnp.sum(out * out), out

  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
  hlo = grad.lower(q, k, v).compile().as_text()
  assert backends.CPU_TARGET in hlo and backends.CPU_BACKWARD_TARGET in hlo
  (dq, dk, dv), out = grad(q, k, v)
  ref, _ = tu.reference64(q, k, v, is_causal=True)
  np.testing.assert_allclose(np.asarray(out), ref, atol=tu.ref_atol("float32", "cpu"))
  ref_grads = tu.reference64_grads(q, k, v, 2 * ref, is_causal=True)
  for got, want in zip((dq, dk, dv), ref_grads[:3]):
    np.testing.assert_allclose(np.asarray(got), want, atol=5 * tu.ref_atol("float32", "cpu"))


def test_same_module_as_the_other_build():
  """With FASTATTN_TEST_BUILD naming another build's report, this module is a
  different build of the same thing."""
  path = os.environ.get("FASTATTN_TEST_BUILD")
  if not path:
    pytest.skip("FASTATTN_TEST_BUILD names no other build's report (make bazel-test sets it)")
  other = json.loads(pathlib.Path(path).read_text())
  mine = fastattn_jax.build_info()
  assert mine["built_by"] != other["built_by"], (
      f"both reports are of the {mine['built_by']} build: the other build is not the one loaded")
  for key in ("ffi_targets", "ffi_types", "kernel_sources"):
    assert mine[key] == other[key], key
