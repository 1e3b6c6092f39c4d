"""One prepared check of the executors on the current backend (GPU or CPU).

Records which ways of running the Grace Adam FFI kernel as host compute work
here, checks every working executor and offload technique against optax on
the CPU device, times a jitted, donated step and prints the compiled step's
memory analysis. Each attempt runs in its own subprocess, so that an abort
(XLA may abort on a bad custom call) is a finding, not the end of the run.

  python -m experiments.benchmarks.gpu_check [--params N] [--steps K] \
      [--out results/gpu_check.json]

Exits 0 when attempts fail (they are findings); non-zero only when the
script itself breaks.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_superoffload as superoffload
from jax_superoffload import kernels

MARK = 'GPU_CHECK_RESULT '
# Attempt name -> superoffload executor (None: the optax.adamw baseline).
ATTEMPTS = {
  'ffi': 'ffi',  # (a) As superoffload sets it up (plugin_ffi on a GPU).
  'ffi_register_host': 'ffi',  # (b) Registration reported, then (a).
  'xla_host': 'xla_host',  # (c) The same math in jax.numpy, host compute.
  'device': 'device',  # (d) State on the host, update on the device.
  'optax': None,  # The baseline: optax.adamw on the device.
}
TECHNIQUES = {  # superoffload options; 'weight_flow' is checked apart.
  'plain': {},
  'clip_norm': {'clip_norm': 1.0},  # Gradient norms are about 6: clips.
  'skip_nonfinite': {'skip_nonfinite': True},  # Step 1 holds a NaN.
  'device_buckets': {'device_buckets': 0.5},
  'cast_device': {'cast': 'device'},  # bf16 weights, fp32 master.
  'cast_host': {'cast': 'host'},
}
LR, WD = 1e-2, 0.1
SMALL_BUCKET_BYTES = 4 * 1024  # Several buckets in the technique checks.
CASTS = ('cast_device', 'cast_host')


def describe(e: BaseException) -> str:
  lines = [line for line in str(e).splitlines() if line.strip()]
  return f'{type(e).__name__}: {lines[0][:400] if lines else ""}'


def environment() -> dict[str, Any]:
  device = jax.devices()[0]
  env = {
    'python': platform.python_version(),
    'platform': platform.platform(),
    'cpus': os.cpu_count(),
    'jax': jax.__version__,
    'backend': jax.default_backend(),
    'devices': [str(d) for d in jax.devices()],
    'device_kind': device.device_kind,
    'memory_kinds': [m.kind for m in device.addressable_memories()],
    'default_memory_kind': device.default_memory().kind,
    'kernel_isa': kernels.instruction_set(),
  }
  for dist in ('jaxlib', 'jax-cuda13-plugin', 'jax-cuda13-pjrt'):
    try:
      env[dist] = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
      env[dist] = None
  return env


def errors(got: Any, want: Any) -> dict[str, float]:
  """Max abs error and that error relative to max |want|, over all leaves."""
  g = np.concatenate([np.ravel(np.asarray(x, np.float32)) for x in got])
  w = np.concatenate([np.ravel(np.asarray(x, np.float32)) for x in want])
  diff = np.abs(g - w)
  diff[np.isnan(g) & np.isnan(w)] = 0.0
  diff[np.isnan(diff)] = np.inf
  max_abs = float(diff.max())
  return {'max_abs': max_abs, 'max_rel': max_abs / float(np.abs(w).max())}


def run_steps(tx, params, grads_seq, device) -> tuple[Any, Any]:
  """`len(grads_seq)` jitted steps of `tx` with everything on `device`."""
  params = jax.device_put(params, device)
  state = tx.init(params)

  @jax.jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  for g in grads_seq:
    params, state = step(params, state, jax.device_put(g, device))
  return params, state


def make_tx(executor: str | None, **options: Any):
  if executor is None:
    return optax.adamw(LR, weight_decay=WD)
  offload = superoffload.Offload(executor=executor, **options)
  return superoffload.adamw(LR, weight_decay=WD, offload=offload)


def check_technique(name: str, executor: str | None, steps: int) -> dict:
  rng = np.random.default_rng(0)
  dtype = jnp.bfloat16 if name.startswith('cast') else jnp.float32
  shapes = [(48, 64), (64,), (1000,)]
  params = [jnp.asarray(rng.standard_normal(s), dtype) for s in shapes]
  grads_seq = []
  for i in range(steps):
    g = [rng.standard_normal(s).astype(np.float32) * 0.1 for s in shapes]
    if name == 'skip_nonfinite' and i == 1:
      g[0][3, 5] = np.nan
    grads_seq.append([jnp.asarray(x, dtype) for x in g])
  ref_tx = optax.adamw(LR, weight_decay=WD)
  if name == 'clip_norm':
    ref_tx = optax.chain(optax.clip_by_global_norm(1.0), ref_tx)
  ref_grads = grads_seq
  if name == 'skip_nonfinite':  # The serial recipe drops the NaN step.
    ref_grads = [g for i, g in enumerate(grads_seq) if i != 1]
  # Mixed precision: an fp32 master updated with widened gradients.
  widen = lambda t: jax.tree.map(lambda x: x.astype(jnp.float32), t)  # noqa: E731
  cpu = jax.devices('cpu')[0]
  want, _ = run_steps(ref_tx, widen(params), map(widen, ref_grads), cpu)
  want = [w.astype(dtype) for w in want]
  options = dict(bucket_bytes=SMALL_BUCKET_BYTES, **TECHNIQUES[name])
  tx = make_tx(executor, **options)
  got, state = run_steps(tx, params, grads_seq, jax.devices()[0])
  out = errors(got, want)
  # bf16 results may differ by one bf16 ulp where fp32 roundings differ.
  out['tol'] = 2**-7 if name.startswith('cast') else 1e-5
  out['match'] = out['max_rel'] <= out['tol']
  if isinstance(state, superoffload.SuperOffloadState):
    out['redone'] = int(state.redone)
    out['skipped'] = int(state.skipped)
    kinds = [x.sharding.memory_kind for x in state.master]
    out['master_bucket_kinds'] = {k: kinds.count(k) for k in set(kinds)}
  if name.startswith('cast'):
    out['got'] = got  # Compared with the other side by the caller.
  return out


def mlp_loss(stack, x, policy: str):
  # Full fp32 dots: a GPU's default takes fp32 matmuls through TF32, whose
  # gradients then differ from the CPU reference's by about 2e-3, whatever
  # the optimizer (the H200 run of 2026-12-04, results/gpu_h200/).
  def dot(a, b):
    return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)

  def body(layer, x):
    return x + dot(jnp.tanh(dot(x, layer['up'])), layer['down']), None

  if policy == 'reference':
    x, _ = jax.lax.scan(lambda c, p: body(p, c), x, stack)
  else:
    x, _ = superoffload.weight_flow_scan(body, x, stack, policy=policy)
  return jnp.mean(x**2)


def mlp_run(tx, policy: str, stack, x, steps: int, device) -> Any:
  stack, x = jax.device_put((stack, x), device)
  state = tx.init(stack)  # Optimizers initialize from device arrays.
  if policy == 'flow':
    stack = superoffload.offload_stacked(stack)

  @jax.jit
  def step(stack, state):
    grads = jax.grad(mlp_loss)(stack, x, policy)
    if policy == 'flow':
      return superoffload.update_offloaded(tx, grads, state, stack)
    updates, state = tx.update(grads, state, stack)
    return optax.apply_updates(stack, updates), state

  for _ in range(steps):
    stack, state = step(stack, state)
  return stack


def check_weight_flow(executor: str | None, steps: int) -> dict:
  rng = np.random.default_rng(1)
  layers, width, hidden = 3, 16, 32
  stack = {
    'up': 0.3 * rng.standard_normal((layers, width, hidden), np.float32),
    'down': 0.3 * rng.standard_normal((layers, hidden, width), np.float32),
  }
  x = rng.standard_normal((8, width), np.float32)
  cpu, dev = jax.devices('cpu')[0], jax.devices()[0]
  want = mlp_run(make_tx(None), 'reference', stack, x, steps, cpu)
  tx = make_tx(executor)
  got = {
    p: mlp_run(tx, p, stack, x, steps, dev) for p in ('flow', 'stationary')
  }
  out = {}
  for policy, tree in got.items():
    for k, v in errors(jax.tree.leaves(tree), jax.tree.leaves(want)).items():
      out[f'{policy}_{k}'] = v
  leaves = [jax.tree.leaves(t) for t in got.values()]
  out['flow_vs_stationary_max_abs'] = errors(*leaves)['max_abs']
  out['flow_kinds'] = sorted({x.sharding.memory_kind for x in leaves[0]})
  for k in ('max_abs', 'max_rel'):
    out[k] = max(out[f'flow_{k}'], out[f'stationary_{k}'])
  out['tol'] = 1e-5
  out['match'] = out['max_rel'] <= out['tol']
  return out


def bytes_by_kind(tree: Any) -> dict[str, int]:
  out: dict[str, int] = {}
  for x in jax.tree.leaves(tree):
    kind = str(getattr(x.sharding, 'memory_kind', None))
    out[kind] = out.get(kind, 0) + x.nbytes
  return out


def memory_fields(compiled) -> dict[str, Any] | None:
  stats = compiled.memory_analysis()
  if stats is None:
    return None
  names = [n for n in dir(stats) if 'size' in n or 'host' in n or 'peak' in n]
  values = {n: getattr(stats, n) for n in names if not n.startswith('_')}
  return {n: v for n, v in values.items() if isinstance(v, (int, float))}


def time_step(executor: str | None, n: int, reps: int, warmup: int) -> dict:
  keys = jax.random.split(jax.random.key(0), 8)  # 4 leaves of n / 4.
  params = [0.02 * jax.random.normal(k, (n // 4,)) for k in keys[:4]]
  grads = [1e-3 * jax.random.normal(k, (n // 4,)) for k in keys[4:]]
  tx = make_tx(executor)
  state = tx.init(params)
  state_bytes = bytes_by_kind(state)

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  start = time.perf_counter()
  compiled = (
    jax.jit(step, donate_argnums=(0, 1)).lower(params, state, grads).compile()
  )
  compile_s = time.perf_counter() - start
  box = [params, state]
  times = []
  for i in range(warmup + reps):
    start = time.perf_counter()
    box[:] = jax.block_until_ready(compiled(box[0], box[1], grads))
    if i >= warmup:
      times.append(time.perf_counter() - start)
  device_stats = jax.devices()[0].memory_stats() or {}
  wanted = ('bytes_in_use', 'peak_bytes_in_use', 'bytes_limit')
  return {
    'params': 4 * (n // 4),
    'compile_s': compile_s,
    'median_s': statistics.median(times),
    'times_s': times,
    'state_bytes_by_kind': state_bytes,
    'memory_analysis': memory_fields(compiled),
    'device_memory_stats': {k: device_stats.get(k) for k in wanted},
  }


def guarded(fn: Callable[[], dict]) -> dict:
  try:
    return {'ok': True, **fn()}
  except Exception as e:  # A finding, recorded, not a crash.
    return {'ok': False, 'error': describe(e), 'detail': str(e)[:2000]}


def register_for_host() -> dict:
  """(b): files the kernel's handlers for "Host" in the CUDA plugin."""
  jax.devices()  # Initialises the backends, which loads the plugin.
  return dataclasses.asdict(superoffload.host_registration())


def summarize_check(c: dict) -> str:
  if not c['ok']:
    return 'ERROR ' + c['error']
  verdict = 'ok' if c['match'] else 'MISMATCH'
  errs = f'max_abs={c["max_abs"]:.2e} max_rel={c["max_rel"]:.2e}'
  return f'{verdict} {errs} ' + ' '.join(
    f'{k}={v}' for k, v in c.items() if k in ('redone', 'skipped')
  )


def run_attempt(name: str, args: argparse.Namespace) -> dict:
  executor = ATTEMPTS[name]
  result: dict[str, Any] = {'attempt': name, 'executor': executor}
  if name == 'ffi_register_host':
    result['registration'] = guarded(register_for_host)
    print(f'[{name}] registration: {result["registration"]}')
  techniques = [*TECHNIQUES, 'weight_flow'] if executor else ['plain']
  checks = result['checks'] = {}
  for tech in techniques:
    check = check_weight_flow
    if tech != 'weight_flow':
      check = functools.partial(check_technique, tech)
    checks[tech] = guarded(functools.partial(check, executor, args.steps))
    print(f'[{name}] {tech}: {summarize_check(checks[tech])}', flush=True)
    if tech == 'plain' and not checks[tech]['ok']:
      break  # The executor does not run here: the rest would fail alike.
  sides = [checks.get(s, {}).pop('got', None) for s in CASTS]
  if None not in sides:  # Documented as bit-identical.
    diff = errors(*sides)['max_abs']
    checks['cast_host']['device_vs_host_max_abs'] = diff
    print(f'[{name}] cast device vs host: max abs {diff}')
  result['works'] = checks['plain']['ok']
  if result['works']:
    t = result['timing'] = guarded(
      lambda: time_step(executor, args.params, args.reps, args.warmup)
    )
    if t['ok']:
      print(
        f'[{name}] step: median {t["median_s"] * 1e3:.2f} ms, compile '
        f'{t["compile_s"]:.1f} s; state bytes {t["state_bytes_by_kind"]}'
        f'; device memory {t["device_memory_stats"]}'
      )
      print(f'[{name}] memory_analysis: {t["memory_analysis"]}')
    else:
      print(f'[{name}] timing: ERROR {t["error"]}')
  return result


def spawn(name: str, args: argparse.Namespace) -> dict:
  cmd = [
    sys.executable,
    '-m',
    'experiments.benchmarks.gpu_check',
    '--attempt',
    name,
  ]
  for flag in ('params', 'steps', 'reps', 'warmup'):
    cmd += [f'--{flag}', str(getattr(args, flag))]
  start = time.perf_counter()
  result: dict[str, Any] = {'attempt': name, 'works': False}
  try:
    proc = subprocess.run(
      cmd, capture_output=True, text=True, timeout=args.attempt_timeout
    )
    stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
    result['status'] = f'crashed rc={rc}'
  except subprocess.TimeoutExpired as e:
    stdout, stderr, rc = e.stdout or '', e.stderr or '', None
    result['status'] = 'timeout'
  decode = lambda s: s.decode(errors='replace') if isinstance(s, bytes) else s  # noqa: E731
  for line in decode(stdout).splitlines():
    if line.startswith(MARK):
      result = {**json.loads(line[len(MARK) :]), 'status': 'ran'}
    else:
      print(line)
  result['returncode'] = rc
  result['stderr_tail'] = decode(stderr).splitlines()[-15:]
  result['wall_s'] = time.perf_counter() - start
  if result['status'] != 'ran':  # An abort, a crash or a hang: no result.
    for line in result['stderr_tail']:
      print(f'  [{name} stderr] {line}')
  return result


def print_summary(results: dict[str, dict]) -> None:
  techniques = [*TECHNIQUES, 'weight_flow']
  print(
    '\nNumerics vs optax.adamw on the CPU device (max rel error; '
    '! = above tolerance):'
  )
  print(
    f'{"attempt":18s} {"status":13s}'
    + ''.join(f'{t[:14]:>15s}' for t in techniques)
  )
  for name, r in results.items():
    cells = []
    for t in techniques:
      c = r.get('checks', {}).get(t)
      if c is None or not c['ok']:
        cells.append('-' if c is None else 'ERROR')
      else:
        cells.append(f'{c["max_rel"]:.1e}' + ('' if c['match'] else '!'))
    status = 'works' if r.get('works') else r['status'].replace('ran', 'fails')
    print(f'{name:18s} {status:13s}' + ''.join(f'{c:>15s}' for c in cells))
    plain = r.get('checks', {}).get('plain', {'ok': True})
    if not plain['ok']:
      print(f'  {name}: {plain["error"]}')
  base = results['optax'].get('timing', {}).get('median_s')
  print('\nStep (update + apply_updates, jit, donated) and memory analysis:')
  columns = ('argument', 'output', 'temp', 'host_argument', 'host_temp')
  print(
    f'{"attempt":18s} {"median ms":>10s} {"vs optax":>9s}'
    + ''.join(f'{c.replace("argument", "arg") + " MB":>16s}' for c in columns)
    + '  state'
  )
  for name, r in results.items():
    t = r.get('timing') or {'ok': False, 'error': '-'}
    if not t['ok']:
      print(f'{name:18s} {t["error"]}')
      continue
    m = t['memory_analysis'] or {}
    sizes = [m.get(f'{c}_size_in_bytes', np.nan) / 2**20 for c in columns]
    speed = f'{base / t["median_s"]:.2f}' if base else '-'
    kinds = t['state_bytes_by_kind'].items()
    print(
      f'{name:18s} {t["median_s"] * 1e3:10.2f} {speed:>9s}'
      + ''.join(f'{x:16.1f}' for x in sizes)
      + '  '
      + ', '.join(f'{k} {v / 2**20:.0f} MB' for k, v in kinds)
    )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--params', type=int, help='default: 16M (2M on CPU)')
  parser.add_argument('--steps', type=int, default=3)
  parser.add_argument('--reps', type=int, default=7)
  parser.add_argument('--warmup', type=int, default=2)
  parser.add_argument('--attempt', choices=list(ATTEMPTS))
  parser.add_argument('--attempt-timeout', type=float, default=120.0)
  parser.add_argument('--out', default='results/gpu_check.json')
  args = parser.parse_args()
  # Before any backend starts: the parent and each child share one GPU.
  os.environ.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE', 'false')
  if args.params is None:
    args.params = 2 * 2**20 if jax.default_backend() == 'cpu' else 16 * 2**20
  if args.attempt is not None:  # Child: one attempt, one JSON line.
    result = run_attempt(args.attempt, args)
    print(MARK + json.dumps(result, default=str), flush=True)
    return

  env = environment()
  print('Environment:')
  for k, v in env.items():
    print(f'  {k}: {v}')
  print(f'timing params: {args.params}, steps per check: {args.steps}')
  results = {}
  for name in ATTEMPTS:
    print(f'\n--- attempt {name} (executor {ATTEMPTS[name]}) ---', flush=True)
    results[name] = spawn(name, args)
  print_summary(results)
  report = {
    'check': 'gpu_check',
    'date': datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds'),
    'environment': env,
    'args': vars(args),
    'working': [n for n, r in results.items() if r.get('works')],
    'attempts': results,
  }
  os.makedirs(os.path.dirname(args.out) or '.', exist_ok=True)
  with open(args.out, 'w') as f:
    json.dump(report, f, indent=1, default=str)
  print(f'\nworking: {report["working"]}\nwrote {args.out}')


if __name__ == '__main__':
  main()
