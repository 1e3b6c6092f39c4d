#!/usr/bin/env bash
# Checks that the C++ of xla_ffi/ follows .clang-format (Google style).
#
#   PYTHON=/path/to/venv/bin/python bash .ci/clang_format.sh [--fix]
#
# Installs the pinned clang-format wheel into PYTHON's environment when its
# version is missing (formatting differs between versions). Prints the diff
# of every file that is not formatted and exits non-zero; --fix rewrites
# them instead.
set -euo pipefail
VERSION=18.1.8
PYTHON="${PYTHON:-python3}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bin="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')"
clang_format="$bin/clang-format"
if ! "$clang_format" --version 2>/dev/null | grep -q "version $VERSION"; then
  "$PYTHON" -m pip install -q "clang-format==$VERSION"
fi

mapfile -t files < <(git ls-files -co --exclude-standard -- \
  'xla_ffi/*.cc' 'xla_ffi/*.h')
if [[ "${1:-}" == "--fix" ]]; then
  "$clang_format" -i --style=file "${files[@]}"
  exit 0
fi
status=0
for f in "${files[@]}"; do
  if ! diff -u "$f" <("$clang_format" --style=file "$f") \
      --label "$f" --label "$f (clang-format)"; then
    status=1
  fi
done
if [[ "$status" != 0 ]]; then
  echo "clang_format.sh: run 'bash .ci/clang_format.sh --fix'" >&2
fi
exit "$status"
