"""The update of `adam` / `adamw` as a pipeline of short steps.

1. `_inputs`: the plan of the tree, the state checked leaf by leaf against
   the parameters, the gradients and parameters flattened.
2. `_schedule`: the buckets, each with its executor and hyperparameters
   (and, with a `weights_digest`, whether its parameters are unchanged);
   every bucket's step starts at once (speculatively with STV).
3. `stv.validate_buckets` (STV only): the global norm, and each executor's
   fix of its step (a redo or a drop) when it says so.
4. `_assemble`: the updates, in the parameters' dtypes.
5. `_optax_leaves`: the leaves the kernel does not cover, by optax's math.
6. `_new_state`, with the digest of the parameters the caller passes next
   (`weights_digest.after_update`).
"""

from __future__ import annotations

import functools
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_superoffload._src.core import backend
from jax_superoffload._src.core import host_memory
from jax_superoffload._src.core import layout
from jax_superoffload._src.core import moments
from jax_superoffload._src.host import executors
from jax_superoffload._src.host import in_place
from jax_superoffload._src.host import steps
from jax_superoffload._src.optim import optax_path
from jax_superoffload._src.optim import scan_overlap
from jax_superoffload._src.optim import state as state_lib
from jax_superoffload._src.optim import state_memory
from jax_superoffload._src.optim import stv
from jax_superoffload._src.optim import weights_digest
from jax_superoffload._src.parallel import following
from jax_superoffload._src.parallel import zero as zero_lib


class Inputs(NamedTuple):
  """An update's inputs, flattened and checked."""

  plan: state_lib.Bucketing
  grads: list[jax.Array]
  params: list[jax.Array] | None
  state: dict[str, list[jax.Array]]  # master, mu, nu (, kept_grads).
  # The leaves as given (Python scalars too), which optax's path reads.
  given: tuple[list[Any], list[Any] | None]


def _inputs(opts, updates, state, params) -> Inputs:
  reference = params if params is not None else updates
  # The choices init made for this tree, read from the state.
  placement = getattr(state, 'placement', None)
  plan = state_lib.bucketing_for(opts, reference, placement)
  checked = state_lib.check_state(opts, plan, state, from_grads=params is None)
  grads = layout.check_tree(plan.lay, updates, 'gradients')
  leaves = None
  if params is not None:
    leaves = layout.check_tree(plan.lay, params, 'params')
  arrays = lambda xs: [layout.as_array(x) for x in xs]  # noqa: E731
  return Inputs(
    plan,
    arrays(grads),
    None if leaves is None else arrays(leaves),
    checked,
    (grads, leaves),
  )


def _kernel_grad(g: jax.Array, cast_on_device: bool) -> jax.Array:
  # The kernel reads f32, bf16 and f16 gradients as stored; others (e.g. a
  # float64 gradient of an f32 parameter) are converted on the device, and
  # so is everything when the device is the casting side.
  if not cast_on_device and g.dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
    return g
  return g.astype(jnp.float32)


class _Shards(NamedTuple):
  """A bucket's inputs as its host step reads them under ZeRO."""

  grads: list[jax.Array]
  params: list[jax.Array] | None
  specs: list[Any] | None
  moment_specs: list[Any] | None


def _shards(opts, plan, ids: list[int], grads, params) -> _Shards:
  """Each leaf's gradient and parameter split as its state is (ZeRO)."""
  zero = opts.zero
  if zero is None:
    return _Shards(grads, params, None, None)
  specs = [zero.spec_for(i, plan.lay.shapes[i]) for i in ids]
  moment_specs = specs
  if opts.moments_8bit:  # The codes as the leaf, the scales by block.
    moment_specs = [moments.Blockwise(s, zero.scales_spec(s)) for s in specs]
  grads = [zero.scatter(g, s) for g, s in zip(grads, specs, strict=True)]
  if params is not None:
    params = [zero.scatter(p, s) for p, s in zip(params, specs, strict=True)]
  return _Shards(grads, params, specs, moment_specs)


def _schedule(
  opts, inputs: Inputs, count, cast_on_device: bool, rows=None, digest=None
) -> list:
  """The buckets of this step, with their gradients ready for the kernel.

  `rows`: the `overlap_scan` scope whose started leaves no bucket holds.
  `digest`: the state's `weights_digest`, for each bucket's `unchanged`.
  """
  plan = inputs.plan
  want_delta = inputs.params is None
  started = rows.started if rows is not None else set()
  barrier = _join_barrier(opts, scan_overlap.for_ordering(rows, inputs.grads))
  out = []
  for group in plan.lay.groups:
    hyper = opts.hyperparams(count, decay=group.decay)
    for bucket in group.buckets:
      ids = [group.leaves[j] for j in bucket if group.leaves[j] not in started]
      if not ids:
        continue
      resident = plan.bucket_of[ids[0]] in plan.on_device
      grads = [_kernel_grad(inputs.grads[i], cast_on_device) for i in ids]
      # Params in their own dtype even when the device casts: the master is
      # re-seeded only where it no longer rounds to them.
      params = None if want_delta else _pick(inputs.params, ids)
      shards = _shards(opts, plan, ids, grads, params)
      k = len(out)
      dtypes = [plan.lay.dtypes[i] for i in ids]
      out.append(
        executors.Bucket(
          index=k,
          leaves=ids,
          executor=executors.RESIDENT if resident else opts.executor,
          hyper=hyper,
          grads=shards.grads,
          params=shards.params,
          dtypes=dtypes,
          specs=shards.specs,
          moment_specs=shards.moment_specs,
          want_delta=want_delta,
          fp32_weights=want_delta
          or cast_on_device
          or all(jnp.dtype(d) == jnp.float32 for d in dtypes),
          barrier=barrier,
        )
      )
  if digest is not None and not want_delta:
    flags = weights_digest.bucket_flags(
      digest, inputs.params, [b.leaves for b in out]
    )
    out = [
      b._replace(unchanged=None if b.executor is executors.RESIDENT else f)
      for b, f in zip(out, flags, strict=True)
    ]
  if barrier is not None:  # The stream executor on a GPU, without ZeRO.
    bound = max(steps.staging_bound(out), rows.reserve if rows else 0)
    out = [b._replace(staging_bytes=bound) for b in out]
  return out


def _join_barrier(opts, grads: list[jax.Array]) -> jax.Array | None:
  """The stream executor's join barrier on a GPU (see steps.stream_place).

  Under ZeRO each shard's step runs in `shard_map`, which the barrier
  cannot enter: there every join waits at once (no overlap, still exact).
  """
  if opts.executor.name != 'stream' or opts.zero is not None:
    return None
  if backend.target() != 'gpu':
    return None
  return steps.join_barrier(grads)


def _pick(leaves: list, ids: list[int]) -> list:
  return [leaves[i] for i in ids]


def _before(inputs: Inputs, b: executors.Bucket, row) -> executors.LeafState:
  """Bucket `b`'s state before the step."""
  st = inputs.state
  fields = [_pick(st[n], b.leaves) for n in ('master', 'mu', 'nu')]
  if not b.executor.paired:
    return executors.LeafState(*fields)
  return executors.LeafState(*fields, _pick(st['kept_grads'], b.leaves), row)


def _assemble(opts, inputs: Inputs, buckets, results, verdict) -> tuple:
  """The updates per leaf: `params + u` is the new master, cast.

  Also returns the weights each bucket leaf's new master rounds to, by
  leaf (none without params), for the state's `weights_digest`.
  """
  plan, zero = inputs.plan, opts.zero
  ids = [i for b in buckets for i in b.leaves]
  weights = [w for b in buckets for w in results[b.index].weights]
  if zero is not None:  # All-gathered on the device.
    weights = [
      zero.match(zero.gather(w), inputs.grads[i])
      for i, w in zip(ids, weights, strict=True)
    ]
  if inputs.params is not None:
    weights = [
      w.astype(plan.lay.dtypes[i]) for i, w in zip(ids, weights, strict=True)
    ]
    if not opts.use_stv and in_place.wanted(zero):
      masters = [m for b in buckets for m in results[b.index].master]
      token = in_place.token_after(masters)
      weights = [in_place.after(w, token) for w in weights]
  out: list[Any] = [None] * len(inputs.grads)
  for i, w in zip(ids, weights, strict=True):
    # Without params, the weights are the fp32 change of the master.
    u = w if inputs.params is None else _exact_delta(w, inputs.params[i])
    out[i] = stv.drop_if_skipped(verdict, u)
  if inputs.params is None:
    return out, {}
  return out, dict(zip(ids, weights, strict=True))


def _exact_delta(new: jax.Array, old: jax.Array) -> jax.Array:
  """An update `u` in `old`'s dtype with `old + u == new`.

  `new - old` alone can round when a weight changes by more than half its
  magnitude (outside Sterbenz's lemma); one correction step in fp32
  recovers the residual. Low-precision updates are exact whenever the
  change is representable (ordinary steps, where new and old are within a
  factor of two).
  """
  new32, old32 = new.astype(jnp.float32), old.astype(jnp.float32)
  u = new32 - old32
  u = u + (new32 - (old32 + u))
  return u.astype(old.dtype)


def _optax_leaves(opts, inputs: Inputs, count, verdict, out: list) -> tuple:
  """Leaves the kernel does not cover, by optax's own Adam (on device).

  As `optax.adamw` steps them (`optax_path.step`): from the gradients and
  parameters as given (Python scalars stay Python numbers, as in optax's
  eager math).
  """
  lay = inputs.plan.lay
  ids = list(lay.fallback)
  st = inputs.state
  if not ids:
    return {}
  given_grads, given_params = inputs.given
  grads = _pick(given_grads, ids)
  if verdict is not None:  # Clipped as optax clips arrays.
    grads = stv.clip_serially(_pick(inputs.grads, ids), verdict, opts.clip_norm)
  old = {
    n: [host_memory.to_device(x) for x in _pick(st[n], ids)]
    for n in ('master', 'mu', 'nu')
  }
  params = old['master'] if given_params is None else _pick(given_params, ids)
  u, new = optax_path.step(opts, lay, ids, count, grads, params, old)
  u = [stv.drop_if_skipped(verdict, x) for x in u]
  new = stv.keep_if_skipped(verdict, old, new)
  if inputs.params is None:  # The gradients' dtype, as the kernel's leaves.
    u = [
      x.astype(jnp.result_type(g)) if optax_path.floating(lay, i) else x
      for x, g, i in zip(u, grads, ids, strict=True)
    ]
  for i, x in zip(ids, u, strict=True):
    out[i] = x
  # Back where each leaf lives: host memory, but for scalars and the
  # leaves kept in device memory (see alias._on_device).
  return {
    n: [
      host_memory.to_host(x)
      if x.ndim and not host_memory.typed_on_device(o)
      else x
      for x, o in zip(xs, _pick(st[n], ids), strict=True)
    ]
    for n, xs in new.items()
  }


def _finish_rows(rows, inputs: Inputs, out: list) -> tuple[dict, dict]:
  """The leaves `overlap_scan` started in the loop, joined.

  Their updates go into `out`; returns their new state, ``{i: (master,
  mu, nu)}``, and the weights their new masters round to, by leaf.
  """
  done = scan_overlap.finish(rows, inputs.grads, inputs.params)
  weights = {}
  for i, (*_, weight) in done.items():
    # The weights the rows rounded on the host, or a master rounded here
    # as the buckets round on the host (to nearest even); then the same
    # exact update.
    weights[i] = weight.astype(inputs.params[i].dtype)
    out[i] = _exact_delta(weights[i], inputs.params[i])
  return {i: tuple(x[:3]) for i, x in done.items()}, weights


def _new_state(
  opts, inputs, state, buckets, results, kept, optax_new, verdict, rows=None
):
  """The state after the step, trees like the parameters.

  `rows`: the new state of leaves started in the loop (`_finish_rows`).
  """
  st = inputs.state
  names = ['master', 'mu', 'nu'] + (
    ['kept_grads'] if opts.double_buffered else []
  )
  new = {n: list(st[n]) for n in names}
  for b in buckets:
    r = results[b.index]
    for n in names:
      if n == 'kept_grads':
        if b.executor.paired:
          for i, x in zip(b.leaves, kept[b.index], strict=True):
            new[n][i] = x
        continue
      for i, x in zip(b.leaves, getattr(r, n), strict=True):
        new[n][i] = executors.scalars_to(host_memory.to_device, [x])[0]
  for n, xs in optax_new.items():
    for i, x in zip(inputs.plan.lay.fallback, xs, strict=True):
      new[n][i] = x
  for i, runs in (rows or {}).items():
    for n, x in zip(('master', 'mu', 'nu'), runs, strict=True):
      new[n][i] = x
  scales = _split_blockwise(opts, state, new)
  tree = lambda xs: jax.tree.unflatten(inputs.plan.lay.treedef, xs)  # noqa: E731
  count, redone, skipped, row = stv.counters(state, verdict)
  return state_lib.SuperOffloadState.of(
    count=count,
    mu=tree(new['mu']),
    nu=tree(new['nu']),
    master=tree(new['master']),
    redone=redone,
    skipped=skipped,
    row=row,
    kept_grads=tree(new['kept_grads']) if opts.double_buffered else None,
    mu_scales=tree(scales['mu']) if scales else None,
    nu_scales=tree(scales['nu']) if scales else None,
    placement=state.placement,
  )


def _split_blockwise(opts, state, new: dict) -> dict:
  """8-bit moments: `new`'s codes in place, and the scales of mu and nu."""
  if not opts.moments_8bit:
    return {}
  scales = {}
  for n in ('mu', 'nu'):
    old = jax.tree.leaves(getattr(state, f'{n}_scales'))
    scales[n] = [
      x.scales if isinstance(x, moments.Blockwise) else s
      for x, s in zip(new[n], old, strict=True)
    ]
    new[n] = [
      x.codes if isinstance(x, moments.Blockwise) else x for x in new[n]
    ]
  return scales


def update(opts, updates, state, params):
  """One step: the updates and the new state."""
  state_lib.check_type(state)
  rows = scan_overlap.claim(opts, state, updates, params)
  typed, state = state, state_memory.read_typed(state)
  inputs = _inputs(opts, updates, state, params)
  state_memory.check_on_host(inputs.plan, typed)
  if rows is not None:
    inputs = inputs._replace(state=scan_overlap.with_stacks(rows, inputs.state))
  cast_on_device = inputs.plan.placement.cast_on_device
  digest = weights_digest.checked(opts, state, len(inputs.grads))
  buckets = _schedule(opts, inputs, state.count, cast_on_device, rows, digest)
  before = {b.index: _before(inputs, b, state.row) for b in buckets}
  results = {
    b.index: b.executor.step(opts.zero, b, before[b.index]) for b in buckets
  }
  verdict, kept = None, {}
  if opts.use_stv:
    verdict, results, kept = stv.validate_buckets(
      opts, inputs, buckets, before, results
    )
  out, produced = _assemble(opts, inputs, buckets, results, verdict)
  started, row_groups = {}, []
  if rows is not None:
    started, row_weights = _finish_rows(rows, inputs, out)
    produced, row_groups = {**produced, **row_weights}, rows.row_groups
  optax_new = _optax_leaves(opts, inputs, state.count, verdict, out)
  for i, u in enumerate(out):  # Zero-size leaves no bucket holds.
    if u is None:
      out[i] = jnp.zeros(inputs.plan.lay.shapes[i], inputs.plan.lay.dtypes[i])
  new_state = _new_state(
    opts, inputs, state, buckets, results, kept, optax_new, verdict, started
  )
  if state.weights_digest is not None:
    groups = weights_digest.groups([b.leaves for b in buckets])
    new_digest = weights_digest.after_update(
      opts,
      state,
      digest,
      groups + row_groups,
      (inputs.params, produced, out),
      verdict,
    )
    new_state = state_lib.with_fields(new_state, weights_digest=new_digest)
  new_state = state_memory.kept_in_place(typed, new_state)
  return jax.tree.unflatten(inputs.plan.lay.treedef, out), new_state


def _state_split(opts, state: Any, reference: Any):
  """The state's own split, else that of the parameters (or gradients)."""
  block = moments.BLOCK if opts.moments_8bit else 0
  ours = isinstance(state, state_lib.SuperOffloadState)
  return following.split_of(state.master if ours else None, reference, block)


def update_following(opts, updates, state, params=None):
  """`update`, with the state's split read from the arguments (no mesh)."""
  reference = params if params is not None else updates
  zero = None if opts.zero is not None else _state_split(opts, state, reference)
  if zero is None and jax.sharding.get_abstract_mesh().manual_axes:
    # In a user's shard_map, whose eager form refuses a move to host memory.
    return jax.jit(functools.partial(update, opts))(updates, state, params)
  if zero is None:
    return update(opts, updates, state, params)
  with zero_lib.on_mesh(zero.mesh):  # A user's set_mesh of auto axes.
    out, new_state = update(
      opts.with_zero(zero),
      following.onto(zero, updates),
      state,
      following.onto(zero, params),
    )
  meshes = map(following.mesh_of, jax.tree.leaves(reference))
  # Parameters typed on no mesh are on the user's set_mesh, if any.
  context = jax.sharding.get_abstract_mesh()
  theirs = next(filter(None, meshes), None if context.empty else context)
  if theirs is not None:
    out = following.onto(zero, out, theirs)
  return out, new_state
