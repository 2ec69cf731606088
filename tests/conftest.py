"""Shared set-up of the fastattn_jax test suite.

* Four host CPU devices (``--xla_force_host_platform_device_count=4``) so the
  sharding tests can build a (2, 2) mesh; the flag must be in ``XLA_FLAGS``
  before jax initialises its backends, hence here, before anything imports
  jax. Likewise, no preallocation of GPU memory.
* On a GPU, the kernel cache is filled for its arch before the tests start.
* The path under test: ``FASTATTN_TEST_IMPLEMENTATION`` (unset: ``None``, the
  library's choice for the platform) so that the same suite runs forced onto
  one path on a GPU, e.g. ``FASTATTN_TEST_IMPLEMENTATION=cuda_sm90 pytest``
  (JAX's default platforms: the CPU tests need the CPU backend beside CUDA).
* Tests marked ``gpu`` skip with a reason when no GPU is present; tests
  marked ``slow`` (large shapes, many examples) run only with ``--slow``, so
  that ``pytest tests`` on a GPU stays within minutes; ``make test`` passes it.

Run from the repository root as ``pytest tests`` once the package is
installed (``make test`` does both).
"""

import os

# No autotuning of XLA's GPU matmul fusions: it picks among equally exact
# configurations, for speed, and took 19 of a float32 test's 22 s on an H100.
for _flag in ("--xla_force_host_platform_device_count=4", "--xla_gpu_autotune_level=0"):
  if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
# Several processes share a GPU (pytest-xdist's workers, and the controller,
# which fills the kernel cache): each takes device memory as it needs it
# instead of JAX's default 75% at start, which only the first would get.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402  (after XLA_FLAGS on purpose)
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import fa_testutil as tu  # noqa: E402


def pytest_addoption(parser):
  parser.addoption("--slow", action="store_true",
                   help="also run the tests marked slow (make test does)")


def pytest_configure(config):
  # Also declared in pyproject.toml; repeated so the suite runs from anywhere.
  config.addinivalue_line("markers", "slow: long-running (large shapes)")
  config.addinivalue_line("markers", "gpu: needs a GPU (skipped without one)")


def pytest_sessionstart(session):
  """On a GPU, fill the kernel cache for its arch in parallel before any test
  runs (``python -m fastattn_jax.precompile``; seconds once cached), rather
  than each worker compiling the variants it meets one at a time. Runs in the
  controller only: pytest-xdist starts its workers after this hook."""
  if "PYTEST_XDIST_WORKER" in os.environ or not tu.has_gpu():
    return
  from fastattn_jax import cuda, precompile
  cc = cuda.compute_capability()
  if precompile.main(["--arch", str(cc)]) != 0:
    pytest.exit(f"precompile for compute capability {cc} failed (above)", returncode=1)


def pytest_collection_modifyitems(config, items):
  skip_slow = pytest.mark.skip(reason="slow: run with --slow (make test does)")
  skip_gpu = pytest.mark.skip(
      reason=f"no GPU: jax.devices() = {jax.devices()!r} (run on a machine with a CUDA GPU)")
  gpu = tu.has_gpu()
  for item in items:
    if "slow" in item.keywords and not config.getoption("--slow"):
      item.add_marker(skip_slow)
    if "gpu" in item.keywords and not gpu:
      item.add_marker(skip_gpu)


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
