"""Writes the fixture of `tests/test_state_layout.py`'s legacy checkpoint.

Run with the code BEFORE the optax-shaped state layout (main at 1182c2a, whose
`SuperOffloadState` was one flat NamedTuple), from the repository root:

  PYTHONPATH=$PWD python tests/data/make_legacy_state_ckpt.py tests/data

It saves `{'params', 'opt_state'}` of `optax.chain(clip_by_global_norm,
superoffload.adamw)` after two steps with Orbax's StandardCheckpointer into
`legacy_state_ckpt/`, and the updates of the third step, computed by that
same old code, into `legacy_state_next_updates.npz`.
"""

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import jax_superoffload as superoffload


def params0():
  return {
    'b': jnp.arange(3, dtype=jnp.float32) / 4,
    'w': jnp.arange(12, dtype=jnp.float32).reshape(4, 3) / 8 - 0.5,
  }


def grads(params, k):
  return jax.tree.map(lambda p: jnp.sin(p * (k + 1)) + 0.1, params)


def tx():
  return optax.chain(optax.clip_by_global_norm(1.0), superoffload.adamw(1e-2))


def main(folder: pathlib.Path) -> None:
  params, opt = params0(), tx()
  state = opt.init(params)
  for k in range(2):
    updates, state = opt.update(grads(params, k), state, params)
    params = optax.apply_updates(params, updates)
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(
    folder / 'legacy_state_ckpt', {'params': params, 'opt_state': state}
  )
  ckptr.wait_until_finished()
  updates, _ = opt.update(grads(params, 2), state, params)
  np.savez(
    folder / 'legacy_state_next_updates.npz',
    **{k: np.asarray(v) for k, v in updates.items()},
  )


if __name__ == '__main__':
  main(pathlib.Path(sys.argv[1]).resolve())
