"""`state_shardings`: where an optimizer's state lives, for trainers.

A trainer that places the state itself (a jit's `out_shardings` from its
own sharding rules, a restore target) asks here for the shardings of
`tx.init(params)`: each leaf of ours split as its parameter is, in
`pinned_host` where it lives in host memory, and every other leaf (optax's
wrappers, other transformations) as `init` makes it.
"""

from __future__ import annotations

from typing import Any

import jax
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_superoffload._src.core import host_memory
from jax_superoffload._src.optim import state as state_lib
from jax_superoffload._src.parallel import following


def state_shardings(tx: optax.GradientTransformation, params: Any) -> Any:
  """The shardings of `tx.init(params)`'s state, host memory included.

  `init` made inside a jit places its state where that jit's shardings say;
  a trainer that builds them from its own rules (MaxText's logical axes,
  say) would put every leaf in device memory, where `update` refuses it.
  Pass these instead: the state of `superoffload.adam` / `adamw` anywhere
  in `tx` (under `optax.chain`, `MultiSteps`, masks) gets its parameter's
  split and `pinned_host` where it lives in host memory; every other leaf
  gets the split `init` gives it, in device memory.

  Args:
    tx: The transformation whose state is placed.
    params: The parameters, as arrays or `jax.ShapeDtypeStruct`s whose
      `sharding` says how each is split (`NamedSharding`s of one mesh, of
      auto or explicit axes, or single-device shardings; none: the default
      device).

  Returns:
    A tree like `tx.init(params)`'s state with a `jax.sharding.Sharding` for
    each leaf: `NamedSharding`s on the parameters' mesh, else shardings on
    their one device.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import jax_superoffload as superoffload
    >>> tx = superoffload.adamw(1e-3)
    >>> params = {'w': jnp.zeros((4, 2))}
    >>> shardings = superoffload.state_shardings(tx, params)
    >>> shardings[0].mu['w'].memory_kind
    'pinned_host'
    >>> state = jax.jit(tx.init, out_shardings=shardings)(params)
  """
  leaves, treedef = jax.tree.flatten(params)
  mesh = _mesh_of(params)
  if mesh is None:
    device = _device_of(leaves)
    abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
    avals, shapes = _traced_init(tx, jax.tree.unflatten(treedef, abstract))
    return jax.tree.unflatten(
      jax.tree.structure(shapes),
      [
        host_memory.single_device_sharding(device, _on_host(a), a.ndim)
        for a in avals
      ],
    )
  typed_mesh = following.explicit(mesh)
  abstract = [
    jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=NamedSharding(typed_mesh, _spec_of(x))
    )
    for x in leaves
  ]
  # On explicit axes, the state's types carry its split out of the trace.
  with jax.set_mesh(typed_mesh):
    avals, shapes = _traced_init(tx, jax.tree.unflatten(treedef, abstract))
  ours = jax.tree.leaves(_owned(shapes))
  return jax.tree.unflatten(
    jax.tree.structure(shapes),
    [
      NamedSharding(
        typed_mesh if mine else mesh,
        P(*a.sharding.spec),
        memory_kind=host_memory.kind_for(_on_host(a)),
      )
      for a, mine in zip(avals, ours, strict=True)
    ],
  )


def _owned(shapes: Any) -> Any:
  """`shapes` with True for each leaf of a state of ours, else False.

  Ours are typed on the mesh with every axis explicit, as `init` types
  them, so that a traced `update` reads their split from their types;
  other transformations' leaves (which optax's wrappers combine with the
  parameters) stay on the parameters' mesh.
  """
  is_ours = lambda x: isinstance(x, state_lib.SuperOffloadState)  # noqa: E731
  return jax.tree.map(
    lambda x: jax.tree.map(lambda _: is_ours(x), x),
    shapes,
    is_leaf=is_ours,
  )


def _traced_init(tx, params: Any) -> tuple[list, Any]:
  """The abstract values of `tx.init(params)`'s leaves, and its tree."""
  closed, shapes = jax.make_jaxpr(tx.init, return_shape=True)(params)
  return closed.out_avals, shapes


def _on_host(aval: Any) -> bool:
  return getattr(aval, 'memory_space', None) == jax.memory.Space.Host


def _spec_of(x: Any) -> P:
  sharding = getattr(x, 'sharding', None)
  if isinstance(sharding, NamedSharding):
    return P(*sharding.spec)
  return P()


def _mesh_of(params: Any) -> Any:
  """The one mesh of the parameters' `NamedSharding`s, else None.

  A trainer's mesh of one device too: its shardings are `NamedSharding`s.
  """
  meshes = {}
  for path, x in jax.tree_util.tree_leaves_with_path(params):
    sharding = getattr(x, 'sharding', None)
    if isinstance(sharding, NamedSharding):
      meshes.setdefault(sharding.mesh, jax.tree_util.keystr(path))
  if len(meshes) > 1:
    found = ', '.join(f'{path} on {mesh}' for mesh, path in meshes.items())
    raise ValueError(f'parameters lie on more than one mesh: {found}')
  return next(iter(meshes), None)


def _device_of(leaves: list) -> jax.Device:
  """The one device of the parameters' shardings (default: the first)."""
  for x in leaves:
    sharding = getattr(x, 'sharding', None)
    if sharding is not None:
      return next(iter(sharding.device_set))
  return jax.devices()[0]
