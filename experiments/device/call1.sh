#!/usr/bin/env bash
# Device call 1 (experiments/device/prepare.sh first, then the device tool's
# run with carry [".gpu"]: `bash experiments/device/call1.sh`): the machine,
# Grace Adam on its host CPU (bench_adam on the CPU backend), then gpu_check
# on the GPU. Each part is bounded by `timeout`; the logs and JSON land in
# $OUT. On 2026-12-04 it took 87 s on a warm H200 machine.
set -u
export PYTHONUNBUFFERED=1
cp .gpu/_grace_adam*.so jax_superoffload/
LOG=$OUT/log1.txt
{
  date -u; nvidia-smi -L; nproc; free -g | head -2
  lscpu | grep -E 'Model name|Socket|Thread|Core|NUMA|L3|Flags' | cut -c1-400
  python3 -c 'import sys, jax, optax, flax; print(sys.version.split()[0], jax.__version__, optax.__version__, flax.__version__, jax.devices())'
  python3 -c 'from jax_superoffload import kernels; print("isa", kernels.instruction_set())'
  echo "== bench_adam (CPU backend, host cores)"
  SECONDS=0
  JAX_PLATFORMS=cpu timeout ${BENCH_ADAM_S:-180} python3 -m experiments.benchmarks.bench_adam --reps 11 --out $OUT/bench_adam_h200host.json
  echo "== bench_adam rc=$? ${SECONDS}s"
  echo "== gpu_check"
  SECONDS=0
  timeout ${GPU_CHECK_S:-200} python3 -m experiments.benchmarks.gpu_check --attempt-timeout 75 --out $OUT/gpu_check.json
  echo "== gpu_check rc=$? ${SECONDS}s"
  # The kernel's own helper threads (the default where XLA's pool has one
  # thread) against the pool alone: the ffi attempt's step time, both ways.
  for threads in "" 1; do
    echo "== gpu_check --attempt ffi, JAX_SUPEROFFLOAD_HOST_THREADS='$threads'"
    JAX_SUPEROFFLOAD_HOST_THREADS=$threads timeout 120 python3 -m experiments.benchmarks.gpu_check --attempt ffi \
      | python3 -c 'import json, sys; r = [l for l in sys.stdin if l.startswith("GPU_CHECK_RESULT ")]; print(json.loads(r[-1].split(" ", 1)[1]).get("timing", {}).get("median_s") if r else "no result")'
  done
} 2>&1 | tee $LOG
