"""Grace Adam vs its peers on one AdamW step over 64M fp32 parameters.

Candidates run alternately in one process, `--reps` times each, and the table
reports medians. Ratios are the numbers to read: absolute times on a shared
2-core machine move from run to run, ratios taken in the same run do not.

  python -m experiments.bench_adam [--params 67108864] [--reps 15]

Writes `results/bench_adam.json` (or `--out`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments.report import fmt
from experiments.report import markdown_table
from experiments.report import plt
from jax_superoffload import kernels
from jax_superoffload._src import grace_adam as grace_adam_ffi

LR = 1e-3
WEIGHT_DECAY = 0.01
# One fp32 AdamW step reads param, grad, mu, nu and writes param, mu, nu.
BYTES_PER_PARAM = 28
# With the fused bf16 copy of the new weights: 2 more bytes written.
BYTES_PER_PARAM_LOWP = 30


@dataclasses.dataclass
class Candidate:
  """A benchmarked implementation: `step()` runs one step and waits for it."""

  name: str
  step: Callable[[], None]
  bytes_per_param: int
  group: str  # Which baseline the candidate is compared with.


def _state(n: int, seed: int) -> tuple[np.ndarray, ...]:
  rng = np.random.default_rng(seed)
  params = rng.standard_normal(n, dtype=np.float32)
  grads = rng.standard_normal(n, dtype=np.float32) * 1e-2
  return params, grads


def _stepper(step, state: list[jax.Array], grad: jax.Array):
  """Runs a donated kernel step on (master, mu, nu) in place, counting."""
  count = [0]

  def run():
    out = step(state[0], state[1], state[2], grad, jnp.int32(count[0]))
    jax.block_until_ready(out)
    state[0], state[1], state[2] = out[0], out[1], out[2]
    count[0] += 1

  return run


def grace_adam(n: int, lowp: bool) -> Callable[[], None]:
  params, grads = _state(n, 0)
  state = [
    jnp.asarray(params),
    jnp.zeros(n, jnp.float32),
    jnp.zeros(n, jnp.float32),
  ]
  grad = jnp.asarray(grads)

  @jax.jit
  def step(master, mu, nu, grad, count):
    return kernels.adam_step(
      master,
      grad,
      mu,
      nu,
      count=count,
      learning_rate=LR,
      weight_decay=WEIGHT_DECAY,
      lowp_dtype=jnp.bfloat16 if lowp else None,
    )

  step = jax.jit(step.__wrapped__, donate_argnums=(0, 1, 2))
  return _stepper(step, state, grad)


def grace_adam_stv(n: int, sumsq: bool) -> Callable[[], None]:
  """The kernel call of an STV step: one bucket, keep_nonfinite.

  With `sumsq`, the sum of the squared gradients is taken in the same pass.
  """
  params, grads = _state(n, 0)
  state = [
    jnp.asarray(params),
    jnp.zeros(n, jnp.float32),
    jnp.zeros(n, jnp.float32),
  ]
  grad = jnp.asarray(grads)

  def step(master, mu, nu, grad, count):
    master, mu, nu, _, total = grace_adam_ffi.adam_step_segments(
      master,
      mu,
      nu,
      [grad],
      None,
      count=count,
      learning_rate=LR,
      b1=0.9,
      b2=0.999,
      eps=1e-8,
      eps_root=0.0,
      weight_decay=WEIGHT_DECAY,
      nesterov=False,
      keep_nonfinite=True,
      compute_sumsq=sumsq,
    )
    return master, mu, nu, total

  step = jax.jit(step, donate_argnums=(0, 1, 2))
  return _stepper(step, state, grad)


def optax_adamw(n: int, lowp: bool) -> Callable[[], None]:
  params, grads = _state(n, 0)
  tx = optax.adamw(LR, weight_decay=WEIGHT_DECAY)
  p = jnp.asarray(params)
  box = [p, tx.init(p)]
  grad = jnp.asarray(grads)

  def step(params, opt_state, grad):
    updates, opt_state = tx.update(grad, opt_state, params)
    params = optax.apply_updates(params, updates)
    if lowp:
      return params, opt_state, params.astype(jnp.bfloat16)
    return params, opt_state

  step = jax.jit(step, donate_argnums=(0, 1))

  def run():
    out = step(box[0], box[1], grad)
    jax.block_until_ready(out)
    box[0], box[1] = out[0], out[1]

  return run


def roofline(n: int) -> Callable[[], None]:
  params, grads = _state(n, 0)
  state = [
    jnp.asarray(params),
    jnp.zeros(n, jnp.float32),
    jnp.ones(n, jnp.float32),
  ]
  grad = jnp.asarray(grads)
  step = jax.jit(kernels.stream_roofline, donate_argnums=(0, 2, 3))

  def run():
    out = step(state[0], grad, state[1], state[2])
    jax.block_until_ready(out)
    state[0], state[1], state[2] = out

  return run


def torch_candidates(n: int) -> list[Candidate]:
  """PyTorch fused AdamW and DeepSpeed's CPU Adam, when installed."""
  try:
    import torch
  except ImportError:
    return []
  params, grads = _state(n, 0)
  out = []

  def make(optimizer_factory):
    p = torch.nn.Parameter(torch.from_numpy(params.copy()))
    p.grad = torch.from_numpy(grads.copy())
    opt = optimizer_factory([p])
    return lambda: opt.step()

  out.append(
    Candidate(
      'torch AdamW(fused=True)',
      make(
        lambda ps: torch.optim.AdamW(
          ps, lr=LR, weight_decay=WEIGHT_DECAY, fused=True
        )
      ),
      BYTES_PER_PARAM,
      'peer',
    )
  )
  try:
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    out.append(
      Candidate(
        'DeepSpeedCPUAdam',
        make(
          lambda ps: DeepSpeedCPUAdam(
            ps, lr=LR, weight_decay=WEIGHT_DECAY, adamw_mode=True
          )
        ),
        BYTES_PER_PARAM,
        'peer',
      )
    )
  except Exception as e:
    print(f'DeepSpeedCPUAdam unavailable: {type(e).__name__}: {e}')
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--params', type=int, default=64 * 2**20)
  parser.add_argument('--reps', type=int, default=15)
  parser.add_argument('--warmup', type=int, default=3)
  parser.add_argument('--out', default='results/bench_adam.json')
  args = parser.parse_args()
  n = args.params

  candidates = [
    Candidate(
      'roofline (same bytes, no math)', roofline(n), BYTES_PER_PARAM, 'roofline'
    ),
    Candidate(
      'grace adam (kernels.adam_step, jit)',
      grace_adam(n, False),
      BYTES_PER_PARAM,
      'ours',
    ),
    Candidate(
      'optax.adamw (jit, donated)',
      optax_adamw(n, False),
      BYTES_PER_PARAM,
      'optax',
    ),
    Candidate(
      'grace adam + fused bf16 copy',
      grace_adam(n, True),
      BYTES_PER_PARAM_LOWP,
      'ours_lowp',
    ),
    Candidate(
      'optax.adamw then cast to bf16',
      optax_adamw(n, True),
      BYTES_PER_PARAM_LOWP,
      'optax_lowp',
    ),
    Candidate(
      'grace adam, STV step (keep_nonfinite)',
      grace_adam_stv(n, False),
      BYTES_PER_PARAM,
      'ours_stv',
    ),
    Candidate(
      'grace adam, STV step + sum of squares',
      grace_adam_stv(n, True),
      BYTES_PER_PARAM,
      'ours_stv_sumsq',
    ),
    *torch_candidates(n),
  ]
  for c in candidates:
    for _ in range(args.warmup):
      c.step()
  times = {c.name: [] for c in candidates}
  for rep in range(args.reps):
    # Alternate the order so no candidate always follows the same one.
    order = candidates if rep % 2 == 0 else candidates[::-1]
    for c in order:
      start = time.perf_counter()
      c.step()
      times[c.name].append(time.perf_counter() - start)

  median = {name: statistics.median(t) for name, t in times.items()}
  by_group = {c.group: c.name for c in candidates}
  roof = median[by_group['roofline']]
  rows = []
  for c in candidates:
    m = median[c.name]
    rows.append(
      {
        'name': c.name,
        'median_s': m,
        'mparam_per_s': n / m / 1e6,
        'gb_per_s': n * c.bytes_per_param / m / 1e9,
        'vs_roofline': roof / m * c.bytes_per_param / BYTES_PER_PARAM,
        'times_s': times[c.name],
      }
    )
  speedups = {
    'ours_vs_roofline': roof / median[by_group['ours']],
    'ours_vs_optax': median[by_group['optax']] / median[by_group['ours']],
    'optax_vs_roofline': roof / median[by_group['optax']],
    'ours_lowp_vs_optax_then_cast': (
      median[by_group['optax_lowp']] / median[by_group['ours_lowp']]
    ),
    # What the fused sum of squares costs the STV step (1.0: nothing).
    'stv_sumsq_over_stv_step': (
      median[by_group['ours_stv_sumsq']] / median[by_group['ours_stv']]
    ),
  }
  peers = [c.name for c in candidates if c.group == 'peer']
  if peers:
    fastest_peer = min(peers, key=lambda name: median[name])
    speedups['fastest_peer'] = fastest_peer
    speedups['ours_vs_fastest_peer'] = (
      median[fastest_peer] / median[by_group['ours']]
    )

  print(
    f'\nAdamW step, {n / 1e6:.1f}M fp32 params, median of {args.reps} '
    f'(kernel ISA: {kernels.instruction_set()}, {os.cpu_count()} cpus)'
  )
  print(
    f'{"candidate":40s} {"ms":>8s} {"Mparam/s":>9s} {"GB/s":>6s} {"x roof":>7s}'
  )
  for r in rows:
    print(
      f'{r["name"]:40s} {r["median_s"] * 1e3:8.1f} '
      f'{r["mparam_per_s"]:9.0f} {r["gb_per_s"]:6.1f} '
      f'{r["vs_roofline"]:7.2f}'
    )
  for k, v in speedups.items():
    print(f'{k}: {v:.3f}' if isinstance(v, float) else f'{k}: {v}')

  result = {
    'benchmark': 'bench_adam',
    'date': datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds'),
    'machine': {
      'platform': platform.platform(),
      'processor': platform.processor() or platform.machine(),
      'cpus': os.cpu_count(),
      'jax': jax.__version__,
      'kernel_isa': kernels.instruction_set(),
    },
    'params': n,
    'reps': args.reps,
    'rows': rows,
    'ratios': speedups,
  }
  os.makedirs(os.path.dirname(args.out) or '.', exist_ok=True)
  with open(args.out, 'w') as f:
    json.dump(result, f, indent=1)
  print(f'wrote {args.out}')


def report(data: dict[str, Any], out_dir: pathlib.Path) -> str:
  """Table and bar chart of `results/bench_adam.json`."""
  rows = data['rows']
  table = markdown_table(
    ['candidate', 'median ms', 'Mparam/s', 'vs roofline'],
    [
      [
        r['name'],
        fmt(1e3 * r['median_s'], '.1f'),
        fmt(r['mparam_per_s']),
        fmt(r['vs_roofline'], '.2f'),
      ]
      for r in rows
    ],
  )
  ratios = data.get('ratios', {})
  fig, ax = plt.subplots(figsize=(9, 4.2))
  names = [r['name'] for r in rows]
  values = [r['mparam_per_s'] for r in rows]
  colors = [
    'tab:gray'
    if 'roofline' in n
    else 'tab:blue'
    if n.startswith('grace')
    else 'tab:orange'
    for n in names
  ]
  bars = ax.barh(names[::-1], values[::-1], color=colors[::-1])
  ax.bar_label(bars, fmt='%.0f', fontsize=8)
  ax.set_xlabel('Mparam/s (higher is better)')
  ax.set_title(
    f'One AdamW step over {data["params"] / 1e6:.0f}M fp32 params '
    f'(median of {data["reps"]})'
  )
  ax.grid(True, axis='x', alpha=0.3)
  fig.tight_layout()
  fig.savefig(out_dir / 'bench_adam.png', dpi=110)
  plt.close(fig)
  machine = data.get('machine', {})
  lines = [
    '## Grace Adam vs its peers (`results/bench_adam.json`)',
    '',
    f'One AdamW step over {data["params"]:,} fp32 parameters, median of '
    f'{data["reps"]}; {data.get("date", "?")}, {machine.get("cpus", "?")} '
    f'CPUs, kernel ISA {machine.get("kernel_isa", "?")}, jax '
    f'{machine.get("jax", "?")}.',
    '',
    table,
    '',
    f'Grace Adam / optax.adamw: {fmt(ratios.get("ours_vs_optax"), ".2f")}x; '
    f'Grace Adam / fastest peer ({ratios.get("fastest_peer", "?")}): '
    f'{fmt(ratios.get("ours_vs_fastest_peer"), ".2f")}x.',
    '',
    '![bench_adam](bench_adam.png)',
  ]
  return '\n'.join(lines)


if __name__ == '__main__':
  main()
