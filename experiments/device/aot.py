"""Compiles the trainer's step for an H100/H200/GH200 on a machine with no GPU.

  python -m experiments.device.aot                  # the 1B step on H200
  python -m experiments.device.aot --small          # tiny sizes (the tests')
  python -m experiments.device.aot --capacity       # largest model that fits

For each case (optax.adamw, or one of superoffload's executors; scanned or
unrolled layers; fp32 or bf16 parameters; ZeRO over several GPUs) it prints
and saves as JSON: whether it compiles (and the error if not),
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
      built = aot_steps.build(case)
      topology = deviceless.topology(case.gpu, case.devices)
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


def cases(args: argparse.Namespace) -> list[dict[str, Any]]:
  """The cases the command line asks for, as Case fields."""
  from experiments.device import aot_steps

  out = []
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
          gpu=args.gpu,
          overlap_scan=not args.after_loop,
          overrides=(SMALL if args.small else ()) + (('dtype', args.dtype),),
        )
        out.append(dataclasses.asdict(case))
  return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument(
    '--gpu', default='h200', help='h100, h200 or gh200; --capacity: a list'
  )
  p.add_argument('--preset', default='1b', help='A trainer config (configs/).')
  p.add_argument('--optimizers', default='optax,stream,ffi,device')
  p.add_argument('--layouts', default='scan,noscan')
  p.add_argument('--param-dtypes', default='float32')
  p.add_argument('--dtype', default='bfloat16', help='Activation dtype.')
  p.add_argument('--layers', type=int, default=None)
  p.add_argument('--batch', type=int, default=4)
  p.add_argument('--devices', type=int, default=1, help='>1: ZeRO over GPUs.')
  p.add_argument('--small', action='store_true', help='Tiny widths (tests).')
  p.add_argument(
    '--after-loop',
    action='store_true',
    help='Scanned blocks start their host steps after the backward loop '
    '(the trainer without overlap_scan).',
  )
  p.add_argument('--timeout', type=float, default=1800, help='Per case, s.')
  p.add_argument('--json', default='results/tmp/aot.json')
  p.add_argument('--capacity', action='store_true')
  p.add_argument('--one', help=argparse.SUPPRESS)
  return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  if args.one:
    print(_MARK + json.dumps(compile_case(json.loads(args.one))), flush=True)
    return 0
  if args.capacity:
    from experiments.device import aot_capacity

    return aot_capacity.main(args)
  results = []
  path = pathlib.Path(args.json)
  path.parent.mkdir(parents=True, exist_ok=True)
  for fields in cases(args):
    result = run_case(fields, args.timeout)
    results.append(result)
    print(aot_table.row(result), flush=True)
    path.write_text(json.dumps(results, indent=1) + '\n')  # As it goes.
  print(aot_table.table(results))
  print(f'wrote {path}')
  return 0 if all(r.get('compiles') for r in results) else 1


if __name__ == '__main__':
  sys.exit(main())
