"""Where state lives and where the update runs: memory spaces and host compute.

One small shim over the host-compute API, whose function form JAX has
spelt `compute_on2(f, *, compute_type, out_memory_spaces)` (0.10.1 to 0.11,
beside the `compute_on(compute_type)` context manager) and
`compute_on(f, *, compute_type, out_memory_spaces)` (0.12, where the context
manager is gone). 0.10.0 exports only the context manager, which cannot
pin results to host memory, so 0.10.1 is the oldest JAX supported. CI runs
the suite on 0.10 and on the newest release.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.experimental import compute_on as _compute_on

HOST_MEMORY_KIND = 'pinned_host'
# The one axis of the one-device mesh of a state in host memory.
_HOST_AXIS = 'superoffload_host'
_EXPLICIT = jax.sharding.AxisType.Explicit
_AUTO = jax.sharding.AxisType.Auto


@functools.cache
def host_memory_available(backend: str | None = None) -> bool:
  """Whether the backend's devices have a `pinned_host` memory space."""
  device = jax.devices(backend)[0]
  kinds = {m.kind for m in device.addressable_memories()}
  return HOST_MEMORY_KIND in kinds


def to_host(x: jax.Array) -> jax.Array:
  """Places `x` in pinned host memory (inside or outside `jit`)."""
  if not host_memory_available():
    return x
  return jax.device_put(x, jax.memory.Space.Host)


def to_device(x: jax.Array) -> jax.Array:
  """Places `x` in accelerator memory (inside or outside `jit`)."""
  if not host_memory_available():
    return x
  return jax.device_put(x, jax.memory.Space.Device)


def kind_for(on_host: bool) -> str | None:
  """The memory kind of a sharding in host memory, or in device memory."""
  if on_host and host_memory_available():
    return HOST_MEMORY_KIND
  return None  # The default: device memory.


def single_device_sharding(
  device: jax.Device, on_host: bool, ndim: int
) -> jax.sharding.Sharding:
  """All of an `ndim`-dimensional array on `device`, host or device memory.

  In device memory, a `SingleDeviceSharding`. In host memory, a
  `NamedSharding` over a one-device mesh with an explicit axis, its spec
  one `None` per dimension. JAX types an array that Orbax restores
  (`jax.make_array_from_single_device_arrays`) from its sharding, and only
  a `NamedSharding` carries the memory kind into the type: with a
  `SingleDeviceSharding` the restored array lives in pinned host memory
  but is typed as device memory, and a jitted step that is donated it may
  alias that host buffer to a device output, which aborts the process in
  PJRT ("PjRtBuffer's memory kind does not match sharding's memory
  kind"). The explicit axis keeps the `NamedSharding` on a jitted step's
  outputs (without it, JAX turns them into the sharding type of the
  step's first committed argument), so a trained state restores as the
  fresh one does, and the step, given the same sharding back, compiles
  once.
  """
  kind = kind_for(on_host)
  if kind is None:
    return jax.sharding.SingleDeviceSharding(device, memory_kind=kind)
  mesh = jax.sharding.Mesh(
    np.array([device]),
    (_HOST_AXIS,),
    axis_types=(_EXPLICIT,),
  )
  spec = jax.sharding.PartitionSpec(*([None] * ndim))
  return jax.sharding.NamedSharding(mesh, spec, memory_kind=kind)


def _host_mesh_sharding(x: Any) -> Any:
  """The sharding in `x`'s type if on `single_device_sharding`'s mesh."""
  sharding = getattr(jax.typeof(x), 'sharding', None)
  if sharding is None or tuple(sharding.mesh.axis_names) != (_HOST_AXIS,):
    return None
  return sharding


def auto_typed(x: Any) -> Any:
  """`x`, its host mesh's axis made `Auto` in its type.

  An explicit axis would carry the mesh into the type of every value
  computed from `x` (the new weights of the host executors, which jit
  would then return with this `NamedSharding`, and compile again). A
  reshard on the same one device moves nothing.
  """
  sharding = _host_mesh_sharding(x)
  if sharding is None or sharding.mesh.axis_types != (_EXPLICIT,):
    return x
  mesh = sharding.mesh.update_axis_types({_HOST_AXIS: _AUTO})
  return jax.sharding.reshard(
    x, jax.sharding.NamedSharding(mesh, sharding.spec)
  )


def typed_like(y: Any, x: Any) -> Any:
  """`y`, typed with the sharding of `x` where only `x`'s type has ours.

  A state leaf in host memory comes in typed with the one-device mesh of
  `single_device_sharding`; the host computations that step it (FFI
  calls, host compute, `auto_typed` values) return it typed without that
  explicit axis, and a jitted step would then return a
  `SingleDeviceSharding`. Resharding to the same one device moves
  nothing: it only puts the axis back in the type.
  """
  tx, ty = jax.typeof(x), jax.typeof(y)
  sx, sy = _host_mesh_sharding(x), getattr(ty, 'sharding', None)
  if sx is None or sy is None or sx.mesh.axis_types != (_EXPLICIT,):
    return y
  if not sy.mesh.empty and _host_mesh_sharding(y) is None:
    return y
  host = jax.memory.Space.Host
  if tx.shape != ty.shape or tx.memory_space != host:
    return y
  if ty.memory_space != host or sy == sx:
    return y
  return jax.sharding.reshard(y, sx)


def typed_on_device(x: Any) -> bool:
  """Whether `x`'s type (concrete or traced) says device memory."""
  space = getattr(jax.typeof(x), 'memory_space', None)
  return space == jax.memory.Space.Device


def memory_kind(x: jax.Array) -> str | None:
  """The memory kind of a concrete array, or None for tracers."""
  sharding = getattr(x, 'sharding', None)
  return getattr(sharding, 'memory_kind', None)


@functools.cache
def function_form() -> Callable[..., Any]:
  """This JAX's `f(fn, *, compute_type, out_memory_spaces)`."""
  if hasattr(_compute_on, 'compute_on2'):
    return _compute_on.compute_on2
  try:
    params = inspect.signature(_compute_on.compute_on).parameters
  except (TypeError, ValueError):
    params = {}
  if 'out_memory_spaces' in params:
    return _compute_on.compute_on
  raise RuntimeError(
    f'jax {jax.__version__} has no function form of compute_on (only the '
    'context manager); jax_superoffload needs jax >= 0.10.1'
  )


def on_host(fn: Callable[..., Any], *args: Any) -> Any:
  """Runs `fn(*args)` as XLA host compute; its outputs stay in host memory.

  On a GPU, XLA extracts the region into a module compiled for the CPU and
  runs it asynchronously to the device stream. The outputs are pinned to
  host memory explicitly: memory-space propagation cannot see through a
  custom call, and a donated host buffer must come back as a host buffer.

  Every array operand of more than one dimension enters the region
  flattened and is reshaped back inside it: XLA:GPU's layout assignment
  fixes the host call's parameter layouts but not its operands' (a
  gradient a dot left column-major fails the verifier), and a rank-1
  array has one layout only.
  """
  if not host_memory_available():
    return fn(*args)
  leaves, tree = jax.tree.flatten(args)
  shapes = [getattr(x, 'shape', None) for x in leaves]

  def unflattened(*flat):
    restored = [
      x if s is None or len(s) <= 1 else x.reshape(s)
      for x, s in zip(flat, shapes, strict=True)
    ]
    return fn(*jax.tree.unflatten(tree, restored))

  flat = [
    x if s is None or len(s) <= 1 else x.reshape(-1)
    for x, s in zip(leaves, shapes, strict=True)
  ]
  out_tree = jax.tree.structure(jax.eval_shape(unflattened, *flat))
  host_spaces = jax.tree.unflatten(
    out_tree, [jax.memory.Space.Host] * out_tree.num_leaves
  )
  wrapped = function_form()(
    unflattened, compute_type='device_host', out_memory_spaces=host_spaces
  )
  return wrapped(*flat)
