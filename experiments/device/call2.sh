#!/usr/bin/env bash
# Device call 2, right after call 1 while the machine is warm: the whole
# optimizer step on the GPU (bench_step: one leaf and 640 leaves, ffi and
# xla_host), then gpu_bench within a budget. On 2026-12-04, with
# BENCH_STEP_S=200 GPU_BENCH_S=280 GPU_BENCH_BUDGET=190, it took 349 s.
set -u
export PYTHONUNBUFFERED=1
cp .gpu/_grace_adam*.so jax_superoffload/
LOG=$OUT/log2.txt
{
  date -u
  echo "== bench_step (GPU)"
  SECONDS=0
  timeout ${BENCH_STEP_S:-170} python3 -m experiments.benchmarks.bench_step --reps 5 --only "${BENCH_STEP_ONLY:-superoffload ffi,superoffload xla_host}" --out $OUT/bench_step_gpu.json
  echo "== bench_step rc=$? ${SECONDS}s"
  echo "== gpu_bench"
  SECONDS=0
  timeout ${GPU_BENCH_S:-200} python3 -m experiments.benchmarks.gpu_bench --budget-s ${GPU_BENCH_BUDGET:-120} --out $OUT/gpu_bench.json
  echo "== gpu_bench rc=$? ${SECONDS}s"
} 2>&1 | tee $LOG
