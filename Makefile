# Two entry points for a fresh machine: `make demo` trains the demo model with
# superoffload.adamw, `make test` runs the test suite. Both build a virtual
# environment in .venv first (jax, optax, flax, the C++ extension).

PYTHON ?= python3
VENV ?= .venv
# A pip constraints file that pins a JAX line, e.g. .ci/jax-0.10.txt (CI
# pins the oldest supported line with it); empty: the newest JAX the Python
# can install.
CONSTRAINTS ?=
PIP_C := $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SOURCES := pyproject.toml CMakeLists.txt $(CONSTRAINTS) $(wildcard xla_ffi/*.cc xla_ffi/*.h xla_ffi/CMakeLists.txt)

.PHONY: demo test lint bench clean

$(STAMP): $(SOURCES)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Build tools first: the extension builds without isolation, against
	# the jaxlib it will run with (whose XLA FFI headers it compiles with).
	$(PY) -m pip install -q "scikit-build-core>=0.10" "nanobind>=2.0" cmake ninja "jax>=0.10,<0.13" "jaxlib>=0.10,<0.13" $(PIP_C)
	$(PY) -m pip install -q --no-build-isolation -e ".[test,experiments]" $(PIP_C)
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m experiments.train

# pytest exits 5 when it collects no tests, which fails this target too.
test: $(STAMP)
	$(PY) -m pytest -q tests

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: $(STAMP)
	$(PY) -m experiments.bench_adam
	$(PY) -m experiments.bench_step

clean:
	rm -rf $(VENV) build
