# Two entry points for a fresh machine: `make demo` trains the demo model with
# superoffload.adamw, `make test` runs the test suite. Both build a virtual
# environment in .venv first (jax, optax, flax, the C++ extension). `make
# wheel` builds the wheels (x86-64 and aarch64) into dist/.

PYTHON ?= python3
VENV ?= .venv
# A pip constraints file that pins a JAX line, e.g. .ci/jax-0.10.txt (CI
# pins the oldest supported line with it); empty: the newest JAX the Python
# can install.
CONSTRAINTS ?=
PIP_C := $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
# A built wheel (make wheel) to install in the venv instead of building the
# extension in place, as CI does: one build, tested on every JAX line. The
# venv then imports jax_superoffload from the wheel and only experiments/
# (and the tests) from the checkout.
WHEEL ?=
PY := $(VENV)/bin/python
COMMA := ,
STAMP := $(VENV)/.installed
SOURCES := pyproject.toml CMakeLists.txt $(CONSTRAINTS) $(wildcard xla_ffi/*.cc xla_ffi/*.h xla_ffi/CMakeLists.txt)
PURELIB = $$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
CHECKOUT_PTH = $(PURELIB)/jax_superoffload_checkout.pth

# The CUDA PJRT plugin of the venv's jaxlib, unpacked aside (--target), where
# JAX does not discover it: tests/test_plugin_ffi.py registers Grace Adam in
# it (no GPU needed), the rest of the suite runs as on any CPU machine. No
# dependencies: the library loads without CUDA.
PLUGIN_DIR := $(VENV)/cuda-plugin
PLUGIN_SO := $(PLUGIN_DIR)/jax_plugins/xla_cuda13/xla_cuda_plugin.so

.PHONY: demo test lint bench clean cuda-plugin wheel aot-deps gpu-compile

# Each stage of the venv's build says what it does in one line (pip itself
# stays quiet): on 2 cores the whole build takes minutes, most of them in
# compiling the C++ extension.
STAGE = @echo "make: [$(1)] $(2)"

ifeq ($(WHEEL),)
$(STAMP): $(SOURCES)
	$(call STAGE,1/4,a virtual environment in $(VENV) ($(PYTHON)))
	@$(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip
	$(call STAGE,2/4,build tools$(COMMA) jax and jaxlib (pip; downloads on a first build))
# Build tools first: the extension builds without isolation, against the
# jaxlib it will run with (whose XLA FFI headers it compiles with).
	@$(PY) -m pip install -q "scikit-build-core>=0.10" "nanobind>=3.1" cmake ninja "jax>=0.10.1,<0.13" "jaxlib>=0.10.1,<0.13" $(PIP_C)
	$(call STAGE,3/4,the C++ extension (CMake and Ninja; the longest stage) and the test and experiments extras)
	@$(PY) -m pip install -q --no-build-isolation -e ".[test,experiments]" $(PIP_C)
	@rm -f $(CHECKOUT_PTH)
	@touch $(STAMP)
	$(call STAGE,4/4,$(VENV) is ready)
else
# The checkout goes on sys.path after site-packages (a .pth file), so that
# experiments/ imports from it and jax_superoffload from the wheel.
$(STAMP): $(WHEEL) pyproject.toml $(CONSTRAINTS)
	$(call STAGE,1/3,a virtual environment in $(VENV) ($(PYTHON)))
	@$(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip
	$(call STAGE,2/3,the wheel $(WHEEL) with jax$(COMMA) jaxlib and the test and experiments extras (pip))
	@$(PY) -m pip install -q "$(abspath $(WHEEL))[test,experiments]" $(PIP_C)
	@echo "$(CURDIR)" > $(CHECKOUT_PTH)
	@touch $(STAMP)
	$(call STAGE,3/3,$(VENV) is ready)
endif

# With a WHEEL, PYTHONSAFEPATH=1 keeps `python -m` (here, in pytest and in
# the tests' subprocesses) from putting the checkout first on sys.path: its
# jax_superoffload/ has no built module, and the wheel's is the one to run.
RUN_ENV := $(if $(WHEEL),PYTHONSAFEPATH=1)

demo: $(STAMP)
	$(call STAGE,demo,training configs/demo.py: 600 steps$(COMMA) a progress bar)
	@$(RUN_ENV) $(PY) -m experiments.trainer --config configs/demo.py

$(PLUGIN_SO): $(STAMP)
	$(PY) -m pip install -q --no-deps --upgrade --target $(PLUGIN_DIR) \
	  "jax-cuda13-pjrt==$$($(PY) -c 'import jaxlib; print(jaxlib.__version__)')"
	touch $@

cuda-plugin: $(PLUGIN_SO)

# Deviceless GPU compilation (experiments/device/aot.py): the CUDA plugin of
# the venv's jaxlib with ptxas and libdevice, unpacked aside (--target) so
# that only the harness's processes see them (they put the folder on
# sys.path before JAX starts). No GPU, no CUDA toolkit. jax 0.11+ (Python
# 3.12): `make gpu-compile PYTHON="$(pyenv prefix 3.12)/bin/python"
# VENV=.venv312` (or PYTHON=python3.12 where that command runs).
AOT_DIR := $(VENV)/cuda-aot
AOT_STAMP := $(AOT_DIR)/.installed
$(AOT_STAMP): $(STAMP)
	$(PY) -m pip install -q --no-deps --upgrade --target $(AOT_DIR) \
	  "jax-cuda13-plugin==$$($(PY) -c 'import jaxlib; print(jaxlib.__version__)')" \
	  "jax-cuda13-pjrt==$$($(PY) -c 'import jaxlib; print(jaxlib.__version__)')" \
	  nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88
	touch $@

aot-deps: $(AOT_STAMP)

# The table of the 1B step compiled for an H200 (optax, the library's
# default executor `auto`, `stream` and `device`; scanned and unrolled);
# JSON in results/tmp/aot.json. AOT_ARGS adds flags: the model's shape
# (--layers, --d-model, --heads, --mlp-dim, --seq-len, --batch, --vocab),
# the GPU (--gpu h100,h200), --capacity; `python -m experiments.device.aot
# --help` lists them.
gpu-compile: $(AOT_STAMP)
	JAX_SUPEROFFLOAD_CUDA_AOT=$(abspath $(AOT_DIR)) $(RUN_ENV) $(PY) -m experiments.device.aot $(AOT_ARGS)

# One pytest worker per core (pytest-xdist), each taking whole test files
# (module fixtures, such as a saved run, are built once). pytest exits 5 when
# it collects no tests, which fails this target too. TEST_WORKERS=0 runs the
# suite in this one process.
# TEST_ARGS: more pytest arguments, e.g. -m "not aot" (CI runs the
# deviceless GPU compiles, marked aot, as a stage of their own). The 25
# slowest tests are listed at the end: CI's time budget is spent there.
TEST_WORKERS ?= auto
TEST_ARGS ?=
test: $(STAMP)
	if [ -f $(PLUGIN_SO) ]; then export JAX_SUPEROFFLOAD_CUDA_PLUGIN=$(abspath $(PLUGIN_SO)); fi; \
	  if [ -d $(AOT_DIR)/jax_plugins ]; then export JAX_SUPEROFFLOAD_CUDA_AOT=$(abspath $(AOT_DIR)); fi; \
	  $(RUN_ENV) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25 $(TEST_ARGS) tests

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: $(STAMP)
	$(PY) -m experiments.benchmarks.bench_adam
	$(PY) -m experiments.benchmarks.bench_step

# One cp311-abi3 wheel per architecture (every CPython from 3.11 on), tagged
# manylinux_2_27 as jaxlib's are: compiled by Zig's clang for glibc 2.27,
# libstdc++ linked statically, against the oldest supported jaxlib's FFI
# headers; repaired and checked with auditwheel and
# .ci/check_symbol_versions.py; aarch64 is cross-compiled. See
# .ci/build_wheel.sh.
# WHEEL_PYTHON: the Python (>= 3.11) of the build venv, build/wheel-venv.
WHEEL_PYTHON ?= $(PYTHON)
WHEEL_ARCHS ?= x86_64 aarch64
wheel:
	WHEEL_PYTHON=$(WHEEL_PYTHON) bash .ci/build_wheel.sh $(WHEEL_ARCHS)

clean:
	rm -rf $(VENV) build dist

# The documentation into build/docs (Sphinx, warnings as errors), and its
# examples run: .ci/docs.sh, which installs the `docs` extra into the venv.
.PHONY: docs
docs: $(STAMP)
	bash .ci/docs.sh $(VENV)
