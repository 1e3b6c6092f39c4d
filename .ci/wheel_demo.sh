#!/usr/bin/env bash
# A fresh venv on a machine without a C++ compiler installs the built wheel
# and trains the demo:
#
#   WHEEL=dist/jax_superoffload-...whl [PYTHON=python3] bash .ci/wheel_demo.sh
#
# "Without a compiler": pip and the demo run with PATH holding only the
# venv's bin/ (no cc, gcc, g++, c++ or clang is found, and the script checks
# it) and CC=CXX=/bin/false, and pip takes binary packages only
# (--only-binary=:all:), so nothing can be built from source. The demo is the
# checkout's trainer; the checkout is put on sys.path after site-packages and
# PYTHONSAFEPATH keeps `python -m` from putting it first, so
# jax_superoffload is the wheel's (printed below) and not the checkout's.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEEL="$(realpath "${WHEEL:?WHEEL=path of the wheel to install}")"
PYTHON="${PYTHON:-python3}"
# The trainer and its demo config, run by the venv's python from the checkout.
DEMO="${DEMO:-python -m experiments.trainer --config configs/demo.py}"
venv="$PWD/build/demo-venv"
rm -rf "$venv"
"$PYTHON" -m venv "$venv"

no_compiler=(env PATH="$venv/bin" CC=/bin/false CXX=/bin/false PYTHONSAFEPATH=1)
for tool in cc gcc g++ c++ clang; do
  if "${no_compiler[@]}" "$venv/bin/python" -c \
    "import shutil, sys; sys.exit(shutil.which('$tool') is not None)"; then
    :
  else
    echo "a compiler is on PATH: $tool" >&2
    exit 1
  fi
done

"${no_compiler[@]}" "$venv/bin/python" -m pip install -q --only-binary=:all: \
  "$WHEEL[experiments]"
purelib="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
echo "$PWD" >"$purelib/jax_superoffload_checkout.pth"
"${no_compiler[@]}" "$venv/bin/python" -c "import sys, jax, jax_superoffload._grace_adam as m
print('jax %s, Python %s, %s' % (jax.__version__, sys.version.split()[0], m.__file__))
sys.exit(0 if m.__file__.startswith('$venv/') else 'not the wheel')"
echo "== $DEMO"
# shellcheck disable=SC2086  # DEMO is a command line.
"${no_compiler[@]}" $DEMO
