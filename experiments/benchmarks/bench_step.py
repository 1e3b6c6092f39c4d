"""A whole optimizer step: superoffload (each executor) vs optax.adamw.

The step is `update` + `optax.apply_updates`, jitted with the parameters and
the optimizer state donated, on one 64M-parameter leaf and on 640 leaves
holding the same 64M parameters. Each optimizer is timed beside optax.adamw
(and the STV variant beside the plain ffi step), candidates alternating,
medians; only those few are alive at once, so that a dozen 64M-parameter
candidates do not crowd the machine's memory and skew each other.

  python -m experiments.benchmarks.bench_step [--params 67108864] [--leaves 640]
      [--leaf-multiple 16] [--moments fp32|bf16|8bit]

64M split into 640 leaves gives odd leaf sizes (104,857 and 104,858), which
XLA:CPU handles far worse than even ones (optax.adamw: 1.9-2.5x one leaf
with odd sizes, 1.04x with sizes that are multiples of 16);
`--leaf-multiple 16` measures the even case. `--moments` stores the
superoffload moments in bf16 or 8 bits (optax.adamw keeps fp32 ones).

Writes `results/bench_step.json` (or `--out`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

from experiments.benchmarks import machine
from experiments.sweeps.report import fmt
from experiments.sweeps.report import markdown_table
from experiments.sweeps.report import plt
from experiments.trainer.optim import MOMENT_OPTIONS
from experiments.trainer.optim import offload_adamw


def leaf_sizes(n: int, leaves: int, multiple: int = 1) -> list[int]:
  """`leaves` nearly equal sizes, each a multiple of `multiple`, adding to n."""
  if n % multiple:
    raise ValueError(f'{n} parameters are not a multiple of {multiple}')
  units = n // multiple
  return [
    multiple * (units // leaves + (1 if i < units % leaves else 0))
    for i in range(leaves)
  ]


def make_tree(
  n: int, leaves: int, seed: int, multiple: int = 1
) -> dict[str, jax.Array]:
  """`leaves` leaves of (nearly) equal size holding `n` parameters in all."""
  rng = np.random.default_rng(seed)
  sizes = leaf_sizes(n, leaves, multiple)
  device = jax.devices()[0]
  return {
    f'leaf{i:04d}': jax.device_put(
      rng.standard_normal(size, dtype=np.float32) * 0.02, device
    )
    for i, size in enumerate(sizes)
  }


def candidate(
  tx: optax.GradientTransformation, n: int, leaves: int, multiple: int = 1
) -> Callable[[], None]:
  params = make_tree(n, leaves, 0, multiple)
  grads = jax.tree.map(lambda x: x * 1e-2, make_tree(n, leaves, 1, multiple))
  box = [params, tx.init(params)]

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(step, donate_argnums=(0, 1))

  def run():
    out = step(box[0], box[1], grads)
    jax.block_until_ready(out)
    box[0], box[1] = out

  return run


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--params', type=int, default=64 * 2**20)
  parser.add_argument('--leaves', type=int, default=640)
  parser.add_argument('--reps', type=int, default=9)
  parser.add_argument('--warmup', type=int, default=2)
  parser.add_argument(
    '--leaf-multiple',
    type=int,
    default=1,
    help='make every leaf size a multiple of this (default 1: n // leaves '
    'and one more for the first n %% leaves; 64M / 640 gives odd sizes)',
  )
  parser.add_argument(
    '--only',
    default='',
    help='comma-separated optimizers to time (default: all), e.g. '
    '"superoffload ffi"; each is still timed beside optax.adamw',
  )
  parser.add_argument('--moments', choices=list(MOMENT_OPTIONS), default='fp32')
  parser.add_argument('--out', default='results/bench_step.json')
  args = parser.parse_args()
  n = args.params
  moments = MOMENT_OPTIONS[args.moments]

  def ours(executor: str, **kw) -> optax.GradientTransformation:
    return offload_adamw(
      1e-3, weight_decay=0.01, executor=executor, **moments, **kw
    )

  optimizers = {
    'optax.adamw': lambda: optax.adamw(1e-3, weight_decay=0.01),
    'superoffload ffi': lambda: ours('ffi'),
    # Speculation-then-validation armed but never triggered: its cost.
    'superoffload ffi + STV': lambda: ours(
      'ffi', clip_norm=1e9, skip_nonfinite=True
    ),
    'superoffload xla_host': lambda: ours('xla_host'),
    'superoffload device': lambda: ours('device'),
  }
  layouts = {'1 leaf': 1, f'{args.leaves} leaves': args.leaves}
  one, many = layouts
  plain, stv = 'superoffload ffi', 'superoffload ffi + STV'

  def measure(names: list[str]) -> dict[tuple[str, str], list[float]]:
    """Times `names` at both layouts, interleaved, all alive together."""
    runs = {
      (name, layout_name): candidate(
        optimizers[name](), n, leaves, args.leaf_multiple
      )
      for name in names
      for layout_name, leaves in layouts.items()
    }
    for run in runs.values():
      for _ in range(args.warmup):
        run()
    times = {key: [] for key in runs}
    keys = list(runs)
    for rep in range(args.reps):
      for key in keys if rep % 2 == 0 else keys[::-1]:
        start = time.perf_counter()
        runs[key]()
        times[key].append(time.perf_counter() - start)
    return times

  # One group per optimizer, each beside optax.adamw (and STV beside the
  # plain ffi step): a few 64M-parameter candidates alive at a time, not
  # all of them, which would crowd this machine's memory.
  rows = []
  stv_cost = {}
  host = machine.describe()
  print(
    f'\nWhole AdamW step (update + apply_updates, jit, donated), '
    f'{n / 1e6:.1f}M fp32 params, {args.moments} moments, median of '
    f'{args.reps} '
    f'({many} of '
    f'{sorted(set(leaf_sizes(n, args.leaves, args.leaf_multiple)))} params)'
  )
  print(f'machine: {machine.headline(host)}')
  print(
    f'{"optimizer":24s} {"1 leaf ms":>10s} {many + " ms":>16s} '
    f'{"many/one":>9s} {"vs optax (1 leaf)":>18s}'
  )
  chosen = [x.strip() for x in args.only.split(',') if x.strip()]
  unknown = sorted(set(chosen) - set(optimizers))
  if unknown:
    parser.error(f'unknown {unknown}; choose from {list(optimizers)}')
  for name in chosen or optimizers:
    group = [name] if name == 'optax.adamw' else ['optax.adamw', name]
    if name == stv:
      group.insert(1, plain)
    times = measure(group)
    median = {key: statistics.median(t) for key, t in times.items()}
    base = median[('optax.adamw', one)]
    t1, tn = median[(name, one)], median[(name, many)]
    if name == stv:
      stv_cost = {
        layout_name: median[(stv, layout_name)] / median[(plain, layout_name)]
        for layout_name in layouts
      }
    rows.append(
      {
        'optimizer': name,
        'one_leaf_s': t1,
        'many_leaves_s': tn,
        'many_over_one': tn / t1,
        'speedup_vs_optax_one_leaf': base / t1,
        'measured_with': group,
        'times_one_s': times[(name, one)],
        'times_many_s': times[(name, many)],
      }
    )
    print(
      f'{name:24s} {t1 * 1e3:10.1f} {tn * 1e3:16.1f} {tn / t1:9.2f} '
      f'{base / t1:18.2f}'
    )
  print(
    'STV (never triggered) / plain ffi step: '
    + ', '.join(f'{k} {v:.3f}' for k, v in stv_cost.items())
  )
  result = {
    'benchmark': 'bench_step',
    'moments': args.moments,
    'stv_over_plain': stv_cost,
    'date': datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds'),
    'machine': {**host, 'backend': jax.default_backend()},
    'params': n,
    'leaves': args.leaves,
    'leaf_sizes': sorted(set(leaf_sizes(n, args.leaves, args.leaf_multiple))),
    'reps': args.reps,
    'rows': rows,
  }
  os.makedirs(os.path.dirname(args.out) or '.', exist_ok=True)
  with open(args.out, 'w') as f:
    json.dump(result, f, indent=1)
  print(f'wrote {args.out}')


def report(data: dict[str, Any], out_dir: pathlib.Path) -> str:
  """Table and grouped bars of `results/bench_step.json` (STV ablation)."""
  rows = data['rows']
  leaves = data.get('leaves', 'many')
  table = markdown_table(
    [
      'optimizer',
      '1 leaf ms',
      f'{leaves} leaves ms',
      f'{leaves} / 1',
      'vs optax (1 leaf)',
    ],
    [
      [
        r['optimizer'],
        fmt(1e3 * r['one_leaf_s'], '.1f'),
        fmt(1e3 * r['many_leaves_s'], '.1f'),
        fmt(r['many_over_one'], '.2f'),
        fmt(r['speedup_vs_optax_one_leaf'], '.2f'),
      ]
      for r in rows
    ],
  )
  stv = data.get('stv_over_plain', {})
  stv_text = ', '.join(f'{k}: {v:.2f}' for k, v in stv.items())
  fig, ax = plt.subplots(figsize=(10, 4.2))
  width = 0.38
  xs = range(len(rows))
  for k, (key, label) in enumerate(
    (('one_leaf_s', '1 leaf'), ('many_leaves_s', f'{leaves} leaves'))
  ):
    bars = ax.bar(
      [x + (k - 0.5) * width for x in xs],
      [1e3 * r[key] for r in rows],
      width,
      label=label,
    )
    ax.bar_label(bars, fmt='%.0f', fontsize=8)
  ax.set_xticks(list(xs), [r['optimizer'].replace(' + ', '\n+ ') for r in rows])
  ax.set_ylabel('median step ms (lower is better)')
  ax.set_title(
    f'update + apply_updates, {data["params"] / 1e6:.0f}M params, donated '
    f'(STV time / plain: {stv_text})'
  )
  ax.legend()
  ax.grid(True, axis='y', alpha=0.3)
  fig.tight_layout()
  fig.savefig(out_dir / 'bench_step.png', dpi=110)
  plt.close(fig)
  lines = [
    '## STV on/off and leaf count (`results/bench_step.json`)',
    '',
    f'`update` + `optax.apply_updates`, jitted and donated, '
    f'{data["params"]:,} fp32 parameters as 1 leaf and as {leaves} leaves, '
    f'median of {data["reps"]}; {data.get("date", "?")}. STV armed '
    f'(clip_norm set, never triggering) over plain ffi, time ratio: '
    f'{stv_text} (below 1: STV faster).',
    '',
    table,
    '',
    '![bench_step](bench_step.png)',
  ]
  return '\n'.join(lines)


if __name__ == '__main__':
  main()
