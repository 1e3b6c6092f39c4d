"""One MaxText pre-train run, stock or through superoffload's entry, recorded.

    python -m experiments.maxtext.run --optimizer superoffload \
      --devices 2 --out run.json -- <MaxText config> key=value ...

Runs MaxText's own pre-train main in this process and writes a JSON of:
the loss of every step (MaxText's metrics file), where each optimizer
state leaf lives after MaxText's init (`init_memory`) and in its compiled
train step's input (`step_memory`), and the compiled step's copies that
touch host memory (`step_copies`, from `experiments.device.hlo_report`).
`--devices` fakes that many CPU devices (set before JAX starts, in
place of any count the environment sets).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import sys
import tempfile


def _args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument(
    '--optimizer', choices=('stock', 'superoffload'), required=True
  )
  parser.add_argument('--devices', type=int, default=1)
  parser.add_argument('--out', required=True, help='the JSON written')
  cut = argv.index('--') if '--' in argv else len(argv)
  return parser.parse_args(argv[:cut]), argv[cut + 1 :]


def _kinds(tree, shardings=None) -> dict[str, str]:
  """The memory kind of each optimizer-state array, by its path.

  `shardings`: a tree of them for `tree`'s leaves (else their own).
  """
  import jax

  leaves = jax.tree_util.tree_leaves_with_path(tree)
  if shardings is None:
    shardings = [x.sharding for _, x in leaves]
  else:
    shardings = jax.tree.leaves(shardings)
  out = {}
  for (path, x), sharding in zip(leaves, shardings, strict=True):
    if 'opt_state' in jax.tree_util.keystr(path) and len(x.shape):
      out[jax.tree_util.keystr(path)] = sharding.memory_kind
  return out


def _record(record: dict) -> None:
  """Wraps MaxText's setup and step jit to record placements."""
  from maxtext.utils import train_utils

  setup, jit_steps = train_utils.setup_train_loop, train_utils.jit_train_step

  def setup_recorded(*args, **kwargs):
    out = setup(*args, **kwargs)
    record['init_memory'] = _kinds(out[-1])
    return out

  def jit_recorded(*args, **kwargs):
    return _FirstCallRecorded(jit_steps(*args, **kwargs), record)

  train_utils.setup_train_loop = setup_recorded
  train_utils.jit_train_step = jit_recorded


class _FirstCallRecorded:
  """A jitted step that records its compiled placements on its first call.

  Inside MaxText's loop (its mesh set); everything else is the step's own.
  """

  def __init__(self, step, record: dict):
    self._step, self._record = step, record

  def __getattr__(self, name):
    return getattr(self._step, name)

  def __call__(self, state, *rest):
    import jax

    if 'step_memory' not in self._record:
      abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        (state, *rest),
      )
      traced = self._step.trace(*abstract)
      self._record['state_to_device'] = state_to_device(
        traced.jaxpr, len(jax.tree.leaves(abstract[0]))
      )
      compiled = traced.lower().compile()
      self._record['step_memory'] = _kinds(
        abstract[0], compiled.input_shardings[0][0]
      )
      hlo = compiled.as_text()
      self._record['step_copies'] = _copies(hlo)
      self._record['step_collectives'] = {
        op: len(re.findall(rf'= [^=]* {op}(?:-start)?\(', hlo))
        for op in ('all-gather', 'all-reduce', 'reduce-scatter', 'all-to-all')
      }
    return self._step(state, *rest)


# Operations that only move, view or convert a value: what a state leaf
# becomes through them is still the state.
_PASS_THROUGH = {
  'reshape',
  'squeeze',
  'expand_dims',
  'convert_element_type',
  'slice',
  'dynamic_slice',
  'copy',
  'copy_p',
  'transpose',
  'broadcast_in_dim',
}


def state_to_device(closed, state_leaves: int) -> list[dict]:
  """Each move of a state leaf from host to device memory in a step.

  `closed`: the step's traced jaxpr, whose first `state_leaves` inputs
  are the train state's leaves. A move is a `device_put` into device
  memory of one of them (or of what it became through `_PASS_THROUGH`
  operations), in the step or in any jaxpr it calls.
  """

  def walk(jaxpr, tracked, out):
    for eqn in jaxpr.eqns:
      hit = [v for v in _variables(eqn.invars) if v in tracked]
      if not hit:
        continue
      if eqn.primitive.name == 'device_put':
        for v, o in zip(eqn.invars, eqn.outvars, strict=True):
          moved = _space(o.aval) == 'Device' != _space(v.aval)
          if v in hit and moved:
            out.append(
              {'shape': list(o.aval.shape), 'dtype': str(o.aval.dtype)}
            )
      elif eqn.primitive.name in _PASS_THROUGH:
        tracked.update(eqn.outvars)
      for sub in _called(eqn):
        inner = {
          iv
          for iv, v in zip(sub.invars, eqn.invars, strict=False)
          if any(v is h for h in hit)
        }
        walk(sub, inner, out)

  out: list[dict] = []
  walk(closed.jaxpr, set(closed.jaxpr.invars[:state_leaves]), out)
  return out


def _variables(xs) -> list:
  """The variables among an equation's inputs (not its literals)."""
  return [v for v in xs if type(v).__name__ != 'Literal']


def _space(aval) -> str:
  return str(getattr(aval, 'memory_space', '')).rsplit('.', 1)[-1]


def _called(eqn) -> list:
  """The jaxprs an equation calls whose inputs are its own, in order."""
  out = []
  for key in ('jaxpr', 'call_jaxpr', 'fun_jaxpr'):
    sub = eqn.params.get(key)
    if sub is not None:
      out.append(getattr(sub, 'jaxpr', sub))
  return out


def _copies(hlo: str) -> dict:
  from experiments.device import hlo_report

  return hlo_report.copies(hlo_report.timeline(hlo))


def main(argv: list[str] | None = None) -> None:
  args, maxtext_args = _args(sys.argv[1:] if argv is None else argv)
  flags = [
    f
    for f in os.environ.get('XLA_FLAGS', '').split()
    if not f.startswith('--xla_force_host_platform_device_count=')
  ]
  flags.append(f'--xla_force_host_platform_device_count={args.devices}')
  os.environ['XLA_FLAGS'] = ' '.join(flags)
  from absl import app
  from maxtext.trainers.pre_train import train

  record: dict = {'optimizer': args.optimizer, 'args': maxtext_args}
  metrics = pathlib.Path(tempfile.mkdtemp()) / 'metrics.txt'
  _record(record)
  if args.optimizer == 'superoffload':
    from jax_superoffload.integrations import maxtext

    maxtext.apply()
  argv = [train.__file__, *maxtext_args, f'metrics_file={metrics}']
  try:
    app.run(train.main, argv=argv)
  except SystemExit as e:
    if e.code not in (0, None):
      raise
  lines = [json.loads(line) for line in metrics.read_text().splitlines()]
  record['losses'] = {int(m['step']): m['learning/loss'] for m in lines}
  pathlib.Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == '__main__':
  main()
