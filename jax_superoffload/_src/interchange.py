"""Exact conversion between our state and optax's Adam state."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_superoffload._src import host_memory
from jax_superoffload._src import transform


def export_adam_state(
  state: transform.SuperOffloadState,
) -> optax.ScaleByAdamState:
  """The count and moments of `state` as optax's `ScaleByAdamState`.

  `mu` and `nu` are trees like the parameters (their current rows when
  double-buffered by STV), in device memory; with them in place of the
  `ScaleByAdamState` of `optax.adamw(...).init(params)`, optax continues
  the run exactly where ours stood (up to the fp32 master, which optax does
  not keep).

  Args:
    state: A `SuperOffloadState`.

  Returns:
    `optax.ScaleByAdamState(count, mu, nu)`.
  """
  if not isinstance(state, transform.SuperOffloadState):
    raise TypeError(f'expected a SuperOffloadState, got {type(state).__name__}')
  current = state.current()
  to_device = lambda t: jax.tree.map(host_memory.to_device, t)  # noqa: E731
  return optax.ScaleByAdamState(
    count=host_memory.to_device(state.count),
    mu=to_device(current.mu),
    nu=to_device(current.nu),
  )


def _find_adam(optax_state: Any) -> optax.ScaleByAdamState:
  found = [
    x
    for x in jax.tree.leaves(
      optax_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState)
    )
    if isinstance(x, optax.ScaleByAdamState)
  ]
  if len(found) != 1:
    raise ValueError(
      'import_adam_state needs an optax state holding exactly one '
      f'ScaleByAdamState (as optax.adam/adamw make), found {len(found)}'
    )
  return found[0]


def _like(new: Any, ours: jax.Array, path: str, name: str) -> jax.Array:
  """`new` (a parameter-shaped leaf) in the dtype and place of `ours`."""
  shape = tuple(ours.shape)
  if tuple(np.shape(new)) not in (shape, shape[1:]):
    raise ValueError(
      f'optax state {name} leaf {path} has shape {tuple(np.shape(new))}, '
      f'the parameter needs {shape}'
    )
  x = jnp.array(new, ours.dtype, copy=True)  # Never the caller's buffer.
  if x.shape != shape:  # Both rows of a double-buffered leaf.
    x = jnp.broadcast_to(x[None], shape)
  return jax.device_put(x, ours.sharding)


def import_adam_state(
  tx: optax.GradientTransformation,
  params: optax.Params,
  optax_state: optax.OptState,
) -> transform.SuperOffloadState:
  """Our state for `params`, continuing an optax Adam/AdamW run exactly.

  Args:
    tx: `superoffload.adam(...)` or `adamw(...)`.
    params: The parameters (the master weights start from them).
    optax_state: Any optax state holding exactly one `ScaleByAdamState`,
      e.g. that of `optax.adamw(...)`; its count and moments are taken.

  Returns:
    A `SuperOffloadState` with that count and those moments.
  """
  state = tx.init(params)
  if not isinstance(state, transform.SuperOffloadState):
    raise TypeError(
      'import_adam_state needs superoffload.adam/adamw as tx, whose init '
      f'returned {type(state).__name__}'
    )
  adam = _find_adam(optax_state)
  paths = [
    jax.tree_util.keystr(p) for p, _ in jax.tree.flatten_with_path(params)[0]
  ]
  treedef = jax.tree.structure(params)
  moments = {}
  for name in ('mu', 'nu'):
    # Leaf by leaf: the container types may differ (a flax State holding
    # the params, a dict holding the moments), the order and shapes not.
    theirs = jax.tree.leaves(getattr(adam, name))
    ours = jax.tree.leaves(getattr(state, name))
    if len(theirs) != len(ours):
      raise ValueError(
        f'optax state {name} has {len(theirs)} leaves, the parameters '
        f'{len(ours)}'
      )
    moments[name] = jax.tree.unflatten(
      treedef,
      [
        _like(t, o, p, name)
        for t, o, p in zip(theirs, ours, paths, strict=True)
      ],
    )
  count = jax.device_put(
    jnp.asarray(adam.count, jnp.int32), state.count.sharding
  )
  return state._replace(count=count, **moments)
