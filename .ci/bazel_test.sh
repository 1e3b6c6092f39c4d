#!/usr/bin/env bash
# Bazel build and tests of the C++ kernel and the XLA FFI shared library,
# offline, with Debian's bazel-bootstrap (Bazel 4.2).
#
#   PYTHON=/path/to/venv/bin/python bash .ci/bazel_test.sh [bazel test args]
#
# PYTHON (default python3) must import jax: its jaxlib provides the XLA FFI
# headers. Installs bazel-bootstrap with apt-get if `bazel` is missing.
# Exits non-zero if the build or any test fails.
set -euo pipefail

PYTHON="${PYTHON:-python3}"
if ! python_path="$(command -v "$PYTHON")"; then
  echo "bazel_test.sh: PYTHON=$PYTHON not found" >&2
  exit 1
fi
# Absolute, but not symlink-resolved: a venv's python must stay the venv's.
case "$python_path" in
  /*) ;;
  *) python_path="$PWD/$python_path" ;;
esac
if ! "$python_path" -c "import jax" >/dev/null 2>&1; then
  echo "bazel_test.sh: $python_path cannot import jax" >&2
  exit 1
fi
export PYTHON_BIN_PATH="$python_path"

cd "$(dirname "${BASH_SOURCE[0]}")/.."

if ! command -v bazel >/dev/null 2>&1; then
  sudo=""
  if [[ "$(id -u)" != 0 ]]; then
    sudo="sudo"
  fi
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update
  $sudo apt-get install -y bazel-bootstrap
fi

bazel version 2>/dev/null | head -n 1 || true
bazel test //... "$@"
