"""Final loss with bf16 and 8-bit Adam moments against fp32 moments.

Reads the sweeps `experiments/sweeps/moments_demo.toml` and
`moments_19m.toml` (three seeds per format), and compares each format's
final loss (the trainer's mean of the last 10 steps), averaged over the
seeds, with fp32 moments' mean:

  python -m experiments.benchmarks.moments_quality \
    [--out results/moments_quality.json]

Bounds (the goal set for low-precision moments): within 1% of fp32's final
loss for bf16 and 2% for 8-bit.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
from typing import Any

SWEEPS = {
  'demo': 'results/sweep/moments_demo.jsonl',
  '19m': 'results/sweep/moments_19m.jsonl',
}
BOUNDS = {'bf16': 0.01, '8bit': 0.02}


def final_losses(path: pathlib.Path) -> dict[str, dict[int, float]]:
  """Per moment format, per seed: the final loss of the last ok run."""
  out: dict[str, dict[int, float]] = {}
  for line in path.read_text().splitlines():
    run = json.loads(line)
    if run.get('status') != 'ok':
      continue
    fmt, seed = run['grid']['optimizer_name'].rsplit('-s', 1)
    out.setdefault(fmt, {})[int(seed)] = run['summary']['final_loss']
  return out


def compare(losses: dict[str, dict[int, float]]) -> dict[str, Any]:
  """Mean final loss per format and its relative gap to fp32's."""
  base = statistics.mean(losses['fp32'].values())
  rows = {}
  for fmt, by_seed in losses.items():
    mean = statistics.mean(by_seed.values())
    gap = (mean - base) / base
    rows[fmt] = {
      'seeds': sorted(by_seed),
      'final_losses': [by_seed[s] for s in sorted(by_seed)],
      'mean': mean,
      'relative_gap': gap,
      'bound': BOUNDS.get(fmt),
      'holds': None if fmt not in BOUNDS else abs(gap) <= BOUNDS[fmt],
    }
  return rows


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--out', default='results/moments_quality.json')
  args = parser.parse_args()
  result = {}
  for name, path in SWEEPS.items():
    path = pathlib.Path(path)
    if not path.exists():
      print(f'{name}: {path} missing (run its sweep first)')
      continue
    result[name] = compare(final_losses(path))
    print(f'\n{name}: final loss (mean of the last 10 steps), per seed')
    print(f'{"moments":8s} {"seeds":>28s} {"mean":>8s} {"vs fp32":>8s}  bound')
    for fmt, r in result[name].items():
      seeds = ' '.join(f'{x:.4f}' for x in r['final_losses'])
      bound = '' if r['bound'] is None else f'{r["bound"]:.0%}'
      verdict = {None: '', True: 'holds', False: 'FAILS'}[r['holds']]
      print(
        f'{fmt:8s} {seeds:>28s} {r["mean"]:8.4f} '
        f'{r["relative_gap"]:+8.2%}  {bound} {verdict}'
      )
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=1) + '\n')
  print(f'wrote {out}')


if __name__ == '__main__':
  main()
