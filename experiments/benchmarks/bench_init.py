"""`init` cost: superoffload.adamw vs optax.adamw on one large fp32 leaf.

Each candidate runs in a fresh process (peak RSS is per process), in
alternation, several times. A process records its RSS before the params
exist, makes the params, then times `tx.init(params)` until the state is
ready, and reports its peak RSS. The memory figure is

  (peak RSS - RSS before the params) / (bytes of params + bytes of state)

so 1.0 means init needed nothing beyond the params and the state it made.

  python -m experiments.benchmarks.bench_init [--params 300000000] [--reps 3]

Writes `results/bench_init.json` (or `--out`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import statistics
import subprocess
import sys
from typing import Any

from experiments.benchmarks import machine
from experiments.sweeps.report import markdown_table

CANDIDATES = ('optax', 'superoffload')

# Run in the child process: argv = candidate, number of params.
_CHILD = """
import resource, sys, time
import jax, jax.numpy as jnp, numpy as np, optax
import jax_superoffload as superoffload

def rss():
  with open('/proc/self/statm') as f:
    return int(f.read().split()[1]) * 4096

name, n = sys.argv[1], int(sys.argv[2])
tx = optax.adamw(1e-3) if name == 'optax' else superoffload.adamw(1e-3)
before = rss()
params = {'w': jax.block_until_ready(jnp.ones((n,), jnp.float32))}
start = time.perf_counter()
state = jax.block_until_ready(tx.init(params))
seconds = time.perf_counter() - start
state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(seconds, peak - before, 4 * n, state_bytes)
"""


def run_once(name: str, n: int) -> dict[str, float]:
  """One init in a fresh process."""
  child = subprocess.run(
    [sys.executable, '-c', _CHILD, name, str(n)],
    capture_output=True,
    text=True,
    check=True,
  )
  seconds, peak, params, state = child.stdout.split()[-4:]
  return {
    'seconds': float(seconds),
    'peak_bytes': float(peak),
    'params_bytes': float(params),
    'state_bytes': float(state),
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--params', type=int, default=300_000_000)
  parser.add_argument('--reps', type=int, default=3)
  parser.add_argument('--out', default='results/bench_init.json')
  args = parser.parse_args()
  runs: dict[str, list[dict[str, float]]] = {c: [] for c in CANDIDATES}
  for _ in range(args.reps):
    for name in CANDIDATES:
      runs[name].append(run_once(name, args.params))
  summary = {name: summarize(r) for name, r in runs.items()}
  data: dict[str, Any] = {
    'when': datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds'),
    'machine': machine.describe(),
    'params': args.params,
    'runs': runs,
    'summary': summary,
    'time_over_optax': summary['superoffload']['seconds']
    / summary['optax']['seconds'],
  }
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(data, indent=2))
  print(machine.headline(data['machine']))
  print(report(data))
  print(f'wrote {out}')


def summarize(runs: list[dict[str, float]]) -> dict[str, float]:
  """Medians over the runs, and the peak over params + state."""
  seconds = statistics.median(r['seconds'] for r in runs)
  ratio = statistics.median(
    r['peak_bytes'] / (r['params_bytes'] + r['state_bytes']) for r in runs
  )
  return {
    'seconds': seconds,
    'peak_over_params_and_state': ratio,
    'state_bytes': runs[0]['state_bytes'],
  }


def report(data: dict[str, Any]) -> str:
  """The summary as a Markdown table."""
  rows = [
    [
      name,
      f'{s["seconds"]:.2f}',
      f'{s["state_bytes"] / 2**30:.2f}',
      f'{s["peak_over_params_and_state"]:.2f}',
    ]
    for name, s in data['summary'].items()
  ]
  return markdown_table(
    ['optimizer', 'init s (median)', 'state GiB', 'peak / (params + state)'],
    rows,
  ) + (
    f'\n\nsuperoffload init time / optax: {data["time_over_optax"]:.2f}x '
    f'({data["params"]:,} fp32 params, one leaf, '
    f'{len(data["runs"]["optax"])} runs each)'
  )


if __name__ == '__main__':
  main()
