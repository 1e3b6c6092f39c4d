#!/usr/bin/env bash
# The prepared GPU command (experiments/device/prepare.sh first,
# then the device tool's run with carry [".gpu"]):
#   bash experiments/device/run.sh
# Each part runs in its own process under `timeout` (an abort is a finding,
# not the end); every PART_RESULT line goes to $OUT/parts.jsonl and the
# whole log to $OUT/log.txt. PARTS picks parts by name (default: DEFAULT
# below; `all`: every part; NAME:CASE[:DTYPE] for opt and profile,
# train:CASE:scan|noscan:BATCH, capacity:CASE[:MOMENTS]); --dry-run runs
# every part at tiny sizes on the CPU. PART_TIMEOUT_S bounds each part
# (default 120 s).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT="${OUT:-results/tmp/gpu_run}"
mkdir -p "$OUT"
DRY=""
if [[ "${1:-}" == "--dry-run" ]]; then DRY="--dry-run"; fi
# What prepare.sh carried (the extension, and the modules the image lacks),
# used only where the library or those modules do not import without it: a
# checkout with a working build keeps its own extension.
if [[ -d .gpu ]] && ! python3 -c 'import jax_superoffload, tqdm, ml_collections' 2>/dev/null
then
  cp .gpu/_grace_adam*.so jax_superoffload/
  export PYTHONPATH="$PWD/.gpu/site${PYTHONPATH:+:$PYTHONPATH}"
fi
# The default parts, most important first: the link, the 1B optimizer step
# and the 1B train step against optax at batch 8 (the overlap's targets),
# unrolled (where buckets can overlap the backward) then scanned (the rows
# started in the backward loop, then after it: overlap_scan's gain and
# its 0.87 GB; then the gradients consumed: the new weights back during
# the backward, overlap_scan's consume_gradients), STV's
# costs, a profile. Estimated 540 s on a warm H200 machine (estimates:
# process start ~8 s, opt parts ~25 s, unrolled train parts ~60 s,
# scanned ~40 s), a 9-minute budget: the last parts may be cut.
# PARTS=all adds the rest.
DEFAULT="link opt:stream train:stream:noscan:8 train:optax:noscan:8
train:stream:scan:8 train:stream+after-loop:scan:8 train:optax:scan:8
train:stream+held:scan:8
opt:optax opt:stream+stv
opt:stream+clip profile:stream train:stream:noscan:4 train:optax:noscan:4"
REST="opt:stream:bfloat16 opt:optax:bfloat16 opt:device opt:ffi
opt:device:bfloat16 train:stream:scan:4 train:optax:scan:4 profile:ffi
capacity:optax capacity:stream:8bit"
PARTS="${PARTS:-$DEFAULT}"
[[ "$PARTS" == all ]] && PARTS="$DEFAULT $REST"
LIMIT="${PART_TIMEOUT_S:-120}"
LOG="$OUT/log.txt"
{
  date -u
  nvidia-smi -L 2>/dev/null || echo "no nvidia-smi"
  python3 -c 'import sys, jax, optax, flax; print(sys.version.split()[0], jax.__version__, optax.__version__, flax.__version__, jax.devices())'
  for part in $PARTS; do
    IFS=: read -r name case third fourth <<<"$part"
    args=("$name")
    [[ -n "${case:-}" ]] && args+=("$case")
    if [[ "$name" == "train" ]]; then
      args+=(--layout "$third" --batch "$fourth")
    elif [[ "$name" == "capacity" && -n "${third:-}" ]]; then
      args+=(--moments "$third" --clip-norm 1.0)
    elif [[ -n "${third:-}" ]]; then
      args+=(--dtype "$third")
    fi
    echo "== $part"
    start=$SECONDS
    timeout "$LIMIT" python3 -m experiments.device.gpu_parts "${args[@]}" $DRY \
      2>&1 | tee -a "$OUT/part.tmp" | grep -v '^PART_RESULT' | tail -n 25
    grep '^PART_RESULT' "$OUT/part.tmp" | cut -c13- >>"$OUT/parts.jsonl"
    rm -f "$OUT/part.tmp"
    echo "== $part: $((SECONDS - start)) s"
  done
  date -u
} 2>&1 | tee "$LOG"
