"""Where the leaves of a state passed to `update` live, as their types say.

`update` refuses a state whose host leaves came in device memory
(`check_on_host`), reads the state with its host leaves' explicit mesh
axis made `Auto` (`read_typed`), and gives each leaf of the new state the
type the leaf came in with (`kept_in_place`): optax's wrappers `select`
or `cond` between the two states, and a jitted step keeps the host
leaves' `NamedSharding` (see `host_memory.single_device_sharding`).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

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


def check_on_host(plan: state_lib.Bucketing, state: Any) -> None:
  """Refuses a state whose host leaves came in device memory.

  Stepped there, the state would cost the device its memory and the step
  two copies of it, with nothing to say so. It comes so from a jit whose
  shardings name device memory (a trainer's own sharding rules), a
  restore into a target without shardings (`jax.eval_shape`,
  `nnx.eval_shape`), a `jax.ShapeDtypeStruct` lowered with a
  `SingleDeviceSharding` (JAX drops its memory kind from the type), or
  Flax's eager sharding of an `nnx.Optimizer` built outside `nnx.jit`.
  The step cannot move it and return it in host memory instead: optax's
  wrappers (`MultiSteps`, `apply_if_finite`) select between the state
  they hold and ours, which JAX refuses across memories, and a jit that
  donates the state would alias a device buffer to a host result, which
  aborts the process. So the error says how to place it.
  """
  if not host_memory.host_memory_available():
    return
  resident = len(plan.on_device) == plan.lay.num_buckets
  wrong = []
  for name in _ARRAY_FIELDS:
    tree = getattr(state, name)
    if tree is None:
      continue
    for i, (path, x) in enumerate(jax.tree_util.tree_leaves_with_path(tree)):
      kernel = i in plan.bucket_of
      planned = state_lib.host_leaf(plan, i) and (kernel or not resident)
      if planned and np.ndim(x) > 0 and host_memory.typed_on_device(x):
        wrong.append(f'{name}{jax.tree_util.keystr(path)}')
  if wrong:
    more = f' (and {len(wrong) - 1} more)' if len(wrong) > 1 else ''
    raise ValueError(
      f'optimizer state leaf {wrong[0]}{more} came in device memory; '
      'superoffload keeps it in host memory (pinned_host). Place the state '
      'with superoffload.state_shardings(tx, params): as the out_shardings '
      "of the jit that runs tx.init and the shardings of your step's "
      'state, as a restore target, or once with jax.device_put(state, '
      'superoffload.state_shardings(tx, params)); a jax.ShapeDtypeStruct '
      'carries pinned_host into the jit only with a NamedSharding (JAX '
      'types a SingleDeviceSharding as device memory). Flax NNX: build '
      'nnx.Optimizer inside nnx.jit. MaxText: run it through '
      'python -m jax_superoffload.integrations.maxtext.'
    )


def kept_in_place(old: Any, new: Any) -> Any:
  """`new`, each leaf typed as it came (host or device memory).

  Leaves that came in device memory are those kept there on purpose
  (device buckets; `check_on_host` refuses the others).
  """

  def keep(x, y):
    if x is None:
      return y
    if not host_memory.typed_on_device(x):
      return host_memory.typed_like(y, x)
    return y if host_memory.typed_on_device(y) else host_memory.to_device(y)

  fields = {}
  for name in _ARRAY_FIELDS:
    if getattr(new, name) is not None:
      fields[name] = jax.tree.map(keep, getattr(old, name), getattr(new, name))
  return state_lib.with_fields(new, **fields)
