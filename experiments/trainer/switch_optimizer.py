"""Resuming a checkpoint of optax.adamw with superoffload, and the reverse.

The two optimizers keep the same Adam moments, shaped like the parameters
(`superoffload.export_adam_state` / `import_adam_state`), so a checkpoint of
one restores into a model and optimizer built as the other's run was, and
its parameters, step and moments move over exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jax_superoffload as superoffload
from experiments.trainer import config as config_lib
from experiments.trainer import steps as steps_lib

# Optimizers whose checkpoints convert into each other ("device" is
# superoffload's state too).
SWITCHABLE = frozenset({'optax', 'superoffload', 'device'})
# Config fields that shape the optimizer state of the saved run.
_STATE_FIELDS = ('optimizer', 'clip_norm', 'skip_nonfinite', 'executor')


def can_switch(saved: dict[str, Any], cfg: config_lib.Config) -> bool:
  """Whether a checkpoint of config `saved` converts to `cfg`'s optimizer."""
  pair = {saved.get('optimizer'), cfg.optimizer}
  return (
    len(pair) == 2
    and pair <= SWITCHABLE
    and 'optax' in pair
    and cfg.grad_accum == 1
    and saved.get('grad_accum', 1) == 1
    and not cfg.zero
    and not saved.get('zero')
  )


def saved_build(
  checkpointer: Any, cfg: config_lib.Config, plan: Any
) -> tuple[steps_lib.Trainable | None, str]:
  """The model and optimizer as the newest checkpoint's run built them.

  Returns:
    That build (to restore into) and its optimizer's name when the
    checkpoint's optimizer state converts to `cfg`'s; else None and
    `cfg.optimizer` (the checkpoint restores as is, or is refused).
  """
  newest = checkpointer.latest_step()
  if newest is None:
    return None, cfg.optimizer
  try:
    saved = checkpointer.read_meta(newest)['config']
  except Exception:
    return None, cfg.optimizer
  if not can_switch(saved, cfg):
    return None, cfg.optimizer
  fields = {k: saved[k] for k in _STATE_FIELDS if k in saved}
  build = steps_lib.build(dataclasses.replace(cfg, **fields), plan.mesh)
  return build, saved['optimizer']


def _pure(optimizer: nnx.Optimizer) -> Any:
  return nnx.as_pure(optimizer.opt_state)


def _params(model: Any) -> Any:
  return nnx.as_pure(nnx.state(model, nnx.Param))


def _replace_adam(fresh: Any, adam: optax.ScaleByAdamState) -> Any:
  """`fresh` (an optax state) continuing from `adam`.

  Its ScaleByAdamState becomes `adam`, and the step count of its learning
  rate schedule `adam.count` (superoffload's schedule reads that count).
  """

  def place(new_tree, like_tree):
    leaves = [
      # A copy each: no two state leaves may share a (donated) buffer.
      jax.device_put(jnp.array(x, like.dtype, copy=True), like.sharding)
      for x, like in zip(
        jax.tree.leaves(new_tree), jax.tree.leaves(like_tree), strict=True
      )
    ]
    return jax.tree.unflatten(jax.tree.structure(like_tree), leaves)

  def swap(x):
    if isinstance(x, optax.ScaleByScheduleState):  # The schedule's step.
      return optax.ScaleByScheduleState(count=place(adam.count, x.count))
    if not isinstance(x, optax.ScaleByAdamState):
      return x
    return optax.ScaleByAdamState(
      count=place(adam.count, x.count),
      mu=place(adam.mu, x.mu),
      nu=place(adam.nu, x.nu),
    )

  kinds = (optax.ScaleByAdamState, optax.ScaleByScheduleState)
  return jax.tree.map(swap, fresh, is_leaf=lambda x: isinstance(x, kinds))


def convert(
  restored: Any, saved: steps_lib.Trainable, trainable: steps_lib.Trainable
) -> Any:
  """`trainable`'s state from `restored`, a state of the `saved` build."""
  nnx.update((saved.model, saved.optimizer), restored)
  nnx.update(trainable.model, nnx.state(saved.model))
  trainable.optimizer.step[...] = saved.optimizer.step[...]
  theirs = _pure(saved.optimizer)
  if isinstance(_pure(trainable.optimizer), superoffload.SuperOffloadState):
    new = superoffload.import_adam_state(
      trainable.optimizer.tx, _params(trainable.model), theirs
    )
  else:
    new = _replace_adam(
      _pure(trainable.optimizer), superoffload.export_adam_state(theirs)
    )
  nnx.update(trainable.optimizer.opt_state, nnx.state(new))
  return nnx.state((trainable.model, trainable.optimizer))
