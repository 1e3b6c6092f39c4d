"""MaxText's train step compiled for an H200 without a GPU, three ways.

    python -m experiments.maxtext.aot [--json FILE] [-- key=value ...]

Compiles MaxText's own train step (as its `train_compile` builds it:
abstract state, its shardings and its `train_step`) for one H200 with the
deviceless harness (`experiments.device.deviceless`), once per way:

- `stock`: MaxText's `optax.adamw`, state in device memory;
- `maxtext_offload`: the same with MaxText's `optimizer_memory_host_offload`
  (state in pinned_host between steps, moved to the device to update);
- `superoffload`: through `jax_superoffload.integrations.maxtext`, with
  the default executor (`auto`: `stream` on a GPU) and with `ffi`.

Each in a process of its own. Prints a table (device and host GB, bytes
copied each way per step, the predicted step) and writes the JSON. The
default model is MaxText's base.yml (1.1B parameters: 16 layers of width
2048, MLP 7168, vocabulary 32000, bf16 compute, fp32 weights), sequence
2048, batch 4; `key=value` arguments override MaxText's config.

The prediction uses `experiments.device.predict_step`'s H200 rates
(measured 2026-12-04): the forward and backward of optax's step, plus, for
state copied to and from the device, those copies over PCIe on the
critical path (MaxText's flag copies before and after the update); for
superoffload, predict_step's model of the host step. No time here is
measured.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import traceback

_MARK = 'MAXTEXT_AOT_JSON '
WAYS = ('stock', 'maxtext_offload', 'superoffload')
# Each compiled (way, superoffload's executor): `auto` is what a plain
# superoffload.adamw is on a GPU (stream), `ffi` the earlier default.
RUNS = (
  ('stock', 'auto'),
  ('maxtext_offload', 'auto'),
  ('superoffload', 'auto'),
  ('superoffload', 'ffi'),
)
_ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFAULTS = {
  'run_name': 'aot',
  'base_output_directory': '/tmp/maxtext_aot',
  'dataset_type': 'synthetic',
  'hardware': 'cpu',  # The mesh is built on CPU devices (host memory).
  'skip_jax_distributed_system': 'true',
  'enable_checkpointing': 'false',
  'max_target_length': 2048,
  'per_device_batch_size': 4,
  'steps': 10,
  'attention': 'dot_product',
}


def _config(overrides: list[str]) -> object:
  from maxtext.configs import pyconfig

  from experiments.maxtext import tiny

  values = [f'{k}={v}' for k, v in DEFAULTS.items()] + overrides
  return pyconfig.initialize(['aot', tiny.base_config(), *values])


def _step(config) -> tuple:
  """MaxText's train step and its abstract arguments, as it compiles them."""
  from maxtext.trainers.pre_train import train
  from maxtext.trainers.pre_train import train_compile
  from maxtext.utils import maxtext_utils
  from maxtext.utils import sharding

  mesh = maxtext_utils.get_mesh_from_config(config)
  args, kwargs, state_shardings, _, model = train_compile.get_shaped_inputs(
    mesh, config
  )
  params_shardings, state_shardings = (
    sharding.maybe_update_params_sharding_with_opt(config, state_shardings)
  )
  input_shardings = sharding.build_zero1_input_state_mesh_shardings(
    config, state_shardings, params_shardings
  )
  data_sharding = sharding.get_input_data_sharding(config, mesh)
  fn, in_shard, out_shard, static, donate = (
    maxtext_utils.get_functional_train_with_signature(
      train.train_step,
      data_sharding,
      input_shardings,
      model,
      config,
      params_shardings,
    )
  )
  jit_kwargs = {
    'in_shardings': in_shard,
    'out_shardings': out_shard,
    'static_argnums': static,
    'donate_argnums': donate,
  }
  return mesh, fn, jit_kwargs, args, kwargs


def compile_way(way: str, executor: str, overrides: list[str]) -> dict:
  """Compiles one way in this process; JAX must not be imported yet."""
  from experiments.device import deviceless

  deviceless.add_plugin_path()
  import jax
  from flax.linen import partitioning

  import jax_superoffload as superoffload
  from experiments.device import hlo_report

  if way == 'superoffload':
    from jax_superoffload.integrations import maxtext

    maxtext.apply(superoffload.Offload(executor=executor))
  flag = 'true' if way == 'maxtext_offload' else 'false'
  config = _config([*overrides, f'optimizer_memory_host_offload={flag}'])
  with superoffload.compiling_for('gpu'):
    mesh, fn, jit_kwargs, args, kwargs = _step(config)
    with jax.set_mesh(mesh), partitioning.axis_rules(config.logical_axis_rules):
      assert not kwargs, kwargs  # NNX's step takes (state, batch).
      compiled = deviceless.compile_for_gpu(
        jax.jit(fn, **jit_kwargs), args, deviceless.topology('h200')
      )
  params = sum(
    x.size
    for x in jax.tree.leaves(args[0].model)
    if getattr(x, 'dtype', None) is not None and x.ndim
  )
  return {
    'way': way,
    'executor': executor if way == 'superoffload' else None,
    'batch': int(config.per_device_batch_size),
    'jax': jax.__version__,
    'compile_s': round(compiled.seconds, 1),
    'num_params': int(params),
    'memory': compiled.memory,
    **hlo_report.summarize(compiled.hlo, compiled.memory),
  }


def _run_way(way: str, executor: str, overrides: list[str]) -> dict:
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu', 'TF_CPP_MIN_LOG_LEVEL': '2'}
  env.pop('JAX_COMPILATION_CACHE_DIR', None)  # A whole compile each time.
  command = [sys.executable, '-m', 'experiments.maxtext.aot', '--one', way]
  done = subprocess.run(
    [*command, '--executor', executor, '--', *overrides],
    capture_output=True,
    text=True,
    env=env,
    cwd=_ROOT,
    check=False,
    timeout=3600,
  )
  for line in done.stdout.splitlines():
    if line.startswith(_MARK):
      return json.loads(line[len(_MARK) :])
  tail = (done.stderr or done.stdout)[-2000:]
  return {'way': way, 'error': f'exit {done.returncode}: {tail}'}


def _args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--json', help='where the JSON goes')
  parser.add_argument('--executor', default='auto', help=argparse.SUPPRESS)
  parser.add_argument('--one', choices=WAYS, help=argparse.SUPPRESS)
  cut = argv.index('--') if '--' in argv else len(argv)
  return parser.parse_args(argv[:cut]), argv[cut + 1 :]


def main(argv: list[str] | None = None) -> int:
  args, overrides = _args(sys.argv[1:] if argv is None else argv)
  if args.one:
    try:
      result = compile_way(args.one, args.executor, overrides)
    except Exception as e:  # The error is the finding.
      result = {'way': args.one, 'error': traceback.format_exc()[-3000:]}
      del e
    print(_MARK + json.dumps(result))
    return 0
  from experiments.maxtext import aot_table

  results = [_run_way(way, executor, overrides) for way, executor in RUNS]
  table = aot_table.table(results, overrides)
  print(table['text'])
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(table, indent=1))
  return 0 if all('error' not in r for r in results) else 1


if __name__ == '__main__':
  sys.exit(main())
