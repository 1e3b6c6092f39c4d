#!/usr/bin/env bash
# The prepared GPU command on a simulated device image (issue 33): a
# Python 3.12 venv holding only what the lent H200 machine's image holds
# (jax and jaxlib 0.11.2, optax 0.2.8, flax 0.12.10, and what they pull
# in), and the tree as a device call carries it (the tracked files, plus
# .gpu/ from experiments/device/prepare.sh). There every part of run.sh
# runs at tiny sizes on the CPU (--dry-run) and must print its result.
#
#   WHEEL=dist/...whl NEW_PYTHON=python3.12 bash .ci/device_image.sh
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
"$venv/bin/python" - "$tree/out/parts.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])] if sys.argv[1] else []
for r in rows:
  print(f"{r['part']:9} {str(r.get('case', '')):16} "
        f"{'ok' if 'error' not in r else 'ERROR ' + str(r['error'])[:80]}")
bad = [r for r in rows if 'error' in r]
sys.exit(1 if bad else 0)
PY
echo "parts run: $parts, results: $results"
if ((results == 0 || results != parts)); then
  echo "== some parts printed no result; the log's tail:" >&2
  tail -n 60 "$tree/log" >&2
  exit 1
fi
