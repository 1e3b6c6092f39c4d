#!/usr/bin/env bash
# What a lent GPU machine's image lacks, into .gpu/ (device calls carry it:
# the device tool's run with carry [".gpu"]; .gitignore keeps it out of
# git). The H200 image of 2026-12-04 holds Python 3.12, jax, jaxlib and
# the CUDA 13 plugin 0.11.2, optax 0.2.8, flax 0.12.10 (with their own
# dependencies) and nothing else, and has no registry to install from.
#
#   .gpu/_grace_adam*.so  the extension, one cp311-abi3 module: taken from
#                         WHEEL (a built wheel, as CI's; it runs on jaxlib
#                         0.10 to 0.12) or built here against jaxlib
#                         $JAXLIB's XLA FFI headers (needs Python 3.12).
#   .gpu/site/            every module the library, the trainer and
#                         gpu_parts import that the image lacks, for the
#                         image's Python ($IMAGE_PYTHON): nanobind's
#                         split-mode backend (compiled, one per Python) and
#                         the pure-Python ones in CARRY.
#
# run.sh copies the extension into jax_superoffload/ and puts .gpu/site on
# PYTHONPATH. .ci/device_image.sh checks the whole command in a venv that
# holds only what the image holds.
set -euo pipefail
cd "$(dirname "$0")/../.."
IMAGE_PYTHON="${IMAGE_PYTHON:-3.12}"
JAXLIB="${JAXLIB:-0.11.2}"
CARRY=(nanobind-backend tqdm ml_collections)
rm -rf .gpu
mkdir -p .gpu/site
if [[ -n "${WHEEL:-}" ]]; then
  unzip -o -j -q "$WHEEL" 'jax_superoffload/_grace_adam*.so' -d .gpu
else
  PY="${PY:-$(ls -d "$(pyenv root)"/versions/3.12.*/bin/python | sort -V | tail -n 1)}"
  VENV=.venvgpu
  [[ -x $VENV/bin/python ]] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q "scikit-build-core>=0.10" \
    "nanobind>=3.1" cmake ninja "jax==$JAXLIB" "jaxlib==$JAXLIB"
  rm -rf build/gpu-wheel
  "$VENV/bin/python" -m pip wheel -q --no-deps --no-build-isolation \
    -w build/gpu-wheel .
  unzip -o -j -q build/gpu-wheel/jax_superoffload-*.whl \
    'jax_superoffload/_grace_adam*.so' -d .gpu
fi
# Wheels for the image's Python and machine, whatever Python runs pip here.
"${PIP_PYTHON:-python3}" -m pip install -q --no-deps --target .gpu/site \
  --python-version "$IMAGE_PYTHON" --implementation cp --only-binary=:all: \
  --platform manylinux_2_27_x86_64 --platform manylinux2014_x86_64 \
  "${CARRY[@]}"
ls .gpu .gpu/site
