"""Longest sequence one training step fits, with and without Ulysses.

A training step (forward, backward and an SGD update) of one causal
self-attention block (`x + attn(x @ Wq, x @ Wk, x @ Wv) @ Wo`, mean-square
loss) runs on 8 fake CPU devices in two layouts:

- `no-sp`: no sequence parallelism; data parallel with one whole sequence
  per device (global batch 8, sharded over a `data` axis).
- `ulysses-8`: one sequence sharded 8 ways over a `seq` axis, attention
  through `jax_superoffload.ulysses.attention`.

For each layout, the sequence length doubles from `--start` while the
compiled step's per-device memory (`memory_analysis()`: arguments + outputs
+ temporaries - aliased) times 8 stays under `--budget-gib`, then bisects
between the last fit and the first miss down to `--granularity`. The longest
fitting step then runs once, and the process's peak resident memory during
that run is reported next to the estimate. XLA's CPU attention materialises
the `S x S` logits, so memory is quadratic in S and 8-way Ulysses, holding
1/8 of the heads per device, should reach about sqrt(8) = 2.8x longer.

  python -m experiments.benchmarks.bench_ulysses [--budget-gib 16] [--heads 8]

Writes `results/bench_ulysses.json` (or `--out`).
"""

# ruff: noqa: N803, N806

from __future__ import annotations

import os

os.environ['XLA_FLAGS'] = (
  os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8'
).strip()

import argparse
import dataclasses
import datetime
import functools
import json
import platform
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jax.sharding import NamedSharding

from jax_superoffload import ulysses

DEVICES = 8
GIB = 2**30
LEARNING_RATE = 1e-3


@dataclasses.dataclass
class Config:
  """Benchmark settings."""

  budget_gib: float = 16.0  # Memory budget for all 8 devices together.
  heads: int = 8  # Attention heads H.
  head_dim: int = 64  # Head dimension D; the model width is H * D.
  start: int = 1024  # First sequence length tried.
  granularity: int = 1024  # Bisection stops at this sequence-length step.
  run: bool = True  # Run the longest fitting step once to confirm.
  out: str = 'results/bench_ulysses.json'  # Where the JSON goes.


@dataclasses.dataclass
class Layout:
  """A way of placing the step on the 8 devices."""

  name: str
  mesh: jax.sharding.Mesh
  batch: int  # Global batch of sequences.
  x_spec: jax.P  # Sharding of the [B, S, E] activations.
  attend: Callable[..., jax.Array]  # (q, k, v) -> out, [B, S, H, D] each.


def _layouts() -> list[Layout]:
  auto = (AxisType.Auto,)
  data = jax.make_mesh((DEVICES,), ('data',), axis_types=auto)
  seq = jax.make_mesh((DEVICES,), ('seq',), axis_types=auto)
  return [
    Layout(
      'no-sp',
      data,
      DEVICES,
      jax.P('data'),
      functools.partial(jax.nn.dot_product_attention, is_causal=True),
    ),
    Layout(
      'ulysses-8',
      seq,
      1,
      jax.P(None, 'seq'),
      functools.partial(ulysses.attention, mesh=seq, axis='seq', causal=True),
    ),
  ]


def _init_params(E: int) -> dict[str, jax.Array]:
  keys = jax.random.split(jax.random.key(0), 4)
  return {
    name: jax.random.normal(key, (E, E), jnp.float32) / np.sqrt(E)
    for name, key in zip(('wq', 'wk', 'wv', 'wo'), keys, strict=True)
  }


def _loss(params, x_BxSxE, attend, H):
  B, S, E = x_BxSxE.shape

  def heads(w):
    return (x_BxSxE @ w).reshape(B, S, H, E // H)

  out_BxSxHxD = attend(
    heads(params['wq']), heads(params['wk']), heads(params['wv'])
  )
  y_BxSxE = x_BxSxE + out_BxSxHxD.reshape(B, S, E) @ params['wo']
  return jnp.mean(jnp.square(y_BxSxE))


def _compile(layout: Layout, cfg: Config, S: int):
  """The jitted training step for sequence length S, compiled."""
  E = cfg.heads * cfg.head_dim
  x_sharding = NamedSharding(layout.mesh, layout.x_spec)
  p_sharding = NamedSharding(layout.mesh, jax.P())

  def step(params, x_BxSxE):
    loss, grads = jax.value_and_grad(_loss)(
      params, x_BxSxE, layout.attend, cfg.heads
    )
    params = jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)
    return params, loss

  params = jax.ShapeDtypeStruct((E, E), jnp.float32, sharding=p_sharding)
  x = jax.ShapeDtypeStruct(
    (layout.batch, S, E), jnp.float32, sharding=x_sharding
  )
  abstract_params = dict.fromkeys(('wq', 'wk', 'wv', 'wo'), params)
  return (
    jax.jit(step, donate_argnums=0, out_shardings=(p_sharding, None))
    .lower(abstract_params, x)
    .compile()
  )


def _bytes_per_device(compiled) -> int:
  stats = compiled.memory_analysis()
  return (
    stats.argument_size_in_bytes
    + stats.output_size_in_bytes
    + stats.temp_size_in_bytes
    - stats.alias_size_in_bytes
  )


def _longest(layout: Layout, cfg: Config) -> tuple[int, int, list[dict]]:
  """Doubling then bisection over S; returns (S, bytes/device, trials)."""
  budget = cfg.budget_gib * GIB
  trials: list[dict] = []

  def fits(S: int) -> bool:
    t0 = time.perf_counter()
    nbytes = _bytes_per_device(_compile(layout, cfg, S))
    ok = nbytes * DEVICES <= budget
    trials.append(
      {
        'seq_len': S,
        'bytes_per_device': nbytes,
        'fits': ok,
        'compile_s': time.perf_counter() - t0,
      }
    )
    print(
      f'  {layout.name:10s} S={S:6d}: {nbytes * DEVICES / GIB:7.2f} GiB '
      f'on 8 devices ({"fits" if ok else "over"})',
      flush=True,
    )
    return ok

  if not fits(cfg.start):
    return 0, 0, trials
  good, bad = cfg.start, 2 * cfg.start
  while fits(bad):
    good, bad = bad, 2 * bad
  while bad - good > cfg.granularity:
    mid = (good + bad) // 2 // cfg.granularity * cfg.granularity
    if mid in (good, bad):
      break
    good, bad = (mid, bad) if fits(mid) else (good, mid)
  nbytes = next(t['bytes_per_device'] for t in trials if t['seq_len'] == good)
  return good, nbytes, trials


def _mem_available() -> int:
  with open('/proc/meminfo') as f:
    for line in f:
      if line.startswith('MemAvailable:'):
        return int(line.split()[1]) * 1024
  return 0


def _reset_peak_rss() -> bool:
  try:
    with open('/proc/self/clear_refs', 'w') as f:
      f.write('5')
    return True
  except OSError:
    return False


def _peak_rss() -> int:
  with open('/proc/self/status') as f:
    for line in f:
      if line.startswith('VmHWM:'):
        return int(line.split()[1]) * 1024
  return 0


def _run_once(layout: Layout, cfg: Config, S: int, nbytes: int) -> dict:
  """Runs the step at S once; skips it if the machine lacks the memory."""
  # Measured peaks ran up to ~25% above the compiled estimate on XLA:CPU.
  need, free = nbytes * DEVICES * 1.25 + GIB, _mem_available()
  if need > free:
    print(f'  skipped run: needs {need / GIB:.1f} GiB, {free / GIB:.1f} free')
    return {'ran': False, 'mem_available_bytes': free}
  compiled = _compile(layout, cfg, S)
  E = cfg.heads * cfg.head_dim
  params = jax.device_put(_init_params(E), NamedSharding(layout.mesh, jax.P()))
  x = jax.device_put(
    jax.random.normal(jax.random.key(1), (layout.batch, S, E), jnp.float32),
    NamedSharding(layout.mesh, layout.x_spec),
  )
  rss_before = _peak_rss() if _reset_peak_rss() else None
  t0 = time.perf_counter()
  _, loss = compiled(params, x)
  loss = float(loss)
  seconds = time.perf_counter() - t0
  return {
    'ran': True,
    'loss': loss,
    'finite': bool(np.isfinite(loss)),
    'step_s': seconds,
    'rss_before_bytes': rss_before,
    'peak_rss_bytes': _peak_rss() if rss_before is not None else None,
  }


def main(cfg: Config) -> dict:
  print(
    f'budget {cfg.budget_gib:g} GiB on {DEVICES} devices, H={cfg.heads}, '
    f'D={cfg.head_dim}, fp32, causal',
    flush=True,
  )
  rows = []
  for layout in _layouts():
    S, nbytes, trials = _longest(layout, cfg)
    run = _run_once(layout, cfg, S, nbytes) if cfg.run and S else {}
    rows.append(
      {
        'layout': layout.name,
        'batch': layout.batch,
        'max_seq_len': S,
        'bytes_per_device': nbytes,
        'estimated_total_bytes': nbytes * DEVICES,
        'run': run,
        'trials': trials,
      }
    )

  base = rows[0]['max_seq_len']
  print()
  print(
    f'{"layout":10s} {"max S":>7s} {"vs no-sp":>8s} {"GiB/dev":>8s} '
    f'{"GiB x8":>7s} {"peak RSS":>9s} {"step s":>7s}'
  )
  for row in rows:
    run = row['run']
    rss = run.get('peak_rss_bytes')
    print(
      f'{row["layout"]:10s} {row["max_seq_len"]:7d} '
      f'{row["max_seq_len"] / base if base else float("nan"):7.2f}x '
      f'{row["bytes_per_device"] / GIB:8.2f} '
      f'{row["estimated_total_bytes"] / GIB:7.2f} '
      f'{rss / GIB if rss else float("nan"):8.2f}G '
      f'{run.get("step_s", float("nan")):7.1f}'
    )
  result = {
    'benchmark': 'bench_ulysses',
    'date': datetime.datetime.now(datetime.UTC).isoformat(),
    'host': platform.node(),
    'jax': jax.__version__,
    'config': dataclasses.asdict(cfg),
    'rows': rows,
  }
  os.makedirs(os.path.dirname(cfg.out) or '.', exist_ok=True)
  with open(cfg.out, 'w') as f:
    json.dump(result, f, indent=2)
  print(f'\nwrote {cfg.out}')
  return result


def _parse() -> Config:
  defaults = Config()
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--budget-gib', type=float, default=defaults.budget_gib)
  parser.add_argument('--heads', type=int, default=defaults.heads)
  parser.add_argument('--head-dim', type=int, default=defaults.head_dim)
  parser.add_argument('--start', type=int, default=defaults.start)
  parser.add_argument('--granularity', type=int, default=defaults.granularity)
  parser.add_argument('--no-run', dest='run', action='store_false')
  parser.add_argument('--out', default=defaults.out)
  return Config(**vars(parser.parse_args()))


if __name__ == '__main__':
  main(_parse())
