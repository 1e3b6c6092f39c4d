#!/bin/bash
# Usage: check_ffi_symbols.sh LIB.so SYMBOL...
# Checks that LIB.so exports each SYMBOL as a defined dynamic symbol and that
# the library loads (all its own undefined symbols resolve).
set -u
lib="$1"
shift
status=0

if [[ ! -f "$lib" ]]; then
  echo "FAILED: $lib not found"
  exit 1
fi

exported="$(nm -D --defined-only "$lib" | awk '{print $NF}')" || {
  echo "FAILED: nm -D $lib"
  exit 1
}
for sym in "$@"; do
  if grep -qx -- "$sym" <<<"$exported"; then
    echo "ok: $sym exported"
  else
    echo "FAILED: $sym not exported by $lib"
    status=1
  fi
done

# Load it the way Python's ctypes (and so jax's FFI registration) would.
if command -v python3 >/dev/null 2>&1; then
  if python3 - "$lib" "$@" <<'PY'
import ctypes, os, sys
lib = ctypes.CDLL(os.path.abspath(sys.argv[1]))
for sym in sys.argv[2:]:
    getattr(lib, sym)
PY
  then
    echo "ok: $lib loads"
  else
    echo "FAILED: $lib does not load, or lacks a symbol"
    status=1
  fi
fi

exit "$status"
