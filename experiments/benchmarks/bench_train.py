"""Whole training steps of the trainer, superoffload vs optax vs device Adam.

Builds the trainer's model, optimizer and jitted, donated train step
(`experiments.trainer.train.make_train_step`) for each optimizer at each model
size, all in one process, then times them in interleaved rounds (one step
of each per round), so that the machine's noise hits every candidate
alike. Reports the median step time per candidate, the ratio optax /
superoffload (above 1: superoffload is faster), and the bytes per parameter
each keeps in host and in device memory. Beside the times, two
deterministic proxies that a noisy machine does not blur: the compiled
step's temporary memory (`memory_analysis()`) and the minor page faults per
step (`getrusage`), which grow when XLA:CPU maps large temporaries afresh
every step.

  python -m experiments.benchmarks.bench_train [--sizes 5m,19m] [--rounds 15]
  python -m experiments.benchmarks.bench_train --sizes 19m \
    --optimizers superoffload,superoffload_stv,superoffload_stv_redo

`superoffload_stv` arms speculation-then-validation (clip_norm 1e6, never
reached, and skip_nonfinite); `superoffload_stv_redo` clips every step
(clip_norm 1e-6), so every step pays the redo.

Writes `results/bench_train.json` (or `--out`) beside the printed table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import resource
import time
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from experiments.sweeps.report import fmt
from experiments.sweeps.report import markdown_table
from experiments.trainer import config as config_lib
from experiments.trainer import model as model_lib
from experiments.trainer import perf
from experiments.trainer import train

# Model shapes (byte vocabulary, tied embeddings): ~12 * layers * d_model**2.
SIZES = {
  '5m': dict(d_model=256, num_layers=6, num_heads=4, mlp_dim=1024),
  '19m': dict(d_model=512, num_layers=6, num_heads=8, mlp_dim=2048),
  '50m': dict(d_model=768, num_layers=7, num_heads=12, mlp_dim=3072),
}
OPTIMIZERS = ('superoffload', 'optax', 'device')
# Candidates beyond the trainer's optimizers: (optimizer, config overrides).
VARIANTS = {
  'superoffload_stv': (
    'superoffload',
    dict(clip_norm=1e6, skip_nonfinite=True),
  ),
  'superoffload_stv_redo': (
    'superoffload',
    dict(clip_norm=1e-6, skip_nonfinite=True),
  ),
}


def _build(size, name, batch, seq_len, bucket_mib):
  optimizer, overrides = VARIANTS.get(name, (name, {}))
  cfg = config_lib.get_config(
    'small',
    optimizer=optimizer,
    **overrides,
    bucket_mib=bucket_mib,
    batch_size=batch,
    seq_len=seq_len,
    warmup_steps=2,
    steps=1000,
    **SIZES[size],
  )
  mesh = train.make_mesh(cfg)
  model = model_lib.init_model(cfg)
  train.place_on_mesh(mesh, model)
  tx = train.make_optimizer(cfg, train.make_schedule(cfg), mesh)
  opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
  train.place_on_mesh(mesh, model, opt)
  step = train.make_train_step(model, opt, mesh)
  state = nnx.state((model, opt))
  sharding = NamedSharding(mesh, P(train.DATA_AXIS, train.SEQ_AXIS))
  tokens = np.random.default_rng(0).integers(0, 256, (batch, seq_len + 1))
  inputs = jax.device_put(tokens[:, :-1].astype(np.int32), sharding)
  targets = jax.device_put(tokens[:, 1:].astype(np.int32), sharding)
  num_params = model_lib.count_params(model)
  by_kind = perf.bytes_by_memory_kind(state, jax.devices()[0])
  memory = step.lower(state, inputs, targets).compile().memory_analysis()
  return {
    'temp_mb': memory.temp_size_in_bytes / 2**20,
    'step': step,
    'state': state,
    'batch': (inputs, targets),
    'num_params': num_params,
    'host_bytes_per_param': by_kind['host'] / num_params,
    'device_bytes_per_param': by_kind['device'] / num_params,
  }


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--sizes', default='5m,19m')
  parser.add_argument('--optimizers', default=','.join(OPTIMIZERS))
  parser.add_argument('--batch', type=int, default=1)
  parser.add_argument('--seq-len', type=int, default=32)
  parser.add_argument('--rounds', type=int, default=15)
  parser.add_argument(
    '--bucket-mib', type=float, default=4.0, help='superoffload buckets'
  )
  parser.add_argument('--warmup', type=int, default=3)
  parser.add_argument('--out', default='results/bench_train.json')
  args = parser.parse_args()
  sizes = args.sizes.split(',')
  optimizers = args.optimizers.split(',')

  rows = []
  for size in sizes:
    cands = {
      o: _build(size, o, args.batch, args.seq_len, args.bucket_mib)
      for o in optimizers
    }
    for c in cands.values():  # Compile and settle.
      for _ in range(args.warmup):
        c['state'], metrics = c['step'](c['state'], *c['batch'])
        float(metrics['loss'])
    times = {o: [] for o in optimizers}
    faults = {o: 0 for o in optimizers}
    for _ in range(args.rounds):
      for o, c in cands.items():
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        c['state'], metrics = c['step'](c['state'], *c['batch'])
        float(metrics['loss'])
        times[o].append(time.perf_counter() - t0)
        faults[o] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    for o, c in cands.items():
      rows.append(
        {
          'size': size,
          'optimizer': o,
          'num_params': c['num_params'],
          'median_ms': 1e3 * float(np.median(times[o])),
          'times_ms': [1e3 * t for t in times[o]],
          'host_bytes_per_param': c['host_bytes_per_param'],
          'device_bytes_per_param': c['device_bytes_per_param'],
          'temp_mb': c['temp_mb'],
          'page_faults_per_step': faults[o] / args.rounds,
        }
      )
    del cands

  for row in rows:
    optax_ms = next(
      (
        r['median_ms']
        for r in rows
        if r['size'] == row['size'] and r['optimizer'] == 'optax'
      ),
      float('nan'),
    )
    plain_ms = next(
      (
        r['median_ms']
        for r in rows
        if r['size'] == row['size'] and r['optimizer'] == 'superoffload'
      ),
      float('nan'),
    )
    row['optax_over_this'] = optax_ms / row['median_ms']
    # Above 1: slower than the plain superoffload step (STV's cost).
    row['this_over_superoffload'] = row['median_ms'] / plain_ms
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(
    json.dumps(
      {
        'date': datetime.datetime.now(datetime.UTC).isoformat(
          timespec='seconds'
        ),
        'machine': platform.machine(),
        'cpu_count': os.cpu_count(),
        'jax': jax.__version__,
        'batch': args.batch,
        'seq_len': args.seq_len,
        'rounds': args.rounds,
        'bucket_mib': args.bucket_mib,
        'rows': rows,
      },
      indent=2,
    )
    + '\n'
  )
  print(report(json.loads(out.read_text()), out.parent))
  print(f'wrote {out}')
  return 0


def report(data: dict[str, Any], out_dir: pathlib.Path) -> str:
  """Markdown table of `results/bench_train.json` (`out_dir` unused)."""
  del out_dir  # No plot: one table says it all.
  table = markdown_table(
    [
      'model',
      'optimizer',
      'params',
      'median ms',
      'optax / this',
      'this / superoffload',
      'host B/param',
      'device B/param',
      'temp MB',
      'page faults / step',
    ],
    [
      [
        r['size'],
        r['optimizer'],
        fmt(r['num_params']),
        fmt(r['median_ms'], '.1f'),
        fmt(r.get('optax_over_this'), '.2f'),
        fmt(r.get('this_over_superoffload'), '.2f'),
        fmt(r['host_bytes_per_param'], '.1f'),
        fmt(r['device_bytes_per_param'], '.1f'),
        fmt(r.get('temp_mb'), '.1f'),
        fmt(r.get('page_faults_per_step'), ',.0f'),
      ]
      for r in data['rows']
    ],
  )
  return '\n'.join(
    [
      '## A whole training step (`results/bench_train.json`)',
      '',
      f'Batch {data["batch"]} x {data["seq_len"]} tokens, medians of '
      f'{data["rounds"]} interleaved rounds; {data.get("date", "?")}, '
      f'{data.get("cpu_count", "?")} CPUs, jax {data.get("jax", "?")}.',
      '',
      table,
    ]
  )


if __name__ == '__main__':
  raise SystemExit(main())
