"""The CPU's peak FLOP/s for MFU: measured once per machine, read thereafter.

A CPU has no datasheet figure that XLA reaches, so its peak is the fastest
rate XLA's own matmul kernel (``jnp.dot`` of square matrices, jitted) was
seen to run on that CPU, per compute dtype. It is measured once, on an idle
machine, by this module's command, and recorded in ``results/cpu_peak.json``
under the CPU's key (its model name and CPU count, `cpu_key`); the trainer
only reads it (`recorded_peak`). A figure timed at start-up would change
with whatever else the machine is doing, and so would every MFU.

    python -m experiments.trainer.cpu_peak             # measures, records
    python -m experiments.trainer.cpu_peak --show      # what is recorded
"""

import argparse
import datetime
import json
import os
import pathlib
import platform
import time
from typing import Any

# Where the peaks are recorded, keyed by `cpu_key`.
RESULTS_FILE = pathlib.Path(__file__).resolve().parents[2] / 'results'
RESULTS_FILE = RESULTS_FILE / 'cpu_peak.json'
# Matrix sizes tried; the best rate over all of them is the peak.
SIZES = (256, 512, 1024)
DTYPES = ('float32', 'bfloat16', 'float16')


def cpu_model() -> str:
  """The CPU's model name (``/proc/cpuinfo``), or the platform's word."""
  try:
    with open('/proc/cpuinfo') as f:
      for line in f:
        key, _, value = line.partition(':')
        if key.strip() in ('model name', 'Model', 'cpu model'):
          return value.strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def cpu_key() -> str:
  """This machine's key in `RESULTS_FILE`: model name and CPU count."""
  return f'{cpu_model()} ({os.cpu_count()} CPUs)'


def read_results(path: pathlib.Path | None = None) -> dict[str, Any]:
  """The recorded peaks (an empty dict when there is no file)."""
  path = RESULTS_FILE if path is None else path
  if not path.exists():
    return {}
  return json.loads(path.read_text())


def recorded_peak(
  dtype: str, path: pathlib.Path | None = None
) -> tuple[float | None, str]:
  """This machine's recorded peak for `dtype`, and where it comes from.

  Args:
    dtype: The compute dtype ("float32", "bfloat16" or "float16").
    path: The results file (default `RESULTS_FILE`).

  Returns:
    ``(tflops, source)``: the peak in TFLOP/s, or None with a source that
    says how to record one.
  """
  path = RESULTS_FILE if path is None else path
  key = cpu_key()
  entry = read_results(path).get(key, {})
  name = _display(path)
  if dtype not in entry.get('tflops', {}):
    return None, (
      f'no {dtype} peak recorded for {key} in {name}: run python -m '
      'experiments.trainer.cpu_peak once, or set --config.peak_tflops'
    )
  return entry['tflops'][dtype], (
    f'{name}: {dtype} matmul peak of {key}, measured {entry["measured"]}'
  )


def _display(path: pathlib.Path) -> str:
  """`path` relative to the repository root where it is inside it."""
  try:
    return str(path.resolve().relative_to(RESULTS_FILE.parents[1]))
  except ValueError:
    return str(path)


def measure(dtype: str, seconds: float = 2.0) -> float:
  """The best rate of a jitted square matmul over `SIZES`, in TFLOP/s.

  Args:
    dtype: The dtype of both operands.
    seconds: Time spent per size.
  """
  import jax
  import jax.numpy as jnp

  device = jax.devices('cpu')[0]
  matmul = jax.jit(jnp.dot)
  best = 0.0
  for n in SIZES:
    a = jax.device_put(jnp.ones((n, n), dtype), device)
    matmul(a, a).block_until_ready()  # Compiles.
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
      t0 = time.perf_counter()
      matmul(a, a).block_until_ready()
      best = max(best, 2.0 * n**3 / (time.perf_counter() - t0) / 1e12)
  return best


def record(seconds: float, path: pathlib.Path | None = None) -> dict[str, Any]:
  """Measures every dtype of `DTYPES` and records them under `cpu_key`."""
  path = RESULTS_FILE if path is None else path
  entry = {
    'tflops': {dtype: measure(dtype, seconds) for dtype in DTYPES},
    'measured': datetime.datetime.now(datetime.UTC).strftime(
      '%Y-%m-%d %H:%M UTC'
    ),
    'how': f'best jitted jnp.dot of n x n, n in {list(SIZES)}, {seconds} s '
    'per size (experiments.trainer.cpu_peak)',
    'load_average_before': list(os.getloadavg()),
  }
  results = read_results(path)
  results[cpu_key()] = entry
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(results, indent=2, sort_keys=True) + '\n')
  return entry


def main() -> None:
  parser = argparse.ArgumentParser(
    description="Measures this CPU's matmul peak once and records it in "
    'results/cpu_peak.json, where the trainer reads its MFU peak. Run it '
    'on an otherwise idle machine.'
  )
  parser.add_argument('--seconds', type=float, default=3.0)
  parser.add_argument('--show', action='store_true', help='Print, no run.')
  args = parser.parse_args()
  if not args.show:
    record(args.seconds)
  print(json.dumps({cpu_key(): read_results().get(cpu_key())}, indent=2))


if __name__ == '__main__':
  main()
