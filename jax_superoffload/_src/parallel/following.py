"""Where a state without mesh arguments lives, read from the arguments.

Without `mesh=`, each state leaf is split as its parameter is (FSDP, tensor
parallel). `init` reads that split from the parameters and `update` from
the state's own leaves (else from the parameters), so both are pure
functions of their arguments, as optax's are: a state restored into a
`jax.eval_shape` target steps as a fresh one, and one transformation serves
any number of trees.

A concrete array tells its sharding. A traced one tells its type, which
names a spec only over explicit mesh axes: under auto axes XLA chooses, and
the type says nothing. So the state of parameters on auto axes is typed on
the same devices with explicit axes (`explicit`), and `update` moves the
gradients onto that mesh and the updates back (`onto`), a change of type
that moves no data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_superoffload._src.parallel.zero import Follow

Layout = tuple[Any, P]  # A mesh (concrete or abstract) and a spec on it.


def laid_out(x: Any) -> Layout | None:
  """The mesh and the spec `x` is split by, if known.

  A mesh of one device counts only as the user's `jax.set_mesh` (say
  Flax's (1, 1) meshes): else it is one device, as the single-device
  state's own one-device mesh is.
  """
  if not isinstance(x, jax.core.Tracer):
    sharding = getattr(x, 'sharding', None)
    if isinstance(sharding, NamedSharding) and _spans(sharding.mesh):
      return sharding.mesh, P(*sharding.spec)
    return None
  sharding = getattr(jax.typeof(x), 'sharding', None)
  mesh = getattr(sharding, 'mesh', None)
  if mesh is None or mesh.empty or not _spans(mesh):
    return None
  if AxisType.Explicit not in tuple(mesh.axis_types):
    return None  # Auto axes: the type names no split.
  return mesh, P(*sharding.spec)


def _spans(mesh: Any) -> bool:
  """Whether the state follows `mesh`: more than one device, or the context."""
  if mesh.size > 1:
    return True
  context = jax.sharding.get_abstract_mesh()
  return (
    not context.empty
    and tuple(context.axis_names) == tuple(mesh.axis_names)
    and tuple(context.axis_sizes) == tuple(mesh.axis_sizes)
  )


def of_layouts(layouts: Sequence[Layout | None], block: int = 0):
  """A `Follow` of the leaves' layouts when they share one mesh, else None.

  Leaves on no mesh, or on another, are kept whole on every device.
  `block`: see `Zero.block`.
  """
  meshes = {found[0] for found in layouts if found is not None}
  if len(meshes) != 1:
    return None
  mesh = meshes.pop()
  specs = tuple(
    found[1] if found is not None and found[0] == mesh else P()
    for found in layouts
  )
  return Follow(mesh, None, block, specs)


def of_params(params: Any, block: int = 0) -> Follow | None:
  """The `Follow` of a state `init` makes for `params`, else None.

  On the parameters' mesh with every axis explicit, so that the state's
  leaves carry their specs in their types into a traced `update`.
  """
  found = of_layouts([laid_out(x) for x in jax.tree.leaves(params)], block)
  if found is None:
    return None
  return dataclasses.replace(found, mesh=explicit(found.mesh))


def of_state(master: Any, reference: Any, block: int = 0) -> Follow | None:
  """How a state is split: its `master` leaves' layout, else None.

  `reference`: the parameters (or gradients), whose ranks tell a
  double-buffered leaf (one more dimension, its rows first, never split).
  """
  leaves = jax.tree.leaves(master)
  ndims = [np.ndim(x) for x in jax.tree.leaves(reference)]
  if len(leaves) != len(ndims):  # Another tree: the state check says so.
    return None
  layouts = []
  for x, ndim in zip(leaves, ndims, strict=True):
    found = laid_out(x)
    if found is not None and len(x.shape) == ndim + 1:
      found = (found[0], P(*tuple(found[1])[1:]))
    layouts.append(found)
  return of_layouts(layouts, block)


def split_of(master: Any | None, reference: Any, block: int = 0):
  """How an update's state is split; None if it is not.

  Its `master` tree's own split (`master` None for a state that is not
  ours), else that of `reference`.
  """
  if master is not None:
    found = of_state(master, reference, block)
    if found is not None:
      return found
  leaves = jax.tree.leaves(reference)
  return of_layouts([laid_out(x) for x in leaves], block)


def explicit(mesh: Any) -> Any:
  """A concrete `mesh` with every axis explicit (abstract ones as they are)."""
  types = (AxisType.Explicit,) * len(mesh.axis_names)
  if not isinstance(mesh, Mesh) or tuple(mesh.axis_types) == types:
    return mesh
  return Mesh(mesh.devices, mesh.axis_names, axis_types=types)


def mesh_of(x: Any) -> Any:
  """The mesh `x` lies on (concrete) or is typed on (traced), else None."""
  if not isinstance(x, jax.core.Tracer):
    sharding = getattr(x, 'sharding', None)
    return sharding.mesh if isinstance(sharding, NamedSharding) else None
  mesh = getattr(getattr(jax.typeof(x), 'sharding', None), 'mesh', None)
  return None if mesh is None or mesh.empty else mesh


def _same_mesh(a: Any, b: Any) -> bool:
  abstract = lambda m: m.abstract_mesh if isinstance(m, Mesh) else m  # noqa: E731
  return abstract(a) == abstract(b)


def onto(zero: Follow, tree: Any, mesh: Any = None) -> Any:
  """`tree`'s leaves on `mesh` (default: the state's), split as the state.

  Only leaves on another mesh move: JAX combines no arrays of two meshes.
  """
  if tree is None:
    return None
  target = zero.mesh if mesh is None else mesh
  leaves, treedef = jax.tree.flatten(tree)
  if len(leaves) != len(zero.specs):  # Another tree: the state check says so.
    return tree
  out = []
  for i, x in enumerate(leaves):
    on = mesh_of(x)
    if on is None or _same_mesh(on, target):
      out.append(x)
      continue
    spec = zero.spec_for(i, np.shape(x))
    out.append(jax.device_put(x, NamedSharding(target, spec)))
  return jax.tree.unflatten(treedef, out)
