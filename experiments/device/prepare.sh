#!/usr/bin/env bash
# Builds the extension for a lent GPU machine into .gpu/ (which device calls
# carry; .git/info/exclude keeps it out of git). That machine runs its own
# image's python3 and jaxlib, with no registry to install from: on the H200
# image of 2026-12-04, Python 3.12 and jaxlib 0.11.2 (PY and JAXLIB override).
# The extension compiles against that jaxlib's XLA FFI headers.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PY:-$(ls -d "$(pyenv root)"/versions/3.12.*/bin/python | sort -V | tail -n 1)}"
JAXLIB="${JAXLIB:-0.11.2}"
VENV=.venvgpu
[[ -x $VENV/bin/python ]] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q "scikit-build-core>=0.10" "nanobind>=2.0" \
  cmake ninja "jax==$JAXLIB" "jaxlib==$JAXLIB"
rm -rf build/gpu-wheel
"$VENV/bin/python" -m pip wheel -q --no-deps --no-build-isolation \
  -w build/gpu-wheel .
mkdir -p .gpu
unzip -o -j build/gpu-wheel/jax_superoffload-*.whl \
  'jax_superoffload/_grace_adam*.so' -d .gpu
grep -qx '/.gpu/' .git/info/exclude || echo '/.gpu/' >>.git/info/exclude
ls -l .gpu
