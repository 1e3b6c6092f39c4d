#!/usr/bin/env bash
# MaxText's own pre-train loop, stock against superoffload's entry
# (tests/test_maxtext.py), in a venv of its own on the newest line's Python:
# the wheel with its test and maxtext extras (MaxText and what its train
# path imports), the checkout on sys.path after site-packages for
# experiments/ (as `make ... WHEEL=` does). Here a missing MaxText fails.
# Usage: WHEEL=dist/....whl NEW_PYTHON=... bash .ci/maxtext.sh
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-maxtext
"$NEW_PYTHON" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q "$WHEEL[test,maxtext]"
purelib="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
echo "$PWD" >"$purelib/jax_superoffload_checkout.pth"
"$venv/bin/python" -c 'import jax, maxtext.version as v
print("jax", jax.__version__, "maxtext", v.__version__)' || true
PYTHONSAFEPATH=1 JAX_SUPEROFFLOAD_REQUIRE_MAXTEXT=1 \
  "$venv/bin/python" -m pytest -q -p no:cacheprovider --durations=10 \
  tests/test_maxtext.py
