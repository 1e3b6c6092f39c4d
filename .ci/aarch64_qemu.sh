#!/usr/bin/env bash
# Cross-compiles the pure kernel and its C++ test for aarch64 twice, a NEON
# build and an SVE build (Grace / Neoverse V2), and runs both under qemu-user:
# the NEON build on a CPU without SVE, the SVE build at two vector lengths.
# Under emulation the test runs with --quick (its large cases shrink from
# 2^18 + 3 to 2^12 + 3 elements; every path still runs): the full test took
# 30 minutes at SVE512 on an Intel Xeon CI machine.
#
# Not run by CI, which tests the aarch64 wheel's build tree instead (NEON
# and SVE in one build, .ci/aarch64_wheel_test.sh). This script is for a
# change to the aarch64 build flags: a baseline armv8-a build with no SVE
# code (JSO_ENABLE_SVE=OFF), and SVE enabled for every translation unit.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v aarch64-linux-gnu-g++ >/dev/null || ! command -v qemu-aarch64 >/dev/null; then
  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
    g++-aarch64-linux-gnu qemu-user
fi
toolchain=build/aarch64-toolchain.cmake
mkdir -p build
cat > "$toolchain" <<'TOOLCHAIN'
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
TOOLCHAIN
run() {  # run NAME CMAKE_ARGS QEMU_CPU...
  local name=$1 args=$2; shift 2
  cmake -S xla_ffi -B "build/$name" -G Ninja -DCMAKE_TOOLCHAIN_FILE="$PWD/$toolchain" $args >/dev/null
  cmake --build "build/$name" >/dev/null
  for cpu in "$@"; do
    for test in adam_kernel_test lowp_moments_test moments_vectors_test; do
      echo "== $name $test on qemu -cpu $cpu"
      local log="build/$name/$test-${cpu//[,=]/_}.log" status=0 start=$SECONDS
      qemu-aarch64 -L /usr/aarch64-linux-gnu -cpu "$cpu" \
        "build/$name/$test" --quick >"$log" 2>&1 || status=$?
      echo "   $((SECONDS - start)) s"
      head -n 1 "$log"
      grep FAILED "$log" | head -n 20 || true
      tail -n 1 "$log"
      [ "$status" -eq 0 ] || exit "$status"
    done
  done
}
# NEON build: armv8-a baseline, no SVE code at all.
run aarch64-neon "-DJSO_ENABLE_SVE=OFF -DCMAKE_CXX_FLAGS=-march=armv8-a" max,sve=off
# SVE build, as for Grace: SVE everywhere, checked at 128- and 512-bit vectors.
run aarch64-sve "-DJSO_ENABLE_SVE=ON -DCMAKE_CXX_FLAGS=-march=armv8.2-a+sve" max,sve128=on max,sve512=on
