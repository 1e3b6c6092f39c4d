"""`init` of `adam` / `adamw`: a fresh state, made where it lives."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_superoffload._src.core import host_memory
from jax_superoffload._src.core import moments
from jax_superoffload._src.optim import options as options_lib
from jax_superoffload._src.optim import state as state_lib
from jax_superoffload._src.optim import weights_digest
from jax_superoffload._src.parallel import following
from jax_superoffload._src.parallel import zero as zero_lib


def _build_state(
  opts,
  params: Any,
  placement,
  shardings: Any = None,
  in_callers_trace: bool = False,
) -> state_lib.SuperOffloadState:
  """A fresh state: the master from the parameters, zero moments.

  Placed by init's out_shardings (`shardings`, from `_state_shardings`);
  on a mesh each leaf is also typed with its split (`_typer`). With
  `in_callers_trace`, made in the trace of the caller's own jit, whose
  shardings place it: each leaf is computed from its parameter
  (`_zeros_after`), so that XLA splits it as it splits the parameter.
  """
  plan = state_lib.bucketing_for(opts, params, placement)
  leaves = jax.tree.leaves(params)
  typed = _typer(opts, shardings)
  if opts.zero is not None:
    leaves = [opts.zero.unshard(x) for x in leaves]
  master, mu, nu, kept, mu_scales, nu_scales = [], [], [], [], [], []
  for i, (shape, m_t, mu_t, nu_t, paired) in enumerate(
    state_lib.leaf_state_types(opts, plan)
  ):
    host = state_lib.host_leaf(plan, i)
    m = typed('master', i, _master(leaves[i], m_t, shape, paired, host))
    kshape = shape[1:] if paired else (0,) * (len(shape) + 2)
    # Moved to host memory inside too: jit's out_shardings alone leave the
    # arrays typed as device memory (JAX 0.10), which host compute refuses.
    master.append(
      host_memory.to_host(m) if state_lib.lives_on_host(m, host) else m
    )
    made = [
      (mu, 'mu', shape, mu_t),
      (nu, 'nu', shape, nu_t),
      (kept, 'kept_grads', kshape, 'f4'),
    ]
    scales_shape = state_lib.scales_shape(opts, plan, i)
    if scales_shape is not None:
      made += [
        (mu_scales, 'mu_scales', scales_shape, 'f4'),
        (nu_scales, 'nu_scales', scales_shape, 'f4'),
      ]
    for out, name, sh, dt in made:
      if in_callers_trace:
        z = _zeros_after(m, sh, dt)
        out.append(host_memory.to_host(z) if host and len(sh) > 0 else z)
      else:
        out.append(_zeros(opts, host and len(sh) > 0, typed, name, i, sh, dt))
  tree = lambda xs: jax.tree.unflatten(plan.lay.treedef, xs)  # noqa: E731
  return state_lib.SuperOffloadState.of(
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
    placement=plan.placement,
    weights_digest=_weights_digest(opts, plan, leaves),
  )


def _master(param, dtype, shape, paired: bool, host: bool) -> jax.Array:
  """A master leaf from its parameter (both rows of a paired leaf)."""
  m = param.astype(dtype)
  if paired:
    return jnp.broadcast_to(m[None], shape)
  if not host:  # jit would hand the parameter itself back otherwise.
    return jnp.copy(m)
  return m


def _zeros(opts, host: bool, typed, name: str, i: int, shape, dtype) -> Any:
  """A zero state leaf, made where it lives (host compute, on the host)."""
  if not host:
    return typed(name, i, jnp.zeros(shape, dtype))
  if opts.zero is None:  # Made by host compute where they live.
    return host_memory.on_host(functools.partial(jnp.zeros, shape, dtype))
  return host_memory.to_host(typed(name, i, jnp.zeros(shape, dtype)))


def _zeros_after(master: jax.Array, shape: tuple, dtype: Any) -> jax.Array:
  """Zeros of `shape` computed from `master`, so split as it is split.

  XLA gives a constant no split of its own (it is made whole on every
  device) and folds `x & 0`; a select on `master`'s finiteness it cannot
  fold, and `+ 0.0` turns the `-0.0` of a negative weight into `+0.0`.
  Leaves of another shape (8-bit scales, the empty rows of leaves that are
  not double-buffered) are small: made as constants.
  """
  if master.ndim and tuple(shape) == master.shape[1:]:  # A paired leaf's
    master = master[0]  # kept gradients: one row of the master's two.
  if tuple(shape) != master.shape:
    return jnp.zeros(shape, dtype)
  zero = jnp.where(jnp.isfinite(master), master * 0, 0) + 0.0
  return zero.astype(dtype)


def _weights_digest(opts, plan, leaves: list) -> jax.Array | None:
  """The digest of a fresh state: its kernel leaves' parameters.

  The master starts as them, so they are the weights it rounds to. A
  state that keeps an unused one gets one that matches nothing.
  """
  if not opts.keeps_digest:
    return None
  if not opts.digests_weights:
    return jnp.zeros((len(leaves), weights_digest.COLUMNS), jnp.uint32)
  digested = []
  for ids in weights_digest.groups(state_lib.buckets_of(plan.lay)):
    xs = [leaves[i] for i in ids]
    digested.append((ids, xs, xs))
  return weights_digest.after_step(len(leaves), digested)


def _typer(opts, shardings: Any) -> Callable[[str, int, jax.Array], Any]:
  """`typed(field, i, x)`: `x` typed with the split of its state leaf.

  A jitted `init` returns its leaves with the types they were made with:
  out_shardings place them but leave a split over explicit mesh axes out
  of the type (zeros are typed replicated), which an eager `init`'s
  concrete arrays have. So each leaf made on a mesh with explicit axes is
  resharded to its sharding first (on the device: it moves nothing, the
  zeros are made split); on auto axes it is left as it is.
  """
  if opts.zero is None or shardings is None:
    return lambda name, i, x: x
  where = {
    name: jax.tree.leaves(getattr(shardings, name))
    for name in ('master', 'mu', 'nu', 'kept_grads', 'mu_scales', 'nu_scales')
    if getattr(shardings, name) is not None
  }

  def typed(name: str, i: int, x: jax.Array) -> Any:
    if name not in where:  # Made, then dropped (e.g. no kept_grads).
      return x
    sharding = where[name][i]
    mesh, spec = sharding.mesh, sharding.spec
    explicit = {
      a
      for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
      if t == jax.sharding.AxisType.Explicit
    }
    named = {
      a
      for entry in spec
      if entry is not None
      for a in ((entry,) if isinstance(entry, str) else entry)
    }
    if not explicit or not named <= explicit:
      return x
    return jax.sharding.reshard(x, jax.sharding.NamedSharding(mesh, spec))

  return typed


def _device_of(params: Any) -> jax.Device:
  """The one device concrete parameters are on (default: the first)."""
  for x in jax.tree.leaves(params):
    sharding = getattr(x, 'sharding', None)
    if sharding is not None and not isinstance(x, jax.core.Tracer):
      return next(iter(sharding.device_set))
  return jax.devices()[0]


def _state_shardings(
  opts, params: Any, placement
) -> state_lib.SuperOffloadState:
  """The out_shardings of `init`: where each state leaf is made.

  In pinned host memory (but scalars and device buckets on the device);
  under ZeRO each leaf split along one axis, when following the
  parameters' shardings as its parameter is.
  """
  plan = state_lib.bucketing_for(opts, params, placement)
  zero = opts.zero
  if zero is None:
    device = _device_of(params)

    def sharding(spec, host, ndim):
      del spec
      return host_memory.single_device_sharding(device, host, ndim)
  else:

    def sharding(spec, host, ndim):
      del ndim
      return zero.sharding(spec, host)

  master, kept, scales = [], [], []
  for i, (shape, *_, paired) in enumerate(
    state_lib.leaf_state_types(opts, plan)
  ):
    host = state_lib.host_leaf(plan, i)
    spec = zero_lib.P()
    if zero is not None:
      spec = zero.spec_for(i, plan.lay.shapes[i])
    state_spec = zero_lib.pair_spec(spec) if paired else spec
    master.append(sharding(state_spec, host and len(shape) > 0, len(shape)))
    kept_host = host and (not paired or len(shape) > 1)
    kept_ndim = len(shape) - 1 if paired else len(shape) + 2
    kept.append(
      sharding(spec if paired else zero_lib.P(), kept_host, kept_ndim)
    )
    scales_spec = zero_lib.P()
    if zero is not None and i in plan.bucket_of:
      scales_spec = zero.scales_spec(spec)
    scales.append(sharding(scales_spec, host, 1))
  tree = lambda xs: jax.tree.unflatten(plan.lay.treedef, xs)  # noqa: E731
  counter = sharding(zero_lib.P(), False, 0)
  return state_lib.SuperOffloadState.of(
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
    placement=plan.placement,
    weights_digest=(
      sharding(zero_lib.P(), False, 2) if opts.keeps_digest else None
    ),
  )


def _stand_in(leaf: Any) -> Any:
  """A parameter as `init` reads it: abstract ones as zeros.

  optax's init needs only the parameters' shapes and dtypes, so it takes
  `jax.ShapeDtypeStruct`s; ours copies their values into the master, which
  starts from zeros then: the first `update` given the parameters starts
  from them, as from any parameters that no longer match the master.
  Python and NumPy scalars become the arrays optax's math makes of them.
  """
  if isinstance(leaf, jax.ShapeDtypeStruct):
    return jnp.zeros(leaf.shape, leaf.dtype, device=leaf.sharding)
  if isinstance(leaf, (bool, int, float, complex, np.generic)):
    return jnp.asarray(leaf)
  return leaf


def init(
  opts: options_lib.Options, params: optax.Params
) -> state_lib.SuperOffloadState:
  """`init` of the transformation: the state for `params`."""
  params = jax.tree.map(_stand_in, params)
  # Chosen once per tree ("auto" plans), kept in the state for `update`.
  placement = opts.decide_placement(opts.layout(params), params)
  if not jax.tree.leaves(params):  # Say optax.tree_map_params' placeholder.
    return _build_state(opts, params, placement)
  if opts.zero is None and _traced(params):
    # Traced where the types name no split (auto axes, the old `with
    # mesh:`, parameters made inside the caller's jit, which may span
    # devices its types do not show): a nested jit would name one device,
    # which the caller's jit refuses. Made in the caller's trace, the
    # state is split as XLA splits the parameters, and the caller's
    # out_shardings (see `state_shardings`) place it.
    return _build_state(opts, params, placement, in_callers_trace=True)
  if jax.sharding.get_abstract_mesh().manual_axes:
    # In a user's shard_map: each shard's state of its own block, in host
    # memory; a sharding naming devices is refused there. A jit, as eager
    # shard_map refuses a device_put to host memory.
    return jax.jit(lambda p: _build_state(opts, p, placement))(params)
  # One traced computation that writes each state leaf where it lives
  # (out_shardings): no leaf is made on the device and copied over, so the
  # peak is the parameters plus the state. Under a mesh every placement is
  # also a sharding of its global arrays (eager transfers of process-local
  # values to a mesh spanning several processes are not supported).
  shardings = _state_shardings(opts, params, placement)
  made = jax.jit(
    lambda p: _build_state(opts, p, placement, shardings),
    out_shardings=shardings,
  )
  if opts.zero is None:
    return made(params)
  with zero_lib.on_mesh(opts.zero.mesh):  # A user's set_mesh of auto axes.
    return made(params)


def _traced(params: Any) -> bool:
  """Whether `params` are traced, outside a user's `shard_map`."""
  if jax.sharding.get_abstract_mesh().manual_axes:
    return False  # Each shard's own block: see `init`.
  return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(params))


def init_following(opts, params: optax.Params) -> state_lib.SuperOffloadState:
  """`init`, with the state split as the parameters are (without a mesh)."""
  if opts.zero is not None:
    return init(opts, params)
  block = moments.BLOCK if opts.moments_8bit else 0
  zero = following.of_params(params, block)
  return init(opts.with_zero(zero), params)
