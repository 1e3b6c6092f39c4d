"""Compiles the trainer's step for an H100/H200/GH200 on a machine with no GPU.

  python -m experiments.device.aot                  # the 1B step on H200
  python -m experiments.device.aot --small          # tiny sizes (the tests')
  python -m experiments.device.aot --gpu h100 --layers 4 --d-model 1024
  python -m experiments.device.aot --capacity       # largest model that fits

For each case (optax.adamw, or one of superoffload's executors: `auto` is
what a plain `superoffload.adamw(...)` resolves to on a GPU, resolved in
the compiling process; scanned or unrolled layers; fp32 or bf16
parameters; ZeRO over several GPUs) it prints and saves as JSON: whether it
compiles (and the error if not),
`memory_analysis()` on the device and the host, the copies between device
and host memory by direction and bytes (host-to-host ones included), the
custom calls with their streams, host-compute (`HostExecute`) calls, and
where each optimizer call starts and where the compute stream first waits
for one, as a fraction of the backward pass's GEMM FLOPs issued before it.

Limits (see deviceless.py): JAX private API, checked on `CHECKED_JAX`; no
autotuning without a GPU, so no time printed here is a step time. Each case
compiles in its own process (an abort in XLA is a finding, not the end).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import traceback
from typing import Any

from experiments.device import aot_table

SMALL = (
  ('d_model', 256),
  ('mlp_dim', 512),
  ('num_heads', 4),
  ('seq_len', 256),
)
# The model's shape flags and the trainer config field each one sets.
SHAPE_FLAGS = (
  ('d_model', 'd_model', 'Width of the residual stream.'),
  ('heads', 'num_heads', 'Attention heads; must divide --d-model.'),
  ('mlp_dim', 'mlp_dim', 'Hidden width of each MLP.'),
  ('seq_len', 'seq_len', 'Tokens per sequence.'),
  ('vocab', 'vocab_size', 'Vocabulary size.'),
)
DEFAULT_JSON = 'results/tmp/aot.json'
_MARK = 'AOT_CASE_JSON '


def compile_case(case_fields: dict[str, Any]) -> dict[str, Any]:
  """Compiles one case in this process; JAX must not be imported yet."""
  from experiments.device import deviceless

  deviceless.add_plugin_path()
  import jax

  import jax_superoffload as superoffload
  from experiments.device import aot_steps
  from experiments.device import hlo_report

  case = aot_steps.Case(
    **{**case_fields, 'overrides': tuple(map(tuple, case_fields['overrides']))}
  )
  result: dict[str, Any] = {'case': case.name, 'fields': case_fields}
  result['jax'] = jax.__version__
  try:
    with superoffload.compiling_for('gpu'):
      result.update(resolved_executor(case))
      built = aot_steps.build(case)
      topology = deviceless.topology(case.gpu, case.devices)
      result['device_kind'] = topology.devices[0].device_kind
      compiled = deviceless.compile_for_gpu(built.step, built.args, topology)
  except Exception as e:  # The error is the finding.
    lines = traceback.format_exception_only(e)
    return {**result, 'compiles': False, 'error': ''.join(lines)[-2000:]}
  result.update(
    compiles=True,
    compile_s=round(compiled.seconds, 1),
    num_params=built.num_params,
    state_bytes=built.state_bytes,
    state_GB={k: round(v / 1e9, 3) for k, v in built.state_bytes.items()},
    memory=compiled.memory,
    **hlo_report.summarize(compiled.hlo, compiled.memory),
  )
  dump = os.environ.get('AOT_DUMP_HLO')
  if dump:
    path = pathlib.Path(dump) / f'{case.name.replace(":", "_")}.hlo'
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(compiled.hlo)
  return result


SCAN_ROWS_ENV = 'JAX_SUPEROFFLOAD_SCAN_ROWS'


def resolved_executor(case: Any) -> dict[str, Any]:
  """The executor a case compiles, `auto` resolved as the library does.

  Call it inside `compiling_for('gpu')`. On a GPU, `auto` is `ffi` where
  Grace Adam could be filed as host compute in the CUDA plugin (the one
  this process found), else `xla_host`.
  """
  import jax_superoffload as superoffload

  if case.optimizer in ('optax', 'device'):
    return {'executor': None if case.optimizer == 'optax' else 'device'}
  resolved = superoffload.resolve_executor(case.optimizer)
  out: dict[str, Any] = {'executor': resolved}
  if case.optimizer == 'auto':
    out['case'] = case.name.replace('auto', f'auto={resolved}', 1)
    out['host_registration'] = superoffload.host_registration().reason
  # overlap_scan's rows read each layer's gradient, or with 'held' the
  # stack's (the library's experiment switch, read when the step traces).
  rows = os.environ.get(SCAN_ROWS_ENV, 'layer')
  if rows != 'layer' and case.layout == 'scan':
    out['scan_rows'] = rows
    out['case'] = f'{out.get("case", case.name)}:rows={rows}'
  return out


def run_case(case_fields: dict[str, Any], timeout: float) -> dict[str, Any]:
  """Compiles one case in a fresh process (its own XLA_FLAGS)."""
  env = dict(os.environ)
  devices = case_fields.get('devices', 1)
  env['XLA_FLAGS'] = (
    env.get('XLA_FLAGS', '')
    + f' --xla_force_host_platform_device_count={max(devices, 1)}'
  ).strip()
  env['JAX_PLATFORMS'] = 'cpu'
  env.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  # Each case's compile time is a finding (compared with optax's), so it
  # is a whole compile, never an executable read from a cache.
  env.pop('JAX_COMPILATION_CACHE_DIR', None)
  command = [sys.executable, '-m', 'experiments.device.aot', '--one']
  try:
    done = subprocess.run(
      [*command, json.dumps(case_fields)],
      capture_output=True,
      text=True,
      timeout=timeout,
      env=env,
      check=False,
      # From the checkout's root, as `python -m` from it: the package and
      # experiments/ come from where this venv takes them (a wheel's
      # module under PYTHONSAFEPATH, or the checkout's).
      cwd=pathlib.Path(__file__).resolve().parents[2],
    )
  except subprocess.TimeoutExpired:
    return {'fields': case_fields, 'compiles': False, 'error': 'timed out'}
  for line in done.stdout.splitlines():
    if line.startswith(_MARK):
      return json.loads(line[len(_MARK) :])
  tail = (done.stderr or done.stdout)[-1500:]
  return {
    'fields': case_fields,
    'compiles': False,
    'error': f'exit {done.returncode}: {tail}',
  }


def overrides(args: Any) -> tuple[tuple[str, Any], ...]:
  """Trainer config fields the command line sets, later ones winning.

  `--small`'s widths first, then the activation dtype, then each shape
  flag given (so `--small --seq-len 64` is the small model at 64 tokens).
  """
  out = (SMALL if args.small else ()) + (('dtype', args.dtype),)
  for flag, field, _ in SHAPE_FLAGS:
    value = getattr(args, flag, None)
    if value is not None:
      out += ((field, value),)
  return out


def cases(args: argparse.Namespace) -> list[dict[str, Any]]:
  """The cases the command line asks for, as Case fields.

  Raises:
    ValueError: If a name or a shape is refused (the trainer's own checks
      of its config: e.g. heads that do not divide the width).
  """
  from experiments.device import aot_steps
  from experiments.trainer import config as config_lib

  out = []
  for gpu in args.gpu.split(','):
    for optimizer in args.optimizers.split(','):
      for layout in args.layouts.split(','):
        for dtype in args.param_dtypes.split(','):
          case = aot_steps.Case(
            optimizer=optimizer,
            layout=layout,
            param_dtype=dtype,
            preset=args.preset,
            layers=args.layers,
            batch=args.batch,
            devices=args.devices,
            gpu=gpu,
            overlap_scan=not args.after_loop,
            overrides=overrides(args),
          )
          config_lib.validate(aot_steps.trainer_config(case))
          out.append(dataclasses.asdict(case))
  return out


def describe(fields: dict[str, Any]) -> str:
  """One line: the model a case compiles, and for which GPU."""
  from experiments.device import aot_planner
  from experiments.device import gpu_targets

  cfg = aot_planner.trainer_config(fields)
  return (
    f'model: {cfg.preset} preset, {cfg.num_layers} layers, d_model '
    f'{cfg.d_model}, {cfg.num_heads} heads, mlp {cfg.mlp_dim}, seq_len '
    f'{cfg.seq_len}, batch {cfg.batch_size}, vocab {cfg.vocab_size}, '
    f'activations {cfg.dtype}; for {gpu_targets.TARGETS[fields["gpu"]].name}'
  )


def _names(allowed: tuple[str, ...]) -> Any:
  """An argparse type: a comma-separated list of names from `allowed`."""

  def parse(text: str) -> str:
    unknown = [n for n in text.split(',') if n not in allowed]
    if unknown:
      raise argparse.ArgumentTypeError(
        f'{",".join(unknown)}: not one of {", ".join(allowed)}'
      )
    return text

  return parse


def _positive(text: str) -> int:
  value = int(text)
  if value < 1:
    raise argparse.ArgumentTypeError(f'must be at least 1, got {value}')
  return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  from experiments.device import aot_steps
  from experiments.device import gpu_targets

  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  target = p.add_argument_group('target')
  target.add_argument(
    '--gpu',
    default='h200',
    type=_names(tuple(gpu_targets.TARGETS)),
    help='GPUs to compile for, comma-separated (default h200): '
    + ', '.join(f'{k} ({t.name})' for k, t in gpu_targets.TARGETS.items()),
  )
  target.add_argument(
    '--devices', type=_positive, default=1, help='>1: ZeRO over that many GPUs.'
  )
  step = p.add_argument_group('the step')
  step.add_argument(
    '--optimizers',
    default='optax,auto,stream,device',
    type=_names(aot_steps.OPTIMIZERS),
    help='Comma-separated (default %(default)s): optax (optax.adamw on the '
    'GPU), auto (what superoffload.adamw(...) picks on a GPU: stream '
    'where the CUDA driver files its handlers, else ffi or xla_host), or an '
    'executor: stream, ffi, xla_host, device.',
  )
  step.add_argument(
    '--layouts',
    default='scan,noscan',
    type=_names(aot_steps.LAYOUTS),
    help='scan (lax.scan over the layers) and/or noscan (unrolled); '
    'default %(default)s.',
  )
  step.add_argument(
    '--param-dtypes',
    default='float32',
    help='float32 and/or bfloat16 (default %(default)s).',
  )
  step.add_argument(
    '--dtype', default='bfloat16', help='Activation dtype (%(default)s).'
  )
  step.add_argument(
    '--after-loop',
    action='store_true',
    help='Scanned blocks start their host steps after the backward loop '
    '(the trainer without overlap_scan).',
  )
  model = p.add_argument_group(
    'the model', "unset: the preset's (configs/PRESET.py)"
  )
  model.add_argument(
    '--preset', default='1b', help='A trainer config (default %(default)s).'
  )
  model.add_argument(
    '--layers', type=_positive, default=None, help='Transformer blocks.'
  )
  for flag, _, help_ in SHAPE_FLAGS:
    model.add_argument(
      '--' + flag.replace('_', '-'), dest=flag, type=_positive, help=help_
    )
  model.add_argument(
    '--batch', type=_positive, default=4, help='Sequences per step (4).'
  )
  model.add_argument(
    '--small',
    action='store_true',
    help="Tiny widths, the tests' (shape flags given still apply).",
  )
  run = p.add_argument_group('the run')
  run.add_argument(
    '--timeout', type=float, default=1800, help='Seconds per case (1800).'
  )
  run.add_argument(
    '--json',
    default=None,
    help=f'Where to write the results (default {DEFAULT_JSON}; --capacity: '
    'results/tmp/aot_capacity.json); written, never read.',
  )
  run.add_argument(
    '--capacity',
    action='store_true',
    help='The largest layer count each optimizer fits (aot_capacity).',
  )
  run.add_argument(
    '--cache-dir',
    default='build/aot_cache',
    help='--capacity: where compiles are kept for the next run, keyed by '
    "the JAX version and the library's git commit (default %(default)s, "
    'under the checkout).',
  )
  run.add_argument(
    '--fresh', action='store_true', help='--capacity: compile all again.'
  )
  return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if argv[:1] == ['--one']:  # run_case's process: JAX is not imported yet.
    print(_MARK + json.dumps(compile_case(json.loads(argv[1]))), flush=True)
    return 0
  args = parse_args(argv)
  if args.capacity:
    from experiments.device import aot_capacity

    return aot_capacity.main(args)
  try:
    todo = cases(args)
  except ValueError as e:  # The trainer's ConfigError is one.
    print(f'aot: {e}', file=sys.stderr)
    return 2
  results = []
  path = pathlib.Path(args.json or DEFAULT_JSON)
  path.parent.mkdir(parents=True, exist_ok=True)
  print(f'{len(todo)} cases, each compiled in its own process', flush=True)
  by_gpu: dict[str, list[dict[str, Any]]] = {}
  for fields in todo:
    if fields['gpu'] not in by_gpu:
      print(describe(fields), flush=True)
    result = run_case(fields, args.timeout)
    results.append(result)
    by_gpu.setdefault(fields['gpu'], []).append(result)
    print(aot_table.row(result), flush=True)
    path.write_text(json.dumps(results, indent=1) + '\n')  # As it goes.
  for gpu, gpu_results in by_gpu.items():
    first = next(f for f in todo if f['gpu'] == gpu)
    print(f'\n{describe(first)}\n{aot_table.table(gpu_results)}')
  print(f'wrote {path}')
  return 0 if all(r.get('compiles') for r in results) else 1


if __name__ == '__main__':
  sys.exit(main())
