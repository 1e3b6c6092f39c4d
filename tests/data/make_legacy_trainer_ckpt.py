"""Writes the fixture of the trainer's checkpoint of the old state layout.

Run with the code BEFORE the optax-shaped state layout (main at 1182c2a, whose
`SuperOffloadState` was one flat NamedTuple), from the repository root:

  PYTHONPATH=$PWD python tests/data/make_legacy_trainer_ckpt.py tests/data

It saves, with the trainer's `RunCheckpointer`, the `nnx.state` of a small
model and its `nnx.Optimizer(optax.chain(clip_by_global_norm,
superoffload.adamw))` after two steps into `legacy_trainer_ckpt/` (step 2),
and the parameters one step later, computed by that same old code, into
`legacy_trainer_next_params.npz`.
"""

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jax_superoffload as superoffload
from experiments.trainer import checkpointing


def build():
  model = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
  tx = optax.chain(optax.clip_by_global_norm(1.0), superoffload.adamw(1e-2))
  return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


def step(model, optimizer, k):
  x = jnp.linspace(-1.0, 1.0, 6 * 3).reshape(6, 3) * (k + 1)
  loss = lambda m: jnp.mean(jnp.sin(m(x)) ** 2)  # noqa: E731
  optimizer.update(model, nnx.grad(loss)(model))


def main(folder: pathlib.Path) -> None:
  model, optimizer = build()
  for k in range(2):
    step(model, optimizer, k)
  ckpt = checkpointing.RunCheckpointer(folder / 'legacy_trainer_ckpt')
  ckpt.save(2, nnx.state((model, optimizer)), {})
  ckpt.close()
  step(model, optimizer, 2)
  save_params(model, folder / 'legacy_trainer_next_params.npz')


def save_params(model, path: pathlib.Path) -> None:
  """The model's parameters, keyed by their paths, into `path`."""
  params = nnx.state(model, nnx.Param)
  np.savez(
    path,
    **{
      jax.tree_util.keystr(p): np.asarray(x)
      for p, x in jax.tree_util.tree_leaves_with_path(params)
    },
  )


if __name__ == '__main__':
  main(pathlib.Path(sys.argv[1]).resolve())
