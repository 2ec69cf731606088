"""Shared set-up of the fastattn_jax test suite.

* Four host CPU devices (``--xla_force_host_platform_device_count=4``) so the
  sharding tests can build a (2, 2) mesh; the flag must be in ``XLA_FLAGS``
  before jax initialises its backends, hence here, before anything imports
  jax.
* The path under test: ``FASTATTN_TEST_IMPLEMENTATION`` (unset: ``None``, the
  library's choice for the platform) so that the same suite can later run on
  a GPU, e.g. ``JAX_PLATFORMS=cuda FASTATTN_TEST_IMPLEMENTATION=... pytest``.
* Tests marked ``gpu`` skip with a reason when no GPU is present.

Run from the repository root as ``pytest tests`` once the package is
installed (``make test`` does both).
"""

import os

_FLAG = "--xla_force_host_platform_device_count=4"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

import jax  # noqa: E402  (after XLA_FLAGS on purpose)
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import fa_testutil as tu  # noqa: E402


def pytest_configure(config):
  # Also declared in pyproject.toml; repeated so the suite runs from anywhere.
  config.addinivalue_line("markers", "slow: long-running (large shapes)")
  config.addinivalue_line("markers", "gpu: needs a GPU (skipped without one)")


def pytest_collection_modifyitems(config, items):
  if tu.has_gpu():
    return
  skip = pytest.mark.skip(
      reason=f"no GPU: jax.devices() = {jax.devices()!r} (run with JAX_PLATFORMS=cuda on a GPU machine)")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


@pytest.fixture
def impl():
  """The implementation under test (None: the platform's default path)."""
  return tu.IMPL


@pytest.fixture
def rng(request):
  """A numpy Generator seeded from the test's id (stable across runs)."""
  return np.random.default_rng(tu.seed_of(request.node.nodeid))


@pytest.fixture
def gpu():
  """For tests that need a GPU without the marker."""
  if not tu.has_gpu():
    pytest.skip(f"no GPU: jax.devices() = {jax.devices()!r}")
  return jax.devices("gpu")[0]
