"""Compiles small train steps for a GPU, without one (run by a test).

    python tests/gpu_compile_worker.py CASE [CASE ...]

Each CASE is a step `superoffload.adamw` takes that the trainer's cases
(experiments/device/aot_steps.py) do not build: parameters with an empty
leaf beside full ones, or the optimizer inside an optax wrapper. Prints,
per case, one JSON line: whether it compiled (or the error's first
line), and `hlo_report.summarize`'s device/host GB, copies, reads before
its joins and custom calls. The step donates its parameters and state.
"""

from __future__ import annotations

import json
import sys

from experiments.device import deviceless

deviceless.add_plugin_path()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import jax_superoffload as superoffload  # noqa: E402
from experiments.device import hlo_report  # noqa: E402

WIDTH = 256
# name: (param dtype, adamw keyword arguments, Offload options, wrapper).
CASES = {
  'empty_fp32': (jnp.float32, {}, {}, None),
  'empty_bf16': (jnp.bfloat16, {}, {}, None),
  'empty_bf16_moments': (jnp.bfloat16, {'mu_dtype': jnp.bfloat16}, {}, None),
  'empty_stv': (jnp.float32, {}, {'clip_norm': 1.0}, None),
  'empty_stv_bf16': (jnp.bfloat16, {}, {'clip_norm': 1.0}, None),
  'multisteps': (jnp.float32, {}, {}, lambda tx: optax.MultiSteps(tx, 2)),
  'apply_if_finite': (
    jnp.float32,
    {},
    {},
    lambda tx: optax.apply_if_finite(tx, 3),
  ),
}


def _loss(params, x):
  h = jnp.tanh(x @ params['a'].astype(jnp.float32))
  h = h + jnp.sum(params['empty'])
  return jnp.mean((h @ params['b'].astype(jnp.float32)) ** 2)


def _compile(name: str) -> dict:
  dtype, kwargs, options, wrap = CASES[name]
  offload = superoffload.Offload(executor='stream', **options)
  tx = superoffload.adamw(1e-3, offload=offload, **kwargs)
  tx = wrap(tx) if wrap else tx
  shapes = {'a': (WIDTH, WIDTH), 'b': (WIDTH, WIDTH), 'empty': (0, 3)}
  params = {k: jnp.zeros(s, dtype) for k, s in shapes.items()}
  params = jax.device_put(params, jax.devices()[0])
  opt_state = tx.init(params)

  def step(params, opt_state, x):
    grads = jax.grad(_loss)(params, x)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  args = (params, opt_state, jnp.ones((64, WIDTH)))
  topology = deviceless.topology('h100')
  donate = {'donate_argnums': (0, 1)}  # As a train step does.
  try:
    compiled = deviceless.compile_for_gpu(step, args, topology, donate)
  except Exception as e:  # The test reads what failed.
    return {'case': name, 'compiles': False, 'error': str(e).splitlines()[0]}
  summary = hlo_report.summarize(compiled.hlo, compiled.memory)
  keys = ('device_GB', 'host_GB', 'copies', 'reads_before_join')
  keys += ('custom_calls',)
  return {'case': name, 'compiles': True, **{k: summary[k] for k in keys}}


def main(names: list[str]) -> int:
  with superoffload.compiling_for('gpu'):
    for name in names:
      print(json.dumps(_compile(name), default=str), flush=True)
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
