#!/usr/bin/env bash
# Checks the aarch64 wheel that .ci/build_wheel.sh cross-built. There is no
# aarch64 Python here to import it, so this checks what can be checked:
# - the wheel: `auditwheel show` (tag, external symbol versions), and that
#   its module is an aarch64 ELF (readelf -h) exporting PyInit__grace_adam
#   and holding the same code and data as the one in the build tree;
# - the kernel: the C++ tests of that build tree (the same Zig toolchain for
#   glibc 2.27, same flags, linked against the same kernel archive and the
#   same static libstdc++ as the wheel's module) run under qemu-user, on
#   Debian's aarch64 glibc (newer than the 2.27 they target), with --quick, on a CPU without SVE (the NEON path), with
#   128-bit SVE (Grace's vector length; the SVE path, chosen at run time as
#   on the real machine) and with 512-bit SVE (the widest the kernel's
#   predicated loops are checked at).
#
# This is CI's only aarch64 run: the wheel's build tree holds both paths, so
# separate NEON and SVE builds (.ci/aarch64_qemu.sh) would compile and test
# the same kernel again.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEEL_DIR="${WHEEL_DIR:-dist}"
tree=build/wheel-aarch64
if ! command -v qemu-aarch64 >/dev/null; then
  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q qemu-user
fi
wheel="$(ls "$WHEEL_DIR"/jax_superoffload-*_aarch64.whl)"
echo "== $wheel ($(stat -c %s "$wheel") bytes)"
build/wheel-venv/bin/auditwheel show "$wheel"

unpacked=build/wheel-aarch64-unpacked
rm -rf "$unpacked"
build/wheel-venv/bin/python -m zipfile -e "$wheel" "$unpacked"
module="$(ls "$unpacked"/jax_superoffload/_grace_adam*.so)"
readelf -h "$module" | grep -E 'Class|Machine'
readelf -h "$module" | grep -q 'Machine: *AArch64'
readelf -d "$module" | grep NEEDED
readelf --dyn-syms -W "$module" | grep -w PyInit__grace_adam >/dev/null
# The install step strips the module (scikit-build-core's install.strip),
# which drops the linker's .comment: the code and data must be the same.
for section in .text .rodata .data.rel.ro .data; do
  for file in "$module" "$tree/$(basename "$module")"; do
    aarch64-linux-gnu-objcopy -O binary --only-section="$section" "$file" \
      "$file$section"
  done
  cmp "$module$section" "$tree/$(basename "$module")$section"
done
echo "wheel module == $tree/$(basename "$module") (code and data)"

for cpu in max,sve=off max,sve128=on max,sve512=on; do
  for test in adam_kernel_test lowp_moments_test moments_vectors_test; do
    echo "== $test on qemu -cpu $cpu"
    log="$tree/$test-${cpu//[,=]/_}.log" status=0 start=$SECONDS
    qemu-aarch64 -L /usr/aarch64-linux-gnu -cpu "$cpu" \
      "$tree/xla_ffi/$test" --quick >"$log" 2>&1 || status=$?
    echo "   $((SECONDS - start)) s"
    head -n 1 "$log"
    grep FAILED "$log" | head -n 20 || true
    tail -n 1 "$log"
    [ "$status" -eq 0 ] || exit "$status"
  done
done
