#!/usr/bin/env bash
# Builds the kernel and its C++ tests with AddressSanitizer and UBSan and runs
# them with --quick (every path, smaller large cases: the full cases took 14
# of CI's 28 minutes beside the two test lines); any report aborts the test
# (-fno-sanitize-recover).
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S xla_ffi -B build/sanitize -G Ninja -DJSO_SANITIZE=ON -DCMAKE_BUILD_TYPE= >/dev/null
cmake --build build/sanitize >/dev/null
status=0
for test in adam_kernel_test lowp_moments_test moments_vectors_test; do
  log=build/sanitize/$test.log
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
    "build/sanitize/$test" --quick >"$log" 2>&1 || status=$?
  head -n 1 "$log"
  grep -E 'FAILED|runtime error|Sanitizer' "$log" | head -n 20 || true
  tail -n 1 "$log"
done
exit "$status"
