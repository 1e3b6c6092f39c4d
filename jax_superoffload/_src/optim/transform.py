"""`adam` / `adamw`: Optax transformations with host-resident Adam state.

The state is shaped like the parameters, as optax's `ScaleByAdamState` is:
`mu`, `nu` and the fp32 `master` have the parameters' tree structure and
leaf shapes and live in pinned host memory. Buckets are only the schedule:
one kernel call steps the leaves of one bucket, each on its own arrays.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_superoffload._src.core import host_memory
from jax_superoffload._src.core import layout
from jax_superoffload._src.core import moments
from jax_superoffload._src.optim import options as options_lib
from jax_superoffload._src.optim import stv
from jax_superoffload._src.parallel import following
from jax_superoffload._src.parallel import zero as zero_lib


class SuperOffloadState(NamedTuple):
  """State of `superoffload.adam` / `adamw`, shaped like the parameters.

  Attributes:
    count: Steps taken (int32 scalar), as in optax's `ScaleByAdamState`.
    mu: First moments, a tree like the parameters (fp32, or `mu_dtype`), in
      host memory.
    nu: Second moments, a tree like the parameters, in host memory.
    master: The weights the step starts from, a tree like the parameters:
      fp32 for the leaves the kernel steps, the parameters' own dtype for
      the others (float64, complex, or every leaf with a non-fp32
      `mu_dtype`). An `update` given parameters that no longer match it
      starts from the parameters.
    redone: Steps that speculation-then-validation redid with clipped
      gradients (int32 scalar).
    skipped: Steps dropped for non-finite gradients (int32 scalar).
    row: With STV on the "ffi" executor, which of the two rows of each
      double-buffered leaf is current (int32 scalar, 0 or 1); else None.
    kept_grads: With STV on the "ffi" executor, a tree like the parameters
      of the fp32 gradients the speculative step read (zero-size arrays for
      leaves that are not double-buffered); else None.
    mu_scales: With `moments_8bit`, a tree like the parameters of the
      float32 per-block scales of `mu` (whose leaves are then uint8 codes;
      `moments.py`), zero-size for leaves on optax's path; else None.
    nu_scales: Likewise for `nu`.

  With STV on the "ffi" executor, the host leaves of `master`, `mu` and
  `nu` have shape `(2, *param.shape)`: row `row` is the current state, the
  other the spare the next speculative step writes (see stv.py), so
  `optax.tree_map_params` does not apply to them. `current()` (or
  `export_adam_state`) gives the current state either way.
  """

  count: jax.Array
  mu: Any
  nu: Any
  master: Any
  redone: jax.Array
  skipped: jax.Array
  row: jax.Array | None = None
  kept_grads: Any = None
  mu_scales: Any = None
  nu_scales: Any = None

  def current(self) -> stv.HostState:
    """The current master, mu and nu, trees like the parameters."""
    if self.kept_grads is None:
      return stv.HostState(self.master, self.mu, self.nu)
    pick = lambda x, k: stv.current_row(x, k, self.row)  # noqa: E731
    return stv.HostState(
      *(
        jax.tree.map(pick, xs, self.kept_grads)
        for xs in (self.master, self.mu, self.nu)
      )
    )


class Plan(NamedTuple):
  """What the options and one parameter tree make of each leaf."""

  lay: layout.Layout
  on_device: frozenset[int]  # Buckets whose state lives on the device.
  paired: frozenset[int]  # Double-buffered buckets (STV on "ffi").
  bucket_of: dict[int, int]  # Leaf index to bucket id.


def plan_for(opts: options_lib.Options, tree: Any) -> Plan:
  lay = opts.layout(tree)
  on_device = opts.device_bucket_ids(lay, tree)
  paired = frozenset()
  if opts.double_buffered:
    paired = frozenset(range(lay.num_buckets)) - on_device
  bucket_of = {}
  for k, leaf_ids in enumerate(_buckets(lay)):
    for i in leaf_ids:
      bucket_of[i] = k
  return Plan(lay, on_device, paired, bucket_of)


def _buckets(lay: layout.Layout) -> list[list[int]]:
  """Leaf indices of each bucket, in state order."""
  return [
    [group.leaves[j] for j in bucket]
    for group in lay.groups
    for bucket in group.buckets
  ]


def _leaf_state_types(opts, plan: Plan) -> list[tuple]:
  """Per leaf: (state shape, master dtype, mu dtype, nu dtype, paired)."""
  out = []
  shapes_dtypes = zip(plan.lay.shapes, plan.lay.dtypes, strict=True)
  for i, (shape, dtype) in enumerate(shapes_dtypes):
    k = plan.bucket_of.get(i)
    if k is None:  # optax math: optax's dtypes, no master precision.
      mu = np.dtype(opts.mu_dtype) if opts.mu_dtype is not None else dtype
      out.append((shape, dtype, mu, dtype, False))
      continue
    paired = k in plan.paired
    state_shape = (2, *shape) if paired else shape
    mu, nu = opts.moment_dtypes
    out.append((state_shape, np.dtype(np.float32), mu, nu, paired))
  return out


def _scales_shape(opts, plan: Plan, i: int) -> tuple[int, ...] | None:
  """The shape of leaf i's 8-bit scales, None without 8-bit moments."""
  if not opts.moments_8bit:
    return None
  if i not in plan.bucket_of:  # optax's path: no scales.
    return (0,)
  return (moments.num_blocks(math.prod(plan.lay.shapes[i])),)


def _on_host(plan: Plan, i: int) -> bool:
  return plan.bucket_of.get(i) not in plan.on_device


def on_host(x: jax.Array, host: bool) -> bool:
  """Whether a state leaf lives in host memory.

  Scalars stay on the device: they are 4 bytes, and JAX drops the host
  memory space of 0-d results of `jnp.where`, which wrappers such as
  optax.MultiSteps apply to the state.
  """
  return host and np.ndim(x) > 0


def _build_state(opts, params: Any) -> SuperOffloadState:
  """A fresh state: the master from the parameters, zero moments."""
  plan = plan_for(opts, params)
  leaves = jax.tree.leaves(params)
  if opts.zero is not None:
    leaves = [opts.zero.unshard(x) for x in leaves]
  # Placed by init's out_shardings (_state_shardings) as well.
  master, mu, nu, kept, mu_scales, nu_scales = [], [], [], [], [], []
  for i, (shape, m_t, mu_t, nu_t, paired) in enumerate(
    _leaf_state_types(opts, plan)
  ):
    host = _on_host(plan, i)
    m = leaves[i].astype(m_t)
    if paired:
      m = jnp.broadcast_to(m[None], shape)
    elif not host:  # jit would hand the parameter itself back otherwise.
      m = jnp.copy(m)
    kshape = shape[1:] if paired else (0,) * (len(shape) + 2)
    # Moved to host memory inside too: jit's out_shardings alone leave the
    # arrays typed as device memory (JAX 0.10), which host compute refuses.
    master.append(host_memory.to_host(m) if on_host(m, host) else m)
    made = [(mu, shape, mu_t), (nu, shape, nu_t), (kept, kshape, 'f4')]
    scales_shape = _scales_shape(opts, plan, i)
    if scales_shape is not None:
      made += [(mu_scales, scales_shape, 'f4'), (nu_scales, scales_shape, 'f4')]
    for out, sh, dt in made:
      if not (host and len(sh) > 0):
        out.append(jnp.zeros(sh, dt))
      elif opts.zero is None:  # Made by host compute where they live.
        out.append(host_memory.on_host(functools.partial(jnp.zeros, sh, dt)))
      else:
        out.append(host_memory.to_host(jnp.zeros(sh, dt)))
  tree = lambda xs: jax.tree.unflatten(plan.lay.treedef, xs)  # noqa: E731
  return SuperOffloadState(
    count=jnp.zeros([], jnp.int32),
    mu=tree(mu),
    nu=tree(nu),
    master=tree(master),
    redone=jnp.zeros([], jnp.int32),
    skipped=jnp.zeros([], jnp.int32),
    row=jnp.zeros([], jnp.int32) if opts.double_buffered else None,
    kept_grads=tree(kept) if opts.double_buffered else None,
    mu_scales=tree(mu_scales) if opts.moments_8bit else None,
    nu_scales=tree(nu_scales) if opts.moments_8bit else None,
  )


def _device_of(params: Any) -> jax.Device:
  """The one device concrete parameters are on (default: the first)."""
  for x in jax.tree.leaves(params):
    sharding = getattr(x, 'sharding', None)
    if sharding is not None and not isinstance(x, jax.core.Tracer):
      return next(iter(sharding.device_set))
  return jax.devices()[0]


def _state_shardings(opts, params: Any) -> SuperOffloadState:
  """The out_shardings of `init`: where each state leaf is made.

  In pinned host memory (but scalars and device buckets on the device);
  under ZeRO each leaf split along one axis, when following the
  parameters' shardings as its parameter is.
  """
  plan = plan_for(opts, params)
  zero = opts.zero
  if zero is None:
    device = _device_of(params)

    def sharding(spec, host):
      del spec
      kind = zero_lib.memory_kind(host)
      return jax.sharding.SingleDeviceSharding(device, memory_kind=kind)
  else:
    sharding = zero.sharding
  master, kept, scales = [], [], []
  for i, (shape, *_, paired) in enumerate(_leaf_state_types(opts, plan)):
    host = _on_host(plan, i)
    spec = zero_lib.P()
    if zero is not None:
      spec = zero.spec_for(i, plan.lay.shapes[i])
    state_spec = zero_lib.pair_spec(spec) if paired else spec
    master.append(sharding(state_spec, host and len(shape) > 0))
    kept_host = host and (not paired or len(shape) > 1)
    kept.append(sharding(spec if paired else zero_lib.P(), kept_host))
    scales_spec = zero_lib.P()
    if zero is not None and i in plan.bucket_of:
      scales_spec = zero.scales_spec(spec)
    scales.append(sharding(scales_spec, host))
  tree = lambda xs: jax.tree.unflatten(plan.lay.treedef, xs)  # noqa: E731
  counter = sharding(zero_lib.P(), False)
  return SuperOffloadState(
    count=counter,
    mu=tree(master),
    nu=tree(master),
    master=tree(master),
    redone=counter,
    skipped=counter,
    row=counter if opts.double_buffered else None,
    kept_grads=tree(kept) if opts.double_buffered else None,
    mu_scales=tree(scales) if opts.moments_8bit else None,
    nu_scales=tree(scales) if opts.moments_8bit else None,
  )


def check_state(opts, plan: Plan, state: Any, from_grads: bool):
  """The state's leaves, checked against the parameters leaf by leaf."""
  if not isinstance(state, SuperOffloadState):
    raise TypeError(f'expected a SuperOffloadState, got {type(state).__name__}')
  hint = (
    ' (without params, the layout comes from the gradients: give them the '
    "parameters' dtypes, or pass params)"
    if from_grads
    else ''
  )
  fields = {'master': state.master, 'mu': state.mu, 'nu': state.nu}
  if opts.double_buffered:
    fields['kept_grads'] = state.kept_grads
  if opts.moments_8bit != (state.mu_scales is not None):
    raise ValueError(
      'optimizer state was built with'
      + ('out' if opts.moments_8bit else '')
      + ' 8-bit moments, this transformation has moments_8bit='
      + str(opts.moments_8bit)
    )
  if opts.moments_8bit:
    fields['mu_scales'] = state.mu_scales
    fields['nu_scales'] = state.nu_scales
  out = {}
  types = _leaf_state_types(opts, plan)
  for name, tree in fields.items():
    leaves, treedef = jax.tree.flatten(tree)
    if treedef != plan.lay.treedef:
      raise ValueError(
        f'optimizer state was built for another parameter tree: state.{name} '
        f'has structure {treedef}, the parameters {plan.lay.treedef}{hint}'
      )
    for i, (x, (shape, m_t, mu_t, nu_t, paired)) in enumerate(
      zip(leaves, types, strict=True)
    ):
      want_shape = shape
      want_dtype = {'master': m_t, 'mu': mu_t, 'nu': nu_t}.get(name, np.float32)
      if name == 'kept_grads':
        want_shape = shape[1:] if paired else (0,) * (len(shape) + 2)
      if name.endswith('_scales'):
        want_shape = _scales_shape(opts, plan, i)
      got = (tuple(np.shape(x)), np.dtype(x.dtype))
      if got != (tuple(want_shape), np.dtype(want_dtype)):
        raise ValueError(
          'optimizer state was built for another parameter tree: '
          f'state.{name} leaf {plan.lay.paths[i]} is '
          f'{got[1]}{list(got[0])}, the parameter needs '
          f'{np.dtype(want_dtype)}{list(want_shape)}{hint}'
        )
    out[name] = leaves
  if opts.zero is not None:
    _check_on_mesh(opts.zero, plan, out['master'])
  if opts.moments_8bit:  # The kernel's leaves as codes with their scales.
    for name in ('mu', 'nu'):
      scales = out.pop(f'{name}_scales')
      out[name] = [
        moments.Blockwise(x, s) if i in plan.bucket_of else x
        for i, (x, s) in enumerate(zip(out[name], scales, strict=True))
      ]
  return out


def _check_on_mesh(zero, plan: Plan, leaves: list) -> None:
  """A concrete state must live on the mesh's devices (ZeRO)."""
  if not isinstance(zero.mesh, jax.sharding.Mesh):  # Traced: no devices.
    return
  devices = set(zero.mesh.devices.flat)
  for path, x in zip(plan.lay.paths, leaves, strict=True):
    sharding = getattr(x, 'sharding', None)
    if isinstance(x, jax.core.Tracer) or sharding is None:
      continue
    if set(sharding.device_set) != devices:
      raise ValueError(
        f'optimizer state leaf {path} lives on {len(sharding.device_set)} '
        f'device(s), the mesh spans {len(devices)}: build the state with '
        "this transformation's init (with the same mesh)"
      )


def init(opts: options_lib.Options, params: optax.Params) -> SuperOffloadState:
  """`init` of the transformation: the state for `params`."""
  if not jax.tree.leaves(params):  # Say optax.tree_map_params' placeholder.
    return _build_state(opts, params)
  # One traced computation that writes each state leaf where it lives
  # (out_shardings): no leaf is made on the device and copied over, so the
  # peak is the parameters plus the state. Under a mesh every placement is
  # also a sharding of its global arrays (eager transfers of process-local
  # values to a mesh spanning several processes are not supported).
  return jax.jit(
    lambda p: _build_state(opts, p),
    out_shardings=_state_shardings(opts, params),
  )(params)


def _following(opts, zero: zero_lib.Follow | None) -> options_lib.Options:
  return opts if zero is None else dataclasses.replace(opts, zero=zero)


def init_following(opts, params: optax.Params) -> SuperOffloadState:
  """`init`, with the state split as the parameters are (without a mesh)."""
  if opts.zero is not None:
    return init(opts, params)
  block = moments.BLOCK if opts.moments_8bit else 0
  return init(_following(opts, following.of_params(params, block)), params)


def _state_split(opts, state: Any, reference: Any):
  """The state's own split, else that of the parameters (or gradients)."""
  block = moments.BLOCK if opts.moments_8bit else 0
  if isinstance(state, SuperOffloadState):
    found = following.of_state(state.master, reference, block)
    if found is not None:
      return found
  leaves = jax.tree.leaves(reference)
  return following.of_layouts([following.laid_out(x) for x in leaves], block)


def update_following(opts, updates, state, params=None):
  """`update`, with the state's split read from the arguments (no mesh)."""
  # Imported here: update.py uses this module's state type.
  from jax_superoffload._src.optim import update as update_lib

  reference = params if params is not None else updates
  zero = None if opts.zero is not None else _state_split(opts, state, reference)
  if zero is None:
    return update_lib.update(opts, updates, state, params)
  out, new_state = update_lib.update(
    _following(opts, zero),
    following.onto(zero, updates),
    state,
    following.onto(zero, params),
  )
  meshes = map(following.mesh_of, jax.tree.leaves(reference))
  theirs = next(filter(None, meshes), None)
  if theirs is not None:
    out = following.onto(zero, out, theirs)
  return out, new_state


def superoffload_adam(**kwargs: Any) -> optax.GradientTransformationExtraArgs:
  """Builds the transformation behind `adam` and `adamw` (see their docs).

  `init` and `update` are pure: without mesh arguments, where the state
  lives follows from their arguments alone (`init_following`,
  `update_following`), so a state restored into an `eval_shape` target
  steps as a fresh one, and one transformation serves any number of trees.
  """
  opts = options_lib.make(**kwargs)

  def init_fn(params):
    return init_following(opts, params)

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args  # Accepted for optax.GradientTransformationExtraArgs.
    return update_following(opts, updates, state, params)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
