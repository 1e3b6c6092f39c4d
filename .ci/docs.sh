#!/usr/bin/env bash
# .ci/docs.sh [VENV]: builds the documentation (Sphinx, warnings as errors)
# into build/docs and runs every Python code block of the README and of
# docs/getting_started.md, with the checks of docs/ (tests/test_docs.py).
# VENV (default .venv) is a venv with the package installed, as `make`
# builds it; made here when it has none. The docs' requirements, the `docs`
# extra of pyproject.toml, are installed into it. Nothing is fetched at
# build time: the API page is generated from the installed package.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv}
py=$venv/bin/python
if [[ ! -f $venv/.installed ]]; then
  make "$venv/.installed" VENV="$venv"
fi
# The extra's requirements alone: `pip install .[docs]` would build the
# extension again.
mapfile -t requirements < <("$py" -c '
import tomllib
with open("pyproject.toml", "rb") as f:
  extras = tomllib.load(f)["project"]["optional-dependencies"]
print("\n".join(extras["docs"]))')
"$py" -m pip install -q "${requirements[@]}"
start=$SECONDS
rm -rf build/docs
"$py" -m sphinx -W --keep-going -q -b html docs build/docs
echo "docs built in $((SECONDS - start)) s: build/docs/index.html"
"$py" -m pytest -q tests/test_readme_examples.py tests/test_docs.py
