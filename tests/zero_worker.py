"""One process of the multi-process ZeRO test (run by test_multiprocess.py).

    python tests/zero_worker.py OUT.json [--coordinator HOST:PORT
        --num-processes N --process-id I] [--local-devices D]

Trains a small MLP for `STEPS` steps with `superoffload.adamw(mesh=...,
shard_axis='data')` over every device of the run (all processes), the
batch sharded along 'data', and writes the per-step losses, the final
parameters and the layout of this process's state shards to OUT.json.
Without --coordinator it is a single process with D fake CPU devices.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _parse() -> argparse.Namespace:
  parser = argparse.ArgumentParser()
  parser.add_argument('out')
  parser.add_argument('--coordinator')
  parser.add_argument('--num-processes', type=int, default=1)
  parser.add_argument('--process-id', type=int, default=0)
  parser.add_argument('--local-devices', type=int, default=1)
  parser.add_argument('--steps', type=int, default=20)
  return parser.parse_args()


def main() -> int:
  args = _parse()
  os.environ['XLA_FLAGS'] = (
    f'--xla_force_host_platform_device_count={args.local_devices}'
  )
  import jax

  if args.coordinator:
    # CPU collectives between processes go through gloo.
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
    jax.distributed.initialize(
      args.coordinator,
      num_processes=args.num_processes,
      process_id=args.process_id,
      local_device_ids=list(range(args.local_devices)),
    )
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jax_superoffload as superoffload

  mesh = jax.make_mesh((jax.device_count(),), ('data',))
  rng = np.random.default_rng(0)
  params_np = {
    'w1': (rng.standard_normal((13, 40)) * 0.3).astype(np.float32),
    'b1': np.zeros(40, np.float32),
    'w2': (rng.standard_normal((40, 5)) * 0.3).astype(np.float32),
  }
  x_np = rng.standard_normal((64, 13)).astype(np.float32)
  y_np = rng.standard_normal((64, 5)).astype(np.float32)

  def global_array(value: np.ndarray, spec: P) -> jax.Array:
    # Every process holds the whole value and contributes its shards.
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(
      value.shape, sharding, lambda index: value[index]
    )

  params = {k: global_array(v, P()) for k, v in params_np.items()}
  x, y = global_array(x_np, P('data')), global_array(y_np, P('data'))
  tx = superoffload.adamw(
    1e-2, weight_decay=1e-3, bucket_bytes=1024, mesh=mesh, shard_axis='data'
  )
  state = tx.init(params)

  def loss_fn(p, x, y):
    h = jnp.tanh(x @ p['w1'] + p['b1'])
    return jnp.mean((h @ p['w2'] - y) ** 2)

  @jax.jit
  def step(p, s, x, y):
    loss, g = jax.value_and_grad(loss_fn)(p, x, y)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, loss

  losses = []
  for _ in range(args.steps):
    params, state, loss = step(params, state, x, y)
    losses.append(float(np.asarray(loss.addressable_data(0))))
  shards = [
    {
      'size': int(b.size),
      'local_shard_sizes': [int(s.data.size) for s in b.addressable_shards],
      'memory_kind': b.sharding.memory_kind,
    }
    for b in jax.tree.leaves((state.master, state.mu, state.nu))
  ]
  result = {
    'process_count': jax.process_count(),
    'device_count': jax.device_count(),
    'losses': losses,
    'params': {
      k: np.asarray(v.addressable_data(0)).ravel().tolist()
      for k, v in params.items()
    },
    'state': shards,
  }
  with open(args.out, 'w') as f:
    json.dump(result, f)
  if args.coordinator:
    jax.distributed.shutdown()
  return 0


if __name__ == '__main__':
  sys.exit(main())
