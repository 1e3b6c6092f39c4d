"""The parts of the prepared GPU command (run.sh), one per process.

  python -m experiments.device.gpu_parts opt CASE [--dtype bfloat16]
  python -m experiments.device.gpu_parts train CASE --layout scan|noscan
      [--batch 4]
  python -m experiments.device.gpu_parts profile CASE
  python -m experiments.device.gpu_parts capacity CASE [--moments 8bit]
      [--clip-norm 1.0]
  python -m experiments.device.gpu_parts link

CASE: `optax`, or an executor of superoffload.adamw (`stream`, `ffi`,
`xla_host`, `device`, `auto`), optionally with `+stv` (clip_norm armed,
never clipping: the cost of speculation) or `+clip` (clipping every step:
the cost of a redo). Each part prints one line `PART_RESULT {json}`; run.sh
collects them. On a CPU backend (`--dry-run`, CI) the sizes are tiny.
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import gzip
import json
import os
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE', 'false')

MARK = 'PART_RESULT '
# The 1B optimizer-only step: 20 leaves of 8192x6144 (1.01B parameters).
GPU_LEAVES = ((8192, 6144),) * 20
DRY_LEAVES = ((96, 64),) * 3 + ((7,),)


def _leaves(dry: bool) -> tuple[tuple[int, ...], ...]:
  return DRY_LEAVES if dry else GPU_LEAVES


def make_tx(case: str):
  """The optimizer a CASE names (see the module's docstring)."""
  import optax

  import jax_superoffload as superoffload

  name, _, variant = case.partition('+')
  if name == 'optax':
    tx = optax.adamw(1e-3, weight_decay=0.1)
    if variant == 'clip':
      tx = optax.chain(optax.clip_by_global_norm(1e-6), tx)
    elif variant == 'stv':
      tx = optax.chain(optax.clip_by_global_norm(1e9), tx)
    return tx
  clip = {'stv': 1e9, 'clip': 1e-6}.get(variant)
  offload = superoffload.Offload(executor=name, clip_norm=clip)
  return superoffload.adamw(1e-3, weight_decay=0.1, offload=offload)


def _median_time(run, reps: int, warmup: int = 2) -> tuple[float, list]:
  import jax
  import numpy as np

  times = []
  for i in range(warmup + reps):
    start = time.perf_counter()
    jax.block_until_ready(run())
    if i >= warmup:
      times.append(time.perf_counter() - start)
  return float(np.median(times)), times


def _stepper(tx, params, grads):
  """A donated update + apply_updates step over a box of (params, state)."""
  import jax
  import optax

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(p, state, g):
    updates, state = tx.update(g, state, p)
    return optax.apply_updates(p, updates), state

  box = [params, tx.init(params)]

  def run():
    box[0], box[1] = step(box[0], box[1], grads)
    return box[0]

  return run, box, step


def part_opt(case: str, dtype: str, reps: int, dry: bool) -> dict[str, Any]:
  """The optimizer-only step: time, and the weights against optax's."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  import jax_superoffload as superoffload

  device = jax.devices()[0]
  shapes = _leaves(dry)
  key = jax.random.PRNGKey(0)
  params = [
    jax.device_put(0.02 * jax.random.normal(key, s, jnp.float32), device)
    for s in shapes
  ]
  params = [p.astype(dtype) for p in params]
  grads = [
    (1e-3 * jax.random.normal(jax.random.fold_in(key, i), s)).astype(dtype)
    for i, s in enumerate(shapes)
  ]
  out: dict[str, Any] = {'case': case, 'dtype': dtype}
  out['num_params'] = int(sum(np.prod(s) for s in shapes))
  if not case.startswith('optax'):
    out['resolved'] = superoffload.resolve_executor(case.partition('+')[0])
  start = time.perf_counter()
  run, box, step = _stepper(make_tx(case), [jnp.copy(p) for p in params], grads)
  jax.block_until_ready(box)
  out['init_s'] = time.perf_counter() - start
  out['hlo'] = _entry_copies(step, box, grads)
  out['median_s'], out['times_s'] = _median_time(run, reps)
  out['gparam_per_s'] = out['num_params'] / out['median_s'] / 1e9
  out['max_rel_vs_optax'] = _against_optax(case, box[0], params, grads, reps)
  return out


def _entry_copies(step, box, grads) -> dict[str, Any]:
  """What the compiled step copies, and its custom calls' operand spaces.

  `copies`: `copy(` instructions (a donated buffer copied, a layout
  fixed); `custom_calls`: the first custom calls of the optimized HLO,
  shortened, which show whether their operands are in host memory (S(5)).
  """
  text = step.lower(box[0], box[1], grads).compile().as_text()
  lines = [line.strip() for line in text.splitlines()]
  copies = [line for line in lines if ' copy(' in line]
  calls = [line for line in lines if 'custom-call(' in line]
  calls = [c for c in calls if 'jax_superoffload' in c or 'MoveTo' in c]
  return {
    'copies': len(copies),
    'copy_examples': [c[:200] for c in copies[:6]],
    'custom_calls': [c[:600] for c in calls[:3]],
  }


def _against_optax(case, got, params, grads, reps: int) -> float | None:
  """The weights after the same steps with optax.adamw, on the device."""
  import jax
  import jax.numpy as jnp

  if case.startswith('optax') or case.endswith('+clip'):
    return None
  run, box, _ = _stepper(make_tx('optax'), [jnp.copy(p) for p in params], grads)
  for _ in range(2 + reps):
    run()
  worst, scale = 0.0, 0.0
  for a, b in zip(got, box[0], strict=True):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    worst = max(worst, float(jnp.max(jnp.abs(a - b))))
    scale = max(scale, float(jnp.max(jnp.abs(b))))
  jax.block_until_ready(box)
  return worst / scale if scale else worst


def part_profile(case: str, dry: bool) -> dict[str, Any]:
  """A perfetto trace of one optimizer step, summed per thread and event."""
  import jax
  import jax.numpy as jnp

  shapes = _leaves(dry)
  params = [jnp.zeros(s, jnp.float32) for s in shapes]
  grads = [jnp.full(s, 1e-3, jnp.float32) for s in shapes]
  run, _, _ = _stepper(make_tx(case), params, grads)
  for _ in range(2):
    jax.block_until_ready(run())
  folder = tempfile.mkdtemp(prefix='so-profile-')
  with jax.profiler.trace(folder, create_perfetto_trace=True):
    jax.block_until_ready(run())
  files = glob.glob(f'{folder}/**/*perfetto_trace.json.gz', recursive=True)
  with gzip.open(files[0]) as f:
    events = json.load(f)
  if isinstance(events, dict):
    events = events['traceEvents']
  return {'case': case, 'top': _summarise(events, 40)}


def _summarise(events: list, top: int) -> list[list]:
  names = {
    (e.get('pid'), e.get('tid')): e['args'].get('name')
    for e in events
    if e.get('ph') == 'M' and e.get('name') == 'thread_name'
  }
  total, count = collections.Counter(), collections.Counter()
  for e in events:
    if e.get('ph') != 'X':
      continue
    thread = names.get((e.get('pid'), e.get('tid')), str(e.get('tid')))
    k = (str(thread)[:40], e.get('name', '')[:70])
    total[k] += e.get('dur', 0)
    count[k] += 1
  return [
    [round(us / 1e3, 2), count[k], k[0], k[1]]
    for k, us in total.most_common(top)
  ]


def part_train(case: str, layout: str, batch: int, dry: bool) -> dict:
  """The decoder's jitted, donated train step (gpu_bench.run_train)."""
  import dataclasses

  from experiments.benchmarks import gpu_bench
  from experiments.sweeps import gpu_analysis

  sizes = gpu_analysis.DRY_SIZES if dry else None
  if sizes is None:
    sizes = gpu_analysis.gpu_sizes(gpu_bench._device_limit())
  sizes = dataclasses.replace(sizes, batch=batch if not dry else sizes.batch)
  # "stream+after-loop": scanned blocks start after the backward loop (the
  # trainer's overlap_scan off), to set against the default's in-loop rows;
  # "stream+held": overlap_scan consumes the gradients, its rows writing
  # the new weights over the stacked gradient during the backward pass
  # (JAX_SUPEROFFLOAD_SCAN_ROWS=held, read when the step traces; compare
  # its losses with the default's: a wrong write-back shows there).
  executor, _, variant = case.partition('+')
  if variant not in ('', 'after-loop', 'held'):
    raise ValueError(f'unknown train variant {variant!r} in {case!r}')
  name = case if case == 'optax' else f'superoffload:{executor}'
  fixed = {'scan_layers': layout == 'scan'}
  if variant == 'after-loop':
    fixed['overlap_scan'] = False
  if variant == 'held':
    os.environ['JAX_SUPEROFFLOAD_SCAN_ROWS'] = 'held'
  original = gpu_bench._decoder_config

  def config(s, c, **over):
    return original(s, c, **(fixed | over))

  gpu_bench._decoder_config = config
  try:
    r = gpu_bench.run_train(sizes, name)
  finally:
    gpu_bench._decoder_config = original
  keep = (
    'optimizer',
    'executor',
    'num_params',
    'compile_s',
    'median_step_s',
    'tokens_per_s',
    'mfu',
    'memory_bytes',
    'losses',
    'donated_copies',
  )
  return {'case': case, 'layout': layout, 'batch': batch} | {
    k: r.get(k) for k in keep
  }


# Of the device's bytes_limit, and of the host's physical memory, what a
# model may take: the rest is the runtime's, the data's and the OS's.
DEVICE_SHARE = 0.95
HOST_SHARE = 0.8


def part_capacity(
  case: str, moments: str, clip_norm: float | None, dry: bool
) -> dict[str, Any]:
  """The largest scanned decoder whose step fits, then 3 real steps of it.

  Compiled `memory_analysis()` bytes decide: the device's within
  DEVICE_SHARE of its limit and, for superoffload, the host's within
  HOST_SHARE of physical memory (its state lives there). Then the model of
  that size is allocated and trained for 3 steps.
  """
  import dataclasses

  from experiments.benchmarks import gpu_bench
  from experiments.sweeps import gpu_analysis

  sizes = gpu_analysis.DRY_SIZES
  if not dry:
    sizes = gpu_analysis.gpu_sizes(gpu_bench._device_limit())
  device_limit = sizes.capacity_limit
  if not dry:
    device_limit = int(DEVICE_SHARE * gpu_bench._device_limit())
  ram = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
  host_limit = int(HOST_SHARE * ram) if not dry else 2**30
  name = case if case == 'optax' else f'superoffload:{case}'
  extra = {} if case == 'optax' else {'moments': moments}
  if clip_norm is not None:
    extra['clip_norm'] = clip_norm
  found: dict[int, Any] = {}

  def measure(layers: int) -> int:
    cfg = gpu_bench._decoder_config(
      sizes, name, num_layers=layers, scan_layers=True, **extra
    )
    found[layers] = got = gpu_bench.compiled_step_bytes(cfg) or {}
    if got.get('host', 0) > host_limit:
      return device_limit + 1  # Does not fit: the host bounds it.
    return got.get('device', 0)

  out = gpu_analysis.largest_fitting(
    measure, device_limit, max_probes=sizes.capacity_probes
  )
  layers = out['largest']
  result: dict[str, Any] = {
    'case': case,
    'moments': extra.get('moments'),
    'clip_norm': clip_norm,
    'device_limit': device_limit,
    'host_limit': host_limit,
    'search': out,
    'bytes': found,
  }
  if layers < 1:
    return result | {'trained': None}
  model = dict(sizes.model, num_layers=layers)
  trained_sizes = dataclasses.replace(sizes, model=model, warmup=1, steps=2)
  original = gpu_bench._decoder_config
  gpu_bench._decoder_config = lambda s, c, **o: original(s, c, **(extra | o))
  try:
    r = gpu_bench.run_train(trained_sizes, name)
  finally:
    gpu_bench._decoder_config = original
  keep = ('num_params', 'median_step_s', 'losses', 'memory_bytes')
  return result | {'layers': layers, 'trained': {k: r.get(k) for k in keep}}


def part_link(dry: bool) -> dict[str, Any]:
  """PCIe (or the CPU's memory) both ways: 1 GiB device_put."""
  import jax
  import jax.numpy as jnp

  device = jax.devices()[0]
  host = jax.sharding.SingleDeviceSharding(device, memory_kind='pinned_host')
  on_device = jax.sharding.SingleDeviceSharding(device, memory_kind='device')
  n = (1 << 16) if dry else (1 << 28)
  x = jax.device_put(jnp.ones((n,), jnp.float32), on_device)
  xh = jax.device_put(x, host)
  gib = n * 4 / 2**30
  d2h, _ = _median_time(lambda: jax.device_put(x, host), 3)
  h2d, _ = _median_time(lambda: jax.device_put(xh, on_device), 3)
  return {'d2h_gib_s': gib / d2h, 'h2d_gib_s': gib / h2d, 'gib': gib}


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    'part', choices=('opt', 'train', 'profile', 'capacity', 'link')
  )
  parser.add_argument('case', nargs='?', default='stream')
  parser.add_argument('--dtype', default='float32')
  parser.add_argument('--layout', default='scan', choices=('scan', 'noscan'))
  parser.add_argument('--batch', type=int, default=4)
  parser.add_argument('--reps', type=int, default=5)
  parser.add_argument('--moments', default='fp32')
  parser.add_argument('--clip-norm', type=float, default=None)
  parser.add_argument('--dry-run', action='store_true')
  args = parser.parse_args(argv)
  import jax

  dry = args.dry_run or jax.default_backend() == 'cpu'
  start = time.perf_counter()
  if args.part == 'opt':
    r = part_opt(args.case, args.dtype, args.reps, dry)
  elif args.part == 'train':
    r = part_train(args.case, args.layout, args.batch, dry)
  elif args.part == 'profile':
    r = part_profile(args.case, dry)
  elif args.part == 'capacity':
    r = part_capacity(args.case, args.moments, args.clip_norm, dry)
  else:
    r = part_link(dry)
  r = {'part': args.part, 'dry_run': dry, 'wall_s': 0.0} | r
  r['wall_s'] = time.perf_counter() - start
  print(MARK + json.dumps(r, default=str), flush=True)
  return 0


if __name__ == '__main__':
  sys.exit(main())
