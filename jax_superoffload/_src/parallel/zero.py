"""ZeRO-style sharding of the host-resident state over a mesh axis.

With a mesh and a data axis of size N, each state leaf (master, mu, nu,
shaped like its parameter) is split along its first dimension divisible by
N, in pinned host memory, so each device's host memory holds 1/N of it;
a leaf with no such dimension stays replicated (`replicated_bytes` says how
much). A step then:

1. constrains each gradient to its leaf's split on the device, so each
   device keeps only its block of the (already data-parallel-reduced)
   gradient: the SPMD partitioner turns the gradient all-reduce plus slice
   into a reduce-scatter where it can;
2. runs the bucket's host step per shard, inside `shard_map`, so that XLA
   sees an elementwise per-device call and does not all-gather the state
   around the opaque custom call;
3. brings the new weights of each shard to the device and all-gathers them
   there.

Other mesh axes (model, sequence) see the state replicated: every device
along them holds and updates the same shard.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_superoffload._src.core import host_memory
from jax_superoffload._src.core import moments as moments_lib


@dataclasses.dataclass(frozen=True)
class Zero:
  """A mesh and the axis (or axes) the buckets are sharded over."""

  mesh: Mesh
  axis: str | tuple[str, ...]
  # 8-bit moments: elements per scale. A leaf is then split only where each
  # shard is a run of whole blocks of the leaf laid out in row-major order,
  # so that the kernel's blocks on a shard are the leaf's own.
  block: int = 0

  @property
  def size(self) -> int:
    """Number of shards of each bucket."""
    axes = (self.axis,) if isinstance(self.axis, str) else self.axis
    return math.prod(self.mesh.shape[a] for a in axes)

  def spec_for(self, index: int, shape: Sequence[int]) -> P:
    """The partition spec of state leaf `index` (of parameter `shape`)."""
    del index
    return self.leaf_spec(shape)

  @property
  def scalar_spec(self) -> P:
    """The out spec of a per-shard partial result of shape [1]."""
    return P(self.axis)

  def leaf_spec(self, shape: Sequence[int]) -> P:
    """A leaf split along its first dimension divisible by the shards."""
    for d, n in enumerate(shape):
      if n and n % self.size == 0:
        spec = P(*([None] * d), self.axis)
        return spec if self.whole_blocks(spec, shape) else P()
    return P()

  def whole_blocks(self, spec: P, shape: Sequence[int]) -> bool:
    """Whether each shard of a leaf split by `spec` is whole blocks."""
    if not self.block:
      return True
    split = [d for d, a in enumerate(spec) if a is not None]
    if not split:
      return True
    if len(split) > 1 or math.prod(shape[: split[0]]) != 1:
      return False  # A shard is then not one run of the leaf.
    axes = spec[split[0]]
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    shards = math.prod(self.mesh.shape[a] for a in axes)
    return (math.prod(shape) // shards) % self.block == 0

  def scales_spec(self, spec: P) -> P:
    """The spec of the 8-bit scales of a leaf split by `spec`."""
    axes = [a for a in spec if a is not None]
    return P(*axes) if axes else P()

  def sharding(self, spec: P, on_host: bool) -> NamedSharding:
    """`spec` on the mesh, in host or device memory."""
    return NamedSharding(
      self.mesh, spec, memory_kind=host_memory.kind_for(on_host)
    )

  def replicated(self, on_host: bool) -> NamedSharding:
    """Replicated over the mesh, in host or device memory."""
    return NamedSharding(
      self.mesh, P(), memory_kind=host_memory.kind_for(on_host)
    )

  def replicated_bytes(self, params: Any, moments: str = 'fp32') -> int:
    """State bytes per device (master, mu, nu) that are not split."""
    return sum(
      leaf_state_bytes(math.prod(x.shape), moments)
      for x in jax.tree.leaves(params)
      if self.leaf_spec(x.shape) == P()
    )

  def unshard(self, x: jax.Array) -> jax.Array:
    """`x` replicated, if its type carries an explicit sharding.

    Arrays sharded over explicit mesh axes (say a tensor-parallel weight)
    are gathered first; under auto axes XLA picks the layouts itself and
    `x` is returned as is.
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

  def scatter(self, x: jax.Array, spec: P) -> jax.Array:
    """Moves [*shape] (replicated) to [*shape] split by `spec`, on device."""
    return jax.device_put(self.unshard(x), self.sharding(spec, on_host=False))

  def gather(self, x: jax.Array) -> jax.Array:
    """Moves [*shape] split by a spec to [*shape] replicated, on device."""
    return jax.device_put(x, self.replicated(on_host=False))


@dataclasses.dataclass(frozen=True)
class Follow(Zero):
  """State leaves sharded as their parameters are (FSDP, tensor parallel).

  Built by `following.of_params` from the parameters `init` is given, and
  by `following.of_state` from the state `update` is given (or from its
  parameters when the state's leaves do not say); the host step then runs
  per shard with each leaf's own spec, and the new weights come back
  sharded as the parameters are: nothing is gathered. The mesh is concrete
  for concrete arrays and abstract for traced ones.
  """

  specs: tuple[P, ...] = ()

  @property
  def size(self) -> int:
    return self.mesh.size

  def spec_for(self, index: int, shape: Sequence[int]) -> P:
    # A shard that is not whole 8-bit blocks: that leaf's state is kept
    # whole on every device, its gradients gathered (see `whole_blocks`).
    spec = self.specs[index]
    return spec if self.whole_blocks(spec, shape) else P()

  @property
  def scalar_spec(self) -> P:
    return P(tuple(self.mesh.axis_names))

  def unshard(self, x: jax.Array) -> jax.Array:
    return x

  def match(self, x: jax.Array, like: jax.Array) -> jax.Array:
    del like
    return x

  def gather(self, x: jax.Array) -> jax.Array:
    return x


def _explicit_spec(x: jax.Array) -> P | None:
  """The spec of `x`'s type if it shards over explicit axes, else None."""
  sharding = getattr(jax.typeof(x), 'sharding', None)
  spec = getattr(sharding, 'spec', None)
  if spec is None or all(s is None for s in spec):
    return None
  return spec


def from_mesh(mesh: Any, shard_axis: Any) -> Zero | None:
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


def pair_spec(spec: P | None) -> P | None:
  """The spec of a double-buffered leaf: its two rows unsplit, then `spec`."""
  return None if spec is None else P(None, *spec)


def per_shard_scalar(zero: Zero | None) -> P | None:
  """The out spec of a per-shard partial result of shape [1]."""
  return None if zero is None else zero.scalar_spec


def per_shard(
  zero: Zero | None,
  fn: Callable[..., Any],
  in_specs: Any = None,
  out_specs: Any = None,
) -> Callable[..., Any]:
  """Wraps a bucket function `fn(hyper, extra, *arrays)` to run per shard.

  Without ZeRO, `fn` itself. With it, the hyperparameters' arrays and
  `extra` (a pytree of replicated scalars, e.g. STV's flags) enter
  `shard_map` as replicated arguments, and each of `arrays` (a pytree, with
  `in_specs` a matching prefix of partition specs) as its local block;
  `out_specs` likewise for the result.
  """
  if zero is None:
    return fn

  def wrapped(hyper, extra, *arrays):
    def local(replicated, *arrays):
      return fn(*replicated, *arrays)

    mapped = jax.shard_map(
      local,
      mesh=zero.mesh,
      in_specs=(P(), *in_specs),
      out_specs=out_specs,
    )
    if not any(
      isinstance(x, jax.core.Tracer)
      for x in jax.tree.leaves((hyper, extra, arrays))
    ):  # Eager shard_map refuses a device_put to a memory space.
      mapped = jax.jit(mapped)
    return mapped((hyper, extra), *arrays)

  return wrapped


def on_mesh(mesh: Any) -> contextlib.AbstractContextManager:
  """A context whose mesh is `mesh` where another one is set.

  The state's mesh is explicit (see `following.of_params`); under a user's
  `jax.set_mesh` of the same devices with auto axes, JAX refuses an op on
  its arrays, or a `shard_map` over it, unless the context mesh is it.
  """
  context = jax.sharding.get_abstract_mesh()
  target = getattr(mesh, 'abstract_mesh', mesh)
  if context.empty or context == target:
    return contextlib.nullcontext()
  return jax.sharding.use_abstract_mesh(target)


def leaf_state_bytes(n: int, moments: str = 'fp32') -> int:
  """Bytes of a kernel leaf's fp32 master and its moments, n elements."""
  if moments == 'fp32':
    return 12 * n
  if moments == 'bf16':
    return 8 * n
  if moments == '8bit':  # Codes, and an fp32 scale per block of each.
    return 6 * n + 8 * moments_lib.num_blocks(n)
  raise ValueError(f"moments must be 'fp32', 'bf16' or '8bit', got {moments!r}")


def replicated_state_bytes(
  params: Any,
  mesh: Mesh,
  shard_axis: str | tuple[str, ...],
  *,
  moments: str = 'fp32',
) -> int:
  """Host state bytes per device that ZeRO over `shard_axis` cannot split.

  `adam(..., mesh=mesh, shard_axis=shard_axis)` splits each leaf's fp32
  master, mu and nu along the leaf's first dimension divisible by the
  axis' size; a leaf with no such dimension (a scalar, a bias of odd
  length) stays whole on every device, and so, with 8-bit moments, does
  one whose shards would not be whole 256-element blocks. Returns the
  bytes of those whole leaves (12, 8 or about 6 per parameter for
  `moments` 'fp32', 'bf16' or '8bit'), which each device's host memory
  holds in addition to its 1/N share of the rest.
  """
  zero = from_mesh(mesh, shard_axis)
  if moments == '8bit':
    zero = dataclasses.replace(zero, block=moments_lib.BLOCK)
  return zero.replicated_bytes(params, moments)
