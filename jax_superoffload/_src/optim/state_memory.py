"""Where the leaves of a state passed to `update` live, as their types say.

`update` reads the state with its host leaves' explicit mesh axis made
`Auto` (`read_typed`), and gives each leaf of the new state the type the
leaf came in with (`kept_in_place`): optax's wrappers `select` or `cond`
between the two states, and a jitted step keeps the host leaves'
`NamedSharding` (see `host_memory.single_device_sharding`).
"""

from __future__ import annotations

import warnings
from typing import Any

import jax

from jax_superoffload._src.core import host_memory
from jax_superoffload._src.optim import state as state_lib

_ARRAY_FIELDS = ('master', 'mu', 'nu', 'kept_grads', 'mu_scales', 'nu_scales')


def read_typed(state: Any) -> Any:
  """`state`, its host leaves typed without an explicit mesh axis."""
  fields = {
    name: jax.tree.map(host_memory.auto_typed, getattr(state, name))
    for name in _ARRAY_FIELDS
    if getattr(state, name) is not None
  }
  return state_lib.with_fields(state, **fields)


def kept_in_place(old: Any, new: Any) -> Any:
  """`new`, with each leaf that came in device memory kept there.

  A state restored into a target without shardings (`nnx.eval_shape`,
  `jax.eval_shape`) comes back in device memory. optax's wrappers
  (`MultiSteps`, `apply_if_finite`) `select` or `cond` between the state
  they were given and ours, which must then be of one type: so a leaf
  stays in the memory it came in, as optax's states do, and a warning
  says so (the numbers are the same; the step moves it to the host and
  back). A target with the state's shardings keeps it in host memory.
  """
  moved = []

  def keep(path, x, y):
    if x is None:
      return y
    if not host_memory.typed_on_device(x):
      return host_memory.typed_like(y, x)
    if host_memory.typed_on_device(y):
      return y
    moved.append(jax.tree_util.keystr(path))
    return host_memory.to_device(y)

  fields = {}
  for name in _ARRAY_FIELDS:
    if getattr(new, name) is not None:
      fields[name] = jax.tree.map_with_path(
        keep, getattr(old, name), getattr(new, name)
      )
  if moved:
    warnings.warn(
      f'{len(moved)} optimizer state leaves (e.g. {moved[0]}) came in device '
      'memory, not host memory (restored into a target without shardings?):'
      ' they stay there; restore into tx.init(params), or a target with its '
      'shardings, to keep them in host memory',
      stacklevel=2,
    )
  return state_lib.with_fields(new, **fields)
