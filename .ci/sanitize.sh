#!/usr/bin/env bash
# Builds the kernel and its C++ tests with AddressSanitizer and UBSan and runs
# them with --quick (every path, smaller large cases: the full cases took 14
# of CI's 28 minutes beside the two test lines); any report aborts the test
# (-fno-sanitize-recover). Then builds the stream launch test alone (its
# worker, the fake driver's callback thread and the host pool share memory)
# with ThreadSanitizer (on the scalar kernel alone: xla_ffi/CMakeLists.txt)
# and runs it; any race fails it (halt_on_error). The stream launch test
# needs jaxlib's XLA FFI headers, found through the Python on PATH (CI's
# build venv).
set -euo pipefail
cd "$(dirname "$0")/.."
python="$(command -v python || command -v python3)"
cmake -S xla_ffi -B build/sanitize -G Ninja -DJSO_SANITIZE=ON -DCMAKE_BUILD_TYPE= \
  -DPython_EXECUTABLE="$python" >/dev/null
cmake --build build/sanitize >/dev/null
status=0
run() {  # run LOG COMMAND...: runs it, prints its summary lines.
  local log=$1
  shift
  "$@" >"$log" 2>&1 || status=$?
  head -n 1 "$log"
  grep -E 'FAILED|runtime error|Sanitizer' "$log" | head -n 20 || true
  tail -n 1 "$log"
}
for test in adam_kernel_test lowp_moments_test moments_vectors_test stream_launch_test; do
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
    run "build/sanitize/$test.log" "build/sanitize/$test" --quick
done
cmake -S xla_ffi -B build/tsan -G Ninja -DJSO_TSAN=ON -DCMAKE_BUILD_TYPE= \
  -DPython_EXECUTABLE="$python" >/dev/null
cmake --build build/tsan --target stream_launch_test >/dev/null
TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 \
  run build/tsan/stream_launch_test.log build/tsan/stream_launch_test
exit "$status"
