"""Grace Adam vs its peers on one AdamW step over 64M fp32 parameters.

Candidates run alternately in one process, `--reps` times each, and the table
reports medians. Ratios are the numbers to read: absolute times on a shared
2-core machine move from run to run, ratios taken in the same run do not.

The limit is independent of the kernel: `stream_limit.c`, compiled here
apart from it, moves the same 28 B/param with no math in several ways
(plain, prefetch t0 or nta, streaming stores); the fastest is the limit.
Grace Adam also runs under each prefetch policy (the environment override),
so one run shows whether the default is right on this CPU.

  python -m experiments.benchmarks.bench_adam [--params 67108864] [--reps 15]

Writes `results/bench_adam.json` (or `--out`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_superoffload as superoffload
from experiments.benchmarks import machine
from experiments.benchmarks import stream_limit
from experiments.sweeps.report import fmt
from experiments.sweeps.report import markdown_table
from experiments.sweeps.report import plt
from jax_superoffload import kernels

LR = 1e-3
WEIGHT_DECAY = 0.01
# One fp32 AdamW step reads param, grad, mu, nu and writes param, mu, nu.
BYTES_PER_PARAM = 28
# With the fused bf16 copy of the new weights: 2 more bytes written.
BYTES_PER_PARAM_LOWP = 30
# STV's speculative step also writes the gradient it read, as fp32.
BYTES_PER_PARAM_STV = 32


@dataclasses.dataclass
class Candidate:
  """A benchmarked implementation: `step()` runs one step and waits for it."""

  name: str
  step: Callable[[], None]
  bytes_per_param: float
  group: str  # Which baseline the candidate is compared with.


def _state(n: int, seed: int) -> tuple[np.ndarray, ...]:
  rng = np.random.default_rng(seed)
  params = rng.standard_normal(n, dtype=np.float32)
  grads = rng.standard_normal(n, dtype=np.float32) * 1e-2
  return params, grads


def _hyper(count) -> superoffload.kernels.Hyperparams:
  """The benchmarks' step: AdamW with optax's defaults."""
  return superoffload.kernels.Hyperparams(
    count=count, learning_rate=LR, weight_decay=WEIGHT_DECAY
  )


def _stepper(step, state: list[jax.Array], grad: jax.Array):
  """Runs a donated kernel step on (master, mu, nu) in place, counting."""
  count = [0]

  def run():
    out = step(state[0], state[1], state[2], grad, jnp.int32(count[0]))
    jax.block_until_ready(out)
    state[0], state[1], state[2] = out[0], out[1], out[2]
    count[0] += 1

  return run


def _box_stepper(step, box: list, grad):
  """Runs step(*box, grad, count) on a donated `box`, keeping its results."""
  count = [0]

  def run():
    out = step(*box, grad, jnp.int32(count[0]))
    jax.block_until_ready(out)
    box[:] = out
    count[0] += 1

  return run


def grace_adam(n: int) -> Callable[[], None]:
  params, grads = _state(n, 0)
  state = [
    jnp.asarray(params),
    jnp.zeros(n, jnp.float32),
    jnp.zeros(n, jnp.float32),
  ]
  grad = jnp.asarray(grads)

  def step(master, mu, nu, grad, count):
    return kernels.adam_step(
      master,
      grad,
      mu,
      nu,
      count=count,
      learning_rate=LR,
      weight_decay=WEIGHT_DECAY,
    )

  step = jax.jit(step, donate_argnums=(0, 1, 2))
  return _stepper(step, state, grad)


def grace_adam_lowp(n: int) -> Callable[[], None]:
  """The step with a fused bf16 copy, written into a donated destination."""
  params, grads = _state(n, 0)
  box = [
    jnp.asarray(params),
    jnp.zeros(n, jnp.float32),
    jnp.zeros(n, jnp.float32),
    jnp.zeros(n, jnp.bfloat16),
  ]
  grad = jnp.asarray(grads)

  def step(master, mu, nu, lowp, grad, count):
    return kernels.adam_step(
      master,
      grad,
      mu,
      nu,
      count=count,
      learning_rate=LR,
      weight_decay=WEIGHT_DECAY,
      lowp_dtype=jnp.bfloat16,
      lowp_out=lowp,
    )

  step = jax.jit(step, donate_argnums=(0, 1, 2, 3))
  return _box_stepper(step, box, grad)


# Moment storage formats: (mu dtype, nu dtype, 8-bit blockwise).
MOMENT_FORMATS = {
  'bf16 mu': (jnp.bfloat16, jnp.float32, False),
  'bf16 moments': (jnp.bfloat16, jnp.bfloat16, False),
  '8-bit moments': (jnp.uint8, jnp.uint8, True),
}


def moment_bytes(name: str) -> tuple[float, float]:
  """(bytes moved per step, host bytes per param) of a moment format.

  Host bytes count what the paper's 16 B/param does: master, gradient, mu, nu
  (and 8-bit scales), 4 B each in fp32.
  """
  mu, nu, blockwise = MOMENT_FORMATS[name]
  state = jnp.dtype(mu).itemsize + jnp.dtype(nu).itemsize
  scales = 2 * 4 / superoffload.kernels.MOMENT_BLOCK if blockwise else 0.0
  return 12 + 2 * state + 2 * scales, 8 + state + scales


def grace_adam_moments(n: int, name: str) -> Callable[[], None]:
  """The step on low-precision moments, state donated and stepped in place."""
  params, grads = _state(n, 0)
  mu_t, nu_t, blockwise = MOMENT_FORMATS[name]
  box = [jnp.asarray(params), jnp.zeros(n, mu_t), jnp.zeros(n, nu_t)]
  if blockwise:
    box += [
      jnp.zeros(-(-n // superoffload.kernels.MOMENT_BLOCK), jnp.float32)
      for _ in range(2)
    ]
  grad = jnp.asarray(grads)

  def step(state, grad, count):
    master, mu, nu, *scales = state
    m, a, v, s, _, _ = superoffload.kernels.adam_step_lowp_segments(
      [master],
      [mu],
      [nu],
      ([scales[0]], [scales[1]]) if scales else None,
      [grad],
      None,
      _hyper(count),
    )
    return [m[0], a[0], v[0], *([s[0][0], s[1][0]] if s else [])]

  step = jax.jit(step, donate_argnums=(0,))
  count = [0]

  def run():
    out = step(box, grad, jnp.int32(count[0]))
    jax.block_until_ready(out)
    box[:] = out
    count[0] += 1

  return run


def with_prefetch(run: Callable[[], None], policy: str) -> Callable[[], None]:
  """`run` under another kernel prefetch policy (the environment override).

  The handlers read the variable on every call, and nothing else runs while
  a candidate does, so setting it around the call is enough.
  """

  def wrapped():
    os.environ['JAX_SUPEROFFLOAD_PREFETCH'] = policy
    try:
      run()
    finally:
      del os.environ['JAX_SUPEROFFLOAD_PREFETCH']

  return wrapped


def grace_adam_stv(n: int) -> Callable[[], None]:
  """STV's speculative kernel call on one double-buffered bucket.

  Reads the current row, writes the other (rows flip each step, as when
  validation accepts), keeps the gradient as fp32 and sums its squares:
  32 B/param, the extra 4 being the kept gradient.
  """
  params, grads = _state(n, 0)
  box = [
    jnp.asarray(np.stack([params, params])),  # Two rows of one leaf.
    jnp.zeros((2, n), jnp.float32),
    jnp.zeros((2, n), jnp.float32),
    jnp.zeros(n, jnp.float32),
  ]
  grad = jnp.asarray(grads)

  def step(master, mu, nu, kept, row, grad, count):
    master, mu, nu, kept, total, _ = superoffload.kernels.adam_step_speculative(
      [master],
      [mu],
      [nu],
      [kept],
      row,
      [grad],
      None,
      _hyper(count),
      keep_nonfinite=True,
    )
    return master[0], mu[0], nu[0], kept[0], total

  step = jax.jit(step, donate_argnums=(0, 1, 2, 3))
  count = [0]

  def run():
    row = jnp.int32(count[0] % 2)
    out = step(*box, row, grad, jnp.int32(count[0]))
    jax.block_until_ready(out)
    box[:] = out[:4]
    count[0] += 1

  return run


def optax_adamw(n: int, lowp: bool) -> Callable[[], None]:
  """optax.adamw; with `lowp`, then a bf16 cast into a donated buffer."""
  params, grads = _state(n, 0)
  tx = optax.adamw(LR, weight_decay=WEIGHT_DECAY)
  p = jnp.asarray(params)
  box = [p, tx.init(p), jnp.zeros(n, jnp.bfloat16)]
  grad = jnp.asarray(grads)

  def step(params, opt_state, old_lowp, grad):
    del old_lowp  # Donated: XLA may write the new copy into its buffer.
    updates, opt_state = tx.update(grad, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, params.astype(jnp.bfloat16)

  def step_fp32(params, opt_state, grad):
    updates, opt_state = tx.update(grad, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  if lowp:
    step = jax.jit(step, donate_argnums=(0, 1, 2))
  else:
    step = jax.jit(step_fp32, donate_argnums=(0, 1))

  def run():
    out = step(*box[: 3 if lowp else 2], grad)
    jax.block_until_ready(out)
    box[: len(out)] = out

  return run


def grace_adam_mixed(n: int, reseed: bool) -> Callable[[], None]:
  """The mixed-precision step: bf16 gradients in, bf16 weights out.

  With `reseed`, the step is also handed the bf16 parameters (the weights
  it produced last, as in training) and starts from them where they are
  not the master rounded (the parameters are the source of truth: weights
  loaded or swapped in); their read is 2 B/param more than the 28 without.
  """
  params, grads = _state(n, 0)
  box = [
    [jnp.asarray(params)],
    [jnp.zeros(n, jnp.float32)],
    [jnp.zeros(n, jnp.float32)],
    [jnp.asarray(params, jnp.bfloat16)],
  ]
  grad = [jnp.asarray(grads, jnp.bfloat16)]

  def step(master, mu, nu, weights, grad, count):
    master, mu, nu, weights, _ = superoffload.kernels.adam_step_segments(
      master,
      mu,
      nu,
      grad,
      [jnp.bfloat16],
      _hyper(count),
      params=weights if reseed else None,
    )
    return master, mu, nu, weights

  step = jax.jit(step, donate_argnums=(0, 1, 2))
  return _box_stepper(step, box, grad)


def kernel_stream(n: int) -> Callable[[], None]:
  """The kernel's own stream loop (`kernels.stream_roofline`): no limit."""
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


def limit_candidates(n: int, threads: int) -> tuple[list[Candidate], str]:
  """The independent limit's variants, and how they were compiled.

  Group "limit" moves fp32 moments (28 B/param); "limit_m2" and "limit_m1"
  moments of 2 and 1 bytes (20 and 16 B/param), the limits of bf16 and
  8-bit moments.
  """
  lib, command = stream_limit.build()
  out = []
  limits = ((4, 'limit', ''), (2, 'limit_m2', ' (2 B moments)'))
  limits += ((1, 'limit_m1', ' (1 B moments)'),)
  for width, group, label in limits:
    limit = stream_limit.StreamLimit(lib, n, threads, width)
    out += [
      Candidate(f'limit{label}: {name}', run, limit.bytes_per_param, group)
      for name, run in limit.runs.items()
    ]
  return out, command


def _group(moment_format: str) -> str:
  """The ratios' key of a moment format: "bf16 moments" -> bf16_moments."""
  return moment_format.replace(' ', '_').replace('-', '')


def moment_candidates(n: int) -> list[Candidate]:
  return [
    Candidate(
      f'grace adam, {name}',
      grace_adam_moments(n, name),
      moment_bytes(name)[0],
      f'ours_{_group(name)}',
    )
    for name in MOMENT_FORMATS
  ]


def build_candidates(n: int, threads: int) -> tuple[list[Candidate], str]:
  """Every candidate of one run, and the limit's compile command."""
  limits, command = limit_candidates(n, threads)
  ours = grace_adam(n)
  default = kernels.prefetch_policy()
  others = [p for p in ('t0', 'nta', 'none') if p != default]
  candidates = [
    *limits,
    Candidate(
      f'grace adam (prefetch {default}, the default)',
      ours,
      BYTES_PER_PARAM,
      'ours',
    ),
    *[
      Candidate(
        f'grace adam, prefetch {p}',
        with_prefetch(ours, p),
        BYTES_PER_PARAM,
        f'ours_prefetch_{p}',
      )
      for p in others
    ],
    Candidate(
      "kernel's own stream loop (shares its prefetch)",
      kernel_stream(n),
      BYTES_PER_PARAM,
      'kernel_stream',
    ),
    Candidate(
      'optax.adamw (jit, donated)',
      optax_adamw(n, False),
      BYTES_PER_PARAM,
      'optax',
    ),
    Candidate(
      'grace adam + fused bf16 copy (donated)',
      grace_adam_lowp(n),
      BYTES_PER_PARAM_LOWP,
      'ours_lowp',
    ),
    Candidate(
      'optax.adamw then cast to bf16 (donated)',
      optax_adamw(n, True),
      BYTES_PER_PARAM_LOWP,
      'optax_lowp',
    ),
    Candidate(
      'grace adam, STV speculative step (two rows)',
      grace_adam_stv(n),
      BYTES_PER_PARAM_STV,
      'ours_stv',
    ),
    Candidate(
      'grace adam, bf16 grads in, bf16 weights out',
      grace_adam_mixed(n, reseed=False),
      BYTES_PER_PARAM,
      'ours_mixed',
    ),
    Candidate(
      'the same, re-seeded from the bf16 params',
      grace_adam_mixed(n, reseed=True),
      BYTES_PER_PARAM + 2,
      'ours_mixed_reseed',
    ),
    *moment_candidates(n),
    *torch_candidates(n),
  ]
  return candidates, command


def measure(
  candidates: list[Candidate], reps: int, warmup: int
) -> dict[str, list[float]]:
  """Times every candidate `reps` times, alternating the order."""
  for c in candidates:
    for _ in range(warmup):
      c.step()
  times = {c.name: [] for c in candidates}
  for rep in range(reps):
    # Alternate the order so no candidate always follows the same one.
    order = candidates if rep % 2 == 0 else candidates[::-1]
    for c in order:
      start = time.perf_counter()
      c.step()
      times[c.name].append(time.perf_counter() - start)
  return times


def ratios(
  candidates: list[Candidate], median: dict[str, float]
) -> dict[str, float | str]:
  """The run's headline ratios (> 1: the first named is faster)."""
  groups: dict[str, list[str]] = {}
  for c in candidates:
    groups.setdefault(c.group, []).append(c.name)
  limit_name = min(groups['limit'], key=lambda name: median[name])
  ours = median[groups['ours'][0]]
  out: dict[str, float | str] = {
    'limit_variant': limit_name,
    'ours_vs_limit': median[limit_name] / ours,
    'ours_vs_optax': median[groups['optax'][0]] / ours,
    'optax_vs_limit': median[limit_name] / median[groups['optax'][0]],
    'kernel_stream_vs_limit': (
      median[limit_name] / median[groups['kernel_stream'][0]]
    ),
    'ours_lowp_vs_optax_then_cast': (
      median[groups['optax_lowp'][0]] / median[groups['ours_lowp'][0]]
    ),
    'ours_lowp_vs_limit': (
      median[limit_name]
      / median[groups['ours_lowp'][0]]
      * BYTES_PER_PARAM_LOWP
      / BYTES_PER_PARAM
    ),
    # What speculation costs the kernel call (the speculative step's time
    # over the plain one's; its traffic alone would give 32 / 28).
    'stv_step_over_plain': median[groups['ours_stv'][0]] / ours,
    # What honouring the parameters costs the mixed-precision step (the
    # goal is at most 1.03; the read alone is 30 / 28).
    'reseed_over_mixed': (
      median[groups['ours_mixed_reseed'][0]] / median[groups['ours_mixed'][0]]
    ),
  }
  out.update(_moment_ratios(groups, median, ours))
  for group, names in groups.items():
    if group.startswith('ours_prefetch_'):
      out[f'default_vs_{group[len("ours_") :]}'] = median[names[0]] / ours
  if 'peer' in groups:
    fastest_peer = min(groups['peer'], key=lambda name: median[name])
    out['fastest_peer'] = fastest_peer
    out['ours_vs_fastest_peer'] = median[fastest_peer] / ours
  return out


def _moment_ratios(groups: dict, median: dict, ours: float) -> dict:
  """Each moment format against fp32 Grace Adam and its own traffic's limit."""
  out = {}
  own_limit = {
    'bf16_moments': ('limit_m2', 20),
    '8bit_moments': ('limit_m1', 16),
  }
  for name in MOMENT_FORMATS:
    key = _group(name)
    if f'ours_{key}' not in groups:
      continue
    t = median[groups[f'ours_{key}'][0]]
    out[f'{key}_vs_fp32'] = ours / t
    out[f'{key}_host_bytes_per_param'] = moment_bytes(name)[1]
    limit, limit_bytes = own_limit.get(key, (None, 0))
    if limit in groups:
      fastest = min(median[c] for c in groups[limit])
      # The limit moves no scales: 8-bit's 1/16 B/param more is charged.
      out[f'{key}_vs_own_limit'] = (
        fastest / t * moment_bytes(name)[0] / limit_bytes
      )
  return out


def table_rows(
  candidates: list[Candidate],
  times: dict[str, list[float]],
  n: int,
  limit_s: float,
) -> list[dict]:
  rows = []
  for c in candidates:
    m = statistics.median(times[c.name])
    rows.append(
      {
        'name': c.name,
        'median_s': m,
        'mparam_per_s': n / m / 1e6,
        'gb_per_s': n * c.bytes_per_param / m / 1e9,
        'vs_limit': limit_s / m * c.bytes_per_param / BYTES_PER_PARAM,
        'times_s': times[c.name],
      }
    )
  return rows


def print_table(
  rows: list[dict], summary: dict, n: int, reps: int, host: dict
) -> None:
  print(f'\nAdamW step, {n / 1e6:.1f}M fp32 params, median of {reps}')
  print(f'machine: {machine.headline(host)}')
  print(
    f'{"candidate":48s} {"ms":>8s} {"Mparam/s":>9s} {"GB/s":>6s} '
    f'{"x limit":>7s}'
  )
  for r in rows:
    print(
      f'{r["name"]:48s} {r["median_s"] * 1e3:8.1f} '
      f'{r["mparam_per_s"]:9.0f} {r["gb_per_s"]:6.1f} '
      f'{r["vs_limit"]:7.2f}'
    )
  for k, v in summary.items():
    print(f'{k}: {v:.3f}' if isinstance(v, float) else f'{k}: {v}')


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--params', type=int, default=64 * 2**20)
  parser.add_argument('--reps', type=int, default=15)
  parser.add_argument('--warmup', type=int, default=3)
  parser.add_argument('--out', default='results/bench_adam.json')
  args = parser.parse_args()
  n = args.params
  host = machine.describe()
  threads = os.cpu_count() or 1
  candidates, limit_command = build_candidates(n, threads)
  times = measure(candidates, args.reps, args.warmup)
  median = {name: statistics.median(t) for name, t in times.items()}
  summary = ratios(candidates, median)
  rows = table_rows(candidates, times, n, median[summary['limit_variant']])
  print_table(rows, summary, n, args.reps, host)
  result = {
    'benchmark': 'bench_adam',
    'date': datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds'),
    'machine': host,
    'limit': {'compiled': limit_command, 'threads': threads},
    'params': n,
    'reps': args.reps,
    'rows': rows,
    'ratios': summary,
  }
  os.makedirs(os.path.dirname(args.out) or '.', exist_ok=True)
  with open(args.out, 'w') as f:
    json.dump(result, f, indent=1)
  print(f'wrote {args.out}')


def report(data: dict[str, Any], out_dir: pathlib.Path) -> str:
  """Table and bar chart of `results/bench_adam.json`."""
  rows = data['rows']
  table = markdown_table(
    ['candidate', 'median ms', 'Mparam/s', 'vs limit'],
    [
      [
        r['name'],
        fmt(1e3 * r['median_s'], '.1f'),
        fmt(r['mparam_per_s']),
        # Older runs judged against the kernel's own loop ('vs_roofline').
        fmt(r.get('vs_limit', r.get('vs_roofline')), '.2f'),
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
    if 'roofline' in n or n.startswith('limit')
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
  host = data.get('machine', {})
  lines = [
    '## Grace Adam vs its peers (`results/bench_adam.json`)',
    '',
    f'One AdamW step over {data["params"]:,} fp32 parameters, median of '
    f'{data["reps"]}; {data.get("date", "?")}, '
    f'{host.get("cpu_model", "?")}, {host.get("cpus", "?")} CPUs, kernel '
    f'ISA {host.get("kernel_isa", "?")}, prefetch '
    f'{host.get("kernel_prefetch", "?")}, jax {host.get("jax", "?")}.',
    '',
    table,
    '',
    f'Grace Adam / optax.adamw: {fmt(ratios.get("ours_vs_optax"), ".2f")}x; '
    f'Grace Adam / fastest peer ({ratios.get("fastest_peer", "?")}): '
    f'{fmt(ratios.get("ours_vs_fastest_peer"), ".2f")}x; Grace Adam / '
    f'independent limit: {fmt(ratios.get("ours_vs_limit"), ".2f")}.',
    '',
    '![bench_adam](bench_adam.png)',
  ]
  return '\n'.join(lines)


if __name__ == '__main__':
  main()
