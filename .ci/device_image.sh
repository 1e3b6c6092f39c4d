#!/usr/bin/env bash
# The prepared GPU command on a simulated device image: a
# Python 3.12 venv holding only what the lent H200 machine's image holds
# (jax and jaxlib 0.11.2, optax 0.2.8, flax 0.12.10, and what they pull
# in), and the tree as a device call carries it (the tracked files, plus
# .gpu/ from experiments/device/prepare.sh). There every part of run.sh
# runs at tiny sizes on the CPU (--dry-run) and must print its result.
#
#   WHEEL=dist/...whl NEW_PYTHON=python3.12 bash .ci/device_image.sh
#
# With --venv it only makes the venv (CI does that in the background,
# beside the test suites: it is mostly downloads).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${NEW_PYTHON:?NEW_PYTHON=a Python 3.12}"
venv="$PWD/build/device-image-venv"
if [[ ! -f "$venv/.image" ]]; then
  rm -rf "$venv"
  "$PYTHON" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q jax==0.11.2 jaxlib==0.11.2 \
    optax==0.2.8 flax==0.12.10
  touch "$venv/.image"
fi
if [[ "${1:-}" == --venv ]]; then
  exit 0
fi
WHEEL="$(realpath "${WHEEL:?WHEEL=the built wheel}")" \
  bash experiments/device/prepare.sh >/dev/null
tree="$(mktemp -d)"
trap 'rm -rf "$tree"' EXIT
git ls-files -z | xargs -0 cp --parents -t "$tree"
cp -r .gpu "$tree/"
cd "$tree"
# The image's python3 first on PATH, nothing of this machine's site.
env PATH="$venv/bin:/usr/bin:/bin" OUT="$tree/out" PART_TIMEOUT_S=600 PARTS=all \
  PYTHONNOUSERSITE=1 bash experiments/device/run.sh --dry-run >"$tree/log" \
  2>&1 || true
parts=$(grep -cE '^== .*: [0-9]+ s$' "$tree/log" || true)
results=$(wc -l <"$tree/out/parts.jsonl" 2>/dev/null || echo 0)
# Every result judged as the suite judges the dry run (check_parts.py).
"$venv/bin/python" experiments/device/check_parts.py "$tree/out/parts.jsonl" \
  --dry-run || bad=1
echo "parts run: $parts, results: $results"
if ((results == 0 || results != parts || ${bad:-0})); then
  echo "== some parts failed or printed no result; the log's tail:" >&2
  tail -n 60 "$tree/log" >&2
  exit 1
fi
