"""One prepared GPU benchmark of superoffload, sized to the device it finds.

  python -m experiments.benchmarks.gpu_bench [--dry-run] [--budget-s 400] \
    [--out PATH]

Three parts, each case in its own subprocess (an abort in a custom call is
a finding, not the end of the run), all within `--budget-s` seconds plus
at most one compilation (8 minutes in all on an H200 is the aim):

1. executors: `superoffload.adamw` with executor "ffi" (Grace Adam filed for
   "Host" in the CUDA plugin's FFI registry), "xla_host" and "device",
   against `optax.adamw` on the device.
2. train: the trainer's jitted, donated step of the NNX decoder at about 1B
   parameters (less where the device is small): tokens/s, MFU, compiled
   `memory_analysis()` device and host bytes, superoffload against
   optax.adamw on the device; and whether the compiled step copies donated
   parameters (`copy(` of an entry parameter in the HLO).
3. capacity: the most layers of the decoder (scanned, at the train width)
   whose compiled step fits in device memory, for each optimizer: bisection
   on `memory_analysis()` of compiled steps; nothing is allocated.

Writes `results/gpu_bench.json`. On a CPU backend, or with `--dry-run`, it
runs every part at tiny sizes against a pretend device memory and writes to
`results/tmp/` (not kept): no CPU number can pass for a GPU one. Exits
non-zero only when the script itself breaks; failed cases are findings.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import subprocess
import sys
import time
from typing import Any

from experiments.sweeps import gpu_analysis
from experiments.sweeps.gpu_analysis import DRY_SIZES
from experiments.sweeps.gpu_analysis import Sizes
from experiments.sweeps.gpu_analysis import gpu_sizes

MARK = 'GPU_BENCH_RESULT '
EXECUTORS = ('ffi', 'xla_host', 'device')
OPTIMIZERS = ('superoffload', 'optax')


def _device_limit() -> int | None:
  import jax

  stats = jax.devices()[0].memory_stats() or {}
  return stats.get('bytes_limit')


def _decoder_config(sizes: Sizes, case: str, **overrides: Any):
  """The decoder's config; `case` is an optimizer, or "superoffload:EXEC"."""
  from experiments.trainer import config as config_lib

  optimizer, _, executor = case.partition(':')
  fields = dict(
    optimizer=optimizer,
    executor=executor or 'auto',
    batch_size=sizes.batch,
    seq_len=sizes.seq_len,
    bucket_mib=sizes.bucket_mib,
    warmup_steps=2,
    steps=1000,
    progress=False,
  )
  fields.update(sizes.model)
  fields.update(overrides)
  return config_lib.get_config('small', **fields)


def run_executor(sizes: Sizes, executor: str) -> dict[str, Any]:
  """superoffload.adamw(offload=Offload(executor=...)) vs optax.adamw."""
  import jax
  import numpy as np
  import optax

  import jax_superoffload as superoffload

  out: dict[str, Any] = {'executor': executor}
  if executor == 'ffi':  # On CPU only a rehearsal: nothing reads it there.
    out['registration'] = dataclasses.asdict(superoffload.host_registration())
  out['auto_resolves_to'] = superoffload.resolve_executor('auto')
  rng = np.random.default_rng(0)
  params = [rng.standard_normal(s, np.float32) for s in sizes.exec_shapes]
  grads = [
    [0.1 * rng.standard_normal(s, np.float32) for s in sizes.exec_shapes]
    for _ in range(sizes.exec_steps)
  ]
  results = []
  for tx in (
    optax.adamw(1e-2, weight_decay=0.1),
    superoffload.adamw(
      1e-2, weight_decay=0.1, offload=superoffload.Offload(executor=executor)
    ),
  ):
    p = jax.device_put(params, jax.devices()[0])
    state = tx.init(p)

    @jax.jit
    def step(p, state, g, tx=tx):
      updates, state = tx.update(g, state, p)
      return optax.apply_updates(p, updates), state

    for g in grads:
      p, state = step(p, state, jax.device_put(g, jax.devices()[0]))
    results.append(np.concatenate([np.ravel(np.asarray(x)) for x in p]))
  want, got = results
  out['max_abs'] = float(np.max(np.abs(got - want)))
  out['max_rel'] = out['max_abs'] / float(np.max(np.abs(want)))
  out['match'] = out['max_rel'] <= 1e-5
  return out


def _build_train(cfg):
  import jax
  import numpy as np
  from flax import nnx

  from experiments.trainer import model as model_lib
  from experiments.trainer import train

  mesh = train.make_mesh(cfg)
  model = model_lib.init_model(cfg)
  train.place_on_mesh(mesh, model)
  tx = train.make_optimizer(cfg, train.make_schedule(cfg), mesh)
  opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
  train.place_on_mesh(mesh, model, opt)
  step = train.config_train_step(cfg, model, opt, mesh)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len + 1))
  batch = [
    jax.device_put(t.astype(np.int32), jax.devices()[0])
    for t in (tokens[:, :-1], tokens[:, 1:])
  ]
  return model, step, nnx.state((model, opt)), batch


def run_train(sizes: Sizes, optimizer: str) -> dict[str, Any]:
  """The decoder's whole training step: speed, memory, donated copies."""
  import jax
  import numpy as np

  import jax_superoffload as superoffload
  from experiments.trainer import model as model_lib
  from experiments.trainer import perf

  cfg = _decoder_config(sizes, optimizer)
  model, step, state, batch = _build_train(cfg)
  num_params = model_lib.count_params(model)
  out: dict[str, Any] = {'optimizer': optimizer, 'num_params': num_params}
  if cfg.optimizer == 'superoffload':
    out['executor'] = superoffload.resolve_executor(cfg.executor)
  out['state_bytes'] = perf.bytes_by_memory_kind(state, jax.devices()[0])
  start = time.perf_counter()
  compiled = step.lower(state, *batch).compile()
  out['compile_s'] = time.perf_counter() - start
  stats = compiled.memory_analysis()
  out['memory_analysis'] = gpu_analysis.memory_fields(stats)
  out['memory_bytes'] = gpu_analysis.memory_bytes(stats)
  out['donated_copies'] = gpu_analysis.parameter_copies(compiled.as_text())
  del model  # The step owns the state from here (donated).
  times, losses = [], []
  for i in range(sizes.warmup + sizes.steps):
    start = time.perf_counter()
    state, metrics = compiled(state, *batch)
    losses.append(float(metrics['loss']))  # Waits for the step.
    if i >= sizes.warmup:
      times.append(time.perf_counter() - start)
  tokens = cfg.batch_size * cfg.seq_len
  median = float(np.median(times))
  peak, source = perf.peak_flops(jax.devices()[:1], cfg.peak_tflops)
  flops = perf.flops_per_token(
    num_params, cfg.num_layers, cfg.d_model, cfg.seq_len
  )
  out.update(
    tokens_per_step=tokens,
    step_s=times,
    median_step_s=median,
    tokens_per_s=tokens / median,
    mfu=perf.mfu(tokens / median, flops, peak),
    peak_source=source,
    losses=losses,
    device_memory_stats=jax.devices()[0].memory_stats(),
  )
  return out


def compiled_step_bytes(cfg) -> dict[str, int] | None:
  """Device and host bytes of the compiled train step, without allocating."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from experiments.device import aot_steps
  from experiments.trainer import model as model_lib
  from experiments.trainer import train

  mesh = train.make_mesh(cfg)

  def build():
    model = model_lib.init_model(cfg)
    tx = train.make_optimizer(cfg, train.make_schedule(cfg), mesh)
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

  model, opt = nnx.eval_shape(build)
  # Shapes alone lose the memory kinds: the compiled init knows them.
  abstract = aot_steps.placed_state(mesh, build)
  nnx.update((model, opt), abstract)
  step = train.config_train_step(cfg, model, opt, mesh)
  tokens = jax.ShapeDtypeStruct((cfg.batch_size, cfg.seq_len), jnp.int32)
  stats = step.lower(abstract, tokens, tokens).compile().memory_analysis()
  return gpu_analysis.memory_bytes(stats)


def run_capacity(
  sizes: Sizes, optimizer: str, deadline: float
) -> dict[str, Any]:
  """The most scanned layers whose compiled step fits `capacity_limit`."""
  found: dict[int, dict[str, int] | None] = {}

  def measure(layers: int) -> int:
    cfg = _decoder_config(sizes, optimizer, num_layers=layers, scan_layers=True)
    found[layers] = compiled_step_bytes(cfg)
    return found[layers]['device']

  out = gpu_analysis.largest_fitting(
    measure,
    sizes.capacity_limit,
    max_probes=sizes.capacity_probes,
    deadline=deadline,
    clock=time.time,
  )
  width = sizes.model['d_model']
  mlp = sizes.model['mlp_dim']
  per_layer = 4 * width * width + 2 * width * mlp  # Weights, no biases.
  largest = found.get(out['largest']) or {}
  out.update(
    optimizer=optimizer,
    limit_bytes=sizes.capacity_limit,
    # superoffload's state must fit the host too (CPU backends report 0).
    host_bytes_of_largest=largest.get('host'),
    host_memory_bytes=os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES'),
    approx_params_of_largest=out['largest'] * per_layer,
    bytes=found,
  )
  return out


def run_part(part: str, case: str, sizes: Sizes, deadline: float) -> dict:
  if part == 'executors':
    return run_executor(sizes, case)
  if part == 'train':
    return run_train(sizes, case)
  return run_capacity(sizes, case, deadline)


def spawn(part: str, case: str, args, deadline: float) -> dict[str, Any]:
  """Runs one case in a child process; its JSON line is the result.

  The child may overrun `deadline` by one compilation (capacity probes
  check it between compilations), not by more.
  """
  cmd = [
    sys.executable,
    '-m',
    'experiments.benchmarks.gpu_bench',
    '--part',
    part,
  ]
  cmd += ['--case', case, '--deadline', str(deadline)]
  cmd += ['--dry-run'] if args.dry_run else []
  timeout = max(1.0, deadline - time.time() + 60)
  start = time.perf_counter()
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    stdout, stderr = proc.stdout, proc.stderr
    result = {'status': f'failed rc={proc.returncode}'}
  except subprocess.TimeoutExpired as e:
    stdout, stderr = e.stdout or '', e.stderr or ''
    result = {'status': 'timeout'}
  decode = lambda s: s.decode(errors='replace') if isinstance(s, bytes) else s  # noqa: E731
  for line in decode(stdout).splitlines():
    if line.startswith(MARK):
      result = {'status': 'ran', **json.loads(line[len(MARK) :])}
  result['wall_s'] = time.perf_counter() - start
  if result['status'] != 'ran':
    result['stderr_tail'] = decode(stderr).splitlines()[-20:]
  return result


def _summary(part: str, r: dict[str, Any]) -> str:
  if r['status'] != 'ran':
    tail = r.get('stderr_tail') or ['']
    return f'{r["status"]}: {tail[-1][:200]}'
  if part == 'executors':
    return f'max_rel {r["max_rel"]:.1e} match={r["match"]}'
  if part == 'train':
    mem = r['memory_bytes'] or {}
    return (
      f'{r["num_params"] / 1e6:.0f}M params, {r["tokens_per_s"]:.0f} tok/s, '
      f'MFU {r["mfu"]:.3f}, device {mem.get("device", 0) / 2**30:.2f} GiB, '
      f'host {mem.get("host", 0) / 2**30:.2f} GiB, '
      f'{r["donated_copies"]["copies"]} parameter copies'
    )
  return (
    f'largest {r["largest"]} layers (first failing: '
    f'{r["smallest_failing"]}, exact={r["exact"]})'
  )


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--dry-run', action='store_true', help='tiny sizes')
  parser.add_argument('--budget-s', type=float, default=400.0)
  parser.add_argument('--out', help='default: results/gpu_bench.json')
  parser.add_argument('--part', choices=('executors', 'train', 'capacity'))
  parser.add_argument('--case')
  parser.add_argument('--deadline', type=float, default=float('inf'))
  args = parser.parse_args()
  # Before any backend starts: the parent and each child share one GPU.
  os.environ.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE', 'false')
  import jax

  on_gpu = jax.default_backend() != 'cpu'
  args.dry_run = args.dry_run or not on_gpu
  limit = _device_limit() if on_gpu else None
  sizes = DRY_SIZES if args.dry_run or not limit else gpu_sizes(limit)
  if args.part:  # Child: one case, one JSON line.
    result = run_part(args.part, args.case, sizes, args.deadline)
    print(MARK + json.dumps(result, default=str), flush=True)
    return 0
  return run_all(args, sizes, limit)


def _run_case(results, part: str, case: str, args, deadline: float) -> None:
  key = f'{part}/{case.partition(":")[0]}'
  if time.time() > deadline:
    results[key] = {'status': 'skipped: budget spent', 'case': case}
    return
  r = results[key] = {'case': case, **spawn(part, case, args, deadline)}
  print(f'[{key}] {_summary(part, r)} ({r["wall_s"]:.0f} s)', flush=True)


def run_all(args, sizes: Sizes, limit: int | None) -> int:
  from experiments.benchmarks import gpu_check

  deadline = time.time() + args.budget_s
  env = gpu_check.environment()
  print(
    f'backend {env["backend"]}, {env["device_kind"]}, dry run: '
    f'{args.dry_run}, device bytes_limit {limit}, sizes {sizes}'
  )
  results: dict[str, dict[str, Any]] = {}
  for e in EXECUTORS:
    _run_case(results, 'executors', e, args, deadline)
  # Where Grace Adam does not run in this host compute, the decoder parts
  # measure superoffload with "xla_host" rather than not at all.
  superoffload = gpu_analysis.superoffload_case(results['executors/ffi'])
  for o in (superoffload, 'optax'):
    _run_case(results, 'train', o, args, deadline)
  # Capacity probes stop at their own deadline: share what is left.
  for i, o in enumerate((superoffload, 'optax')):
    share = time.time() + (deadline - time.time()) / (2 - i)
    _run_case(results, 'capacity', o, args, min(share, deadline))
  report = {
    'bench': 'gpu_bench',
    'dry_run': args.dry_run,
    'date': datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds'),
    'environment': env,
    'device_bytes_limit': limit,
    'sizes': dataclasses.asdict(sizes),
    'results': results,
  }
  default = (
    'results/tmp/gpu_bench_dry_run.json'
    if args.dry_run
    else ('results/gpu_bench.json')
  )
  out = pathlib.Path(args.out or default)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(report, indent=1, default=str) + '\n')
  print(f'wrote {out}')
  return 0


if __name__ == '__main__':
  raise SystemExit(main())
