"""ZeRO-style sharding of the host-resident buckets over a mesh axis.

With a mesh and a data axis of size N, each bucket's flat state (master, mu,
nu) is padded to a multiple of N and sharded along that axis in pinned host
memory, so each device's host memory holds 1/N of it. A step then:

1. lays the bucket's gradients end to end on the device and constrains the
   flat vector to the axis, so each device keeps only its slice of the
   (already data-parallel-reduced) gradient: the SPMD partitioner turns the
   gradient all-reduce plus slice into a reduce-scatter where it can;
2. runs the bucket's host step per shard, inside `shard_map`, so that XLA
   sees an elementwise per-device call and does not all-gather the state
   around the opaque custom call;
3. brings the new weights of each shard to the device and all-gathers them
   there, then splits them into leaves.

Other mesh axes (model, sequence) see the bucket replicated: every device
along them holds and updates the same shard.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_superoffload._src import executors
from jax_superoffload._src import host_memory


@dataclasses.dataclass(frozen=True)
class Zero:
  """A mesh and the axis (or axes) the buckets are sharded over."""

  mesh: Mesh
  axis: str | tuple[str, ...]

  @property
  def size(self) -> int:
    """Number of shards of each bucket."""
    axes = (self.axis,) if isinstance(self.axis, str) else self.axis
    return math.prod(self.mesh.shape[a] for a in axes)

  @property
  def spec(self) -> P:
    return P(self.axis)

  def padded(self, n: int) -> int:
    """`n` rounded up to a whole number of elements per shard."""
    return -(-n // self.size) * self.size

  def bucket_sharding(self, on_host: bool) -> NamedSharding:
    """A bucket sharded along the axis, in host or device memory."""
    return NamedSharding(self.mesh, self.spec, memory_kind=_kind(on_host))

  def replicated(self, on_host: bool) -> NamedSharding:
    """Replicated over the mesh, in host or device memory."""
    return NamedSharding(self.mesh, P(), memory_kind=_kind(on_host))

  def pad(self, flat: jax.Array) -> jax.Array:
    """A bucket's flat vector padded to a whole number per shard."""
    return _pad(flat, self.padded(flat.size))

  def unshard(self, x: jax.Array) -> jax.Array:
    """`x` replicated, if its type carries an explicit sharding.

    Arrays sharded over explicit mesh axes (say a tensor-parallel weight)
    cannot be flattened and concatenated with others as they are; under
    auto axes XLA picks the layouts itself and `x` is returned as is.
    """
    if not _explicit_spec(x):
      return x
    return jax.device_put(x, self.replicated(on_host=False))

  def match(self, x: jax.Array, like: jax.Array) -> jax.Array:
    """`x` with the explicit sharding of `like` (as is under auto axes)."""
    spec = _explicit_spec(like)
    if not spec:
      return x
    return jax.device_put(x, NamedSharding(self.mesh, spec))

  def scatter(self, grads: Sequence[jax.Array], padded: int) -> jax.Array:
    """One bucket's flat gradient, padded, constrained to the shard axis."""
    dtypes = {g.dtype for g in grads}
    dtype = dtypes.pop() if len(dtypes) == 1 else jnp.float32
    parts = [jnp.ravel(g).astype(dtype) for g in grads]
    flat = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
    return jax.device_put(
      _pad(flat, padded), self.bucket_sharding(on_host=False)
    )

  def gather(
    self, flat: jax.Array, sizes: Sequence[int], count: Any = None
  ) -> list[jax.Array]:
    """All-gathers a sharded flat vector on the device; splits it by size.

    `count` is the step count, for `executors.split_leaves`.
    """
    flat = jax.device_put(flat, self.replicated(on_host=False))
    return executors.split_leaves(flat, sizes, count)

  def map(self, fn: Callable[..., Any], scalars: Any, *arrays):
    """`fn(scalars, *arrays)` per shard: arrays and outputs split by axis.

    `scalars` are replicated (a schedule's learning rate, the step count);
    every array input and output is a flat vector sharded along the axis
    (a per-shard partial result of shape [1] comes out with shape [N]).
    """
    mapped = jax.shard_map(
      fn,
      mesh=self.mesh,
      in_specs=(P(),) + (self.spec,) * len(arrays),
      out_specs=self.spec,
    )
    return mapped(scalars, *arrays)


def _explicit_spec(x: jax.Array) -> P | None:
  """The spec of `x`'s type if it shards over explicit axes, else None."""
  sharding = getattr(jax.typeof(x), 'sharding', None)
  spec = getattr(sharding, 'spec', None)
  if spec is None or all(s is None for s in spec):
    return None
  return spec


def _kind(on_host: bool) -> str | None:
  if on_host and host_memory.host_memory_available():
    return host_memory.HOST_MEMORY_KIND
  return None  # The default: device memory.


def _pad(flat: jax.Array, n: int) -> jax.Array:
  if flat.size == n:
    return flat
  return jnp.pad(flat, (0, n - flat.size))


def make(mesh: Any, shard_axis: Any) -> Zero | None:
  """Validates `mesh` / `shard_axis` (both or neither) into a `Zero`."""
  if mesh is None and shard_axis is None:
    return None
  if mesh is None or shard_axis is None:
    raise ValueError(
      'mesh and shard_axis go together: got mesh='
      f'{"None" if mesh is None else "a Mesh"}, shard_axis={shard_axis!r}'
    )
  if not isinstance(mesh, Mesh):
    raise TypeError(
      f'mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}'
    )
  axes = (shard_axis,) if isinstance(shard_axis, str) else shard_axis
  if not isinstance(axes, tuple) or not all(isinstance(a, str) for a in axes):
    raise TypeError(
      'shard_axis must be a mesh axis name or a tuple of them, got '
      f'{shard_axis!r}'
    )
  unknown = [a for a in axes if a not in mesh.axis_names]
  if unknown or not axes:
    raise ValueError(
      f'shard_axis {shard_axis!r} is not an axis of the mesh; its axes are '
      f'{mesh.axis_names}'
    )
  return Zero(mesh, shard_axis)


def per_shard(zero: Zero | None, fn: Callable[..., Any]) -> Callable[..., Any]:
  """Wraps a bucket function `fn(step, extra, *arrays)` to run per shard.

  Without ZeRO, `fn` itself. With it, the step's array scalars and `extra`
  (a pytree of replicated scalars, e.g. STV's flags) enter `shard_map` as
  replicated arguments and every array as its local shard.
  """
  if zero is None:
    return fn

  def wrapped(step, extra, *arrays):
    names, values = executors.array_scalars(step)

    def local(scalars, *arrays):
      values, extra = scalars
      return fn(executors.bind(step, names, values), extra, *arrays)

    return zero.map(local, (values, extra), *arrays)

  return wrapped
