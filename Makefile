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

# The CUDA PJRT plugin of the venv's jaxlib, unpacked aside (--target), where
# JAX does not discover it: tests/test_plugin_ffi.py registers Grace Adam in
# it (no GPU needed), the rest of the suite runs as on any CPU machine. No
# dependencies: the library loads without CUDA.
PLUGIN_DIR := $(VENV)/cuda-plugin
PLUGIN_SO := $(PLUGIN_DIR)/jax_plugins/xla_cuda13/xla_cuda_plugin.so

.PHONY: demo test lint bench clean cuda-plugin

$(STAMP): $(SOURCES)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Build tools first: the extension builds without isolation, against
	# the jaxlib it will run with (whose XLA FFI headers it compiles with).
	$(PY) -m pip install -q "scikit-build-core>=0.10" "nanobind>=2.0" cmake ninja "jax>=0.10.1,<0.13" "jaxlib>=0.10.1,<0.13" $(PIP_C)
	$(PY) -m pip install -q --no-build-isolation -e ".[test,experiments]" $(PIP_C)
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m experiments.trainer --config configs/demo.py

$(PLUGIN_SO): $(STAMP)
	$(PY) -m pip install -q --no-deps --upgrade --target $(PLUGIN_DIR) \
	  "jax-cuda13-pjrt==$$($(PY) -c 'import jaxlib; print(jaxlib.__version__)')"
	touch $@

cuda-plugin: $(PLUGIN_SO)

# One pytest worker per core (pytest-xdist), each taking whole test files
# (module fixtures, such as a saved run, are built once). pytest exits 5 when
# it collects no tests, which fails this target too. TEST_WORKERS=0 runs the
# suite in this one process.
TEST_WORKERS ?= auto
test: $(STAMP)
	if [ -f $(PLUGIN_SO) ]; then export JAX_SUPEROFFLOAD_CUDA_PLUGIN=$(abspath $(PLUGIN_SO)); fi; \
	  $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: $(STAMP)
	$(PY) -m experiments.benchmarks.bench_adam
	$(PY) -m experiments.benchmarks.bench_step

clean:
	rm -rf $(VENV) build

# The documentation into build/docs (Sphinx, warnings as errors), and its
# examples run: .ci/docs.sh, which installs the `docs` extra into the venv.
.PHONY: docs
docs: $(STAMP)
	bash .ci/docs.sh $(VENV)
