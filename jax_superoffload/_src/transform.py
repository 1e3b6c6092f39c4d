"""`adam` / `adamw`: Optax transformations with host-resident Adam state."""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_superoffload._src import adam_args
from jax_superoffload._src import executors
from jax_superoffload._src import host_memory
from jax_superoffload._src import in_place
from jax_superoffload._src import layout
from jax_superoffload._src import placement
from jax_superoffload._src import stv
from jax_superoffload._src import zero as zero_lib

DEFAULT_BUCKET_BYTES = 256 * 2**20


class SuperOffloadState(NamedTuple):
  """State of `superoffload.adam` / `adamw`.

  Attributes:
    count: Steps taken (int32 scalar), as in optax's `ScaleByAdamState`.
    mu: First moments, fp32 buckets in host memory.
    nu: Second moments, fp32 buckets in host memory.
    master: fp32 master weights, buckets in host memory.
    fallback: optax state for leaves the kernel does not cover (float64 or
      complex parameters, or a non-fp32 `mu_dtype`), in host memory.
    redone: Steps that speculation-then-validation redid with clipped
      gradients (int32 scalar).
    skipped: Steps dropped for non-finite gradients (int32 scalar).
    row: With STV on the "ffi" executor, which of the two rows of each
      double-buffered bucket is current (int32 scalar, 0 or 1); else None.
    kept_grads: With STV on the "ffi" executor, per bucket, the fp32
      gradients the speculative step read, kept in host memory for a redo
      (None for buckets that are not double-buffered); else None.

  With STV on the "ffi" executor, each host bucket of `master`, `mu` and
  `nu` holds two rows end to end (2n elements): row `row` is the current
  state, the other the spare the next speculative step writes (see
  stv.py). `current()` gives the current state either way.
  """

  count: jax.Array
  mu: tuple[jax.Array, ...]
  nu: tuple[jax.Array, ...]
  master: tuple[jax.Array, ...]
  fallback: optax.OptState
  redone: jax.Array
  skipped: jax.Array
  row: jax.Array | None = None
  kept_grads: tuple[jax.Array | None, ...] | None = None

  def current(self) -> stv.HostState:
    """The current master, mu and nu per bucket (of a concrete state)."""
    if self.kept_grads is None:
      return stv.HostState(self.master, self.mu, self.nu)
    row = int(self.row)
    pick = [
      stv.current_row if k is not None else (lambda x, _: x)
      for k in self.kept_grads
    ]
    return stv.HostState(
      *(
        tuple(f(x, row) for f, x in zip(pick, xs, strict=True))
        for xs in (self.master, self.mu, self.nu)
      )
    )


def _kernel_grad(g: jax.Array, cast_on_device: bool) -> jax.Array:
  # The kernel reads f32, bf16 and f16 gradients as stored; others (e.g. a
  # float64 gradient of an f32 parameter) are converted on the device, and
  # so is everything when the device is the casting side.
  if not cast_on_device and g.dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
    return g
  return g.astype(jnp.float32)


def _exact_delta(new: jax.Array, old: jax.Array) -> jax.Array:
  """An update `u` with `old + u == new` in fp32, so apply_updates is exact.

  `new - old` alone can round when a weight changes by more than half its
  magnitude (outside Sterbenz's lemma); one correction step recovers the
  residual. Low-precision parameters get fp32 updates: optax.apply_updates
  adds in fp32 and casts the sum, which is then exactly `new`.
  """
  new32, old32 = new.astype(jnp.float32), old.astype(jnp.float32)
  u = new32 - old32
  u = u + (new32 - (old32 + u))
  return u


def _state_to_host(x: jax.Array) -> jax.Array:
  # Scalars (the fallback's step counts) stay on the device: they are 4
  # bytes, and JAX drops the host memory space of 0-d results of
  # `jnp.where`, which wrappers such as optax.MultiSteps apply to the state.
  # Committed either way, so a second call does not recompile.
  if jnp.ndim(x) > 0:
    return host_memory.to_host(x)
  return host_memory.to_device(x)


def _fix_if_needed(
  buckets, originals, states, weights, redo, skip, scale, zero
):
  """Redoes the steps from their original state if validation failed.

  For buckets whose step wrote new buffers (every executor but "ffi"),
  the state before the step is still there: a clipped step is taken again
  from it with the gradients scaled (the kernel's `grad_scale`), exactly
  as without speculation; a dropped step keeps it. Runs only when needed
  (`lax.cond`), so a step that validates pays nothing. With ZeRO, each
  bucket's redo runs per shard.
  """

  def keep(states, weights):
    return states, weights

  def fix(states, weights):
    def redo_all(_):
      out_states, out_weights = [], []
      for (executor, step, grads, dtypes, _), s in zip(
        buckets, originals, strict=True
      ):
        again = dataclasses.replace(step, grad_scale=scale)
        m, a, v, w = _bucket_step(zero, executor, dtypes)(
          again, None, *s, grads
        )
        out_states.append((m, a, v))
        out_weights.append(w)
      return out_states, out_weights

    def drop(_):  # The weights do not matter: updates become 0.
      return [tuple(s) for s in originals], weights

    return jax.lax.cond(redo, redo_all, drop, None)

  return jax.lax.cond(
    jnp.logical_or(redo, skip), fix, keep, [tuple(s) for s in states], weights
  )


def _bucket_step(zero, executor, dtypes):
  """`executors.step_bucket` as `fn(step, extra, *arrays)`, per shard."""

  def fn(step, _, master, mu, nu, grads):
    return executors.step_bucket(executor, step, master, mu, nu, grads, dtypes)

  return zero_lib.per_shard(zero, fn)


def _speculate(zero, dtypes):
  """`executors.speculate` as `fn(step, row, *arrays)`, per shard."""

  def fn(step, row, master, mu, nu, kept, grads):
    return executors.speculate(step, row, master, mu, nu, kept, grads, dtypes)

  return zero_lib.per_shard(zero, fn)


def _validate_and_finish(zero):
  """A double-buffered bucket's redo if needed, then its new weights."""

  def fn(step, flags, out, grads):
    row, redo, skip, scale = flags
    fixed = executors.validate_pair(step, out, row, redo, skip, scale)
    return executors.finish_pair(step, fixed, row, grads)

  return zero_lib.per_shard(zero, fn)


def _validate_options(
  learning_rate, b1, b2, eps, eps_root, weight_decay, bucket_bytes
) -> None:
  adam_args.check_hyperparameters(
    learning_rate=None if callable(learning_rate) else learning_rate,
    b1=b1,
    b2=b2,
    eps=eps,
    eps_root=eps_root,
  )
  if not callable(weight_decay):
    adam_args.check_hyperparameters(weight_decay=weight_decay)
  if (
    not isinstance(bucket_bytes, (int, np.integer))
    or isinstance(bucket_bytes, bool)
    or bucket_bytes < 4
  ):
    raise ValueError(
      f'bucket_bytes must be an integer >= 4, got {bucket_bytes!r}'
    )


def _check_clip_norm(clip_norm: Any) -> None:
  # A number, or a scalar array as optax.inject_hyperparams makes of one
  # (its value is checked unless traced: inject rebuilds us inside update).
  number = isinstance(clip_norm, (int, float)) and not isinstance(
    clip_norm, bool
  )
  array = isinstance(clip_norm, (jax.Array, np.ndarray, np.generic)) and (
    np.ndim(clip_norm) == 0 and jnp.issubdtype(clip_norm.dtype, jnp.floating)
  )
  if (number or array) and (
    isinstance(clip_norm, jax.core.Tracer) or clip_norm > 0
  ):
    return
  raise ValueError(
    f'clip_norm must be a positive number or a scalar float array, got '
    f'{clip_norm!r}'
  )


def _fallback_tx(
  learning_rate,
  b1,
  b2,
  eps,
  eps_root,
  mu_dtype,
  weight_decay,
  decay_mask,
  nesterov,
):
  return optax.chain(
    optax.scale_by_adam(
      b1, b2, eps, eps_root, mu_dtype=mu_dtype, nesterov=nesterov
    ),
    optax.add_decayed_weights(weight_decay, mask=list(decay_mask)),
    optax.scale_by_learning_rate(learning_rate),
  )


def superoffload_adam(
  learning_rate: optax.ScalarOrSchedule,
  b1: float,
  b2: float,
  eps: float,
  eps_root: float,
  mu_dtype: Any,
  weight_decay: optax.ScalarOrSchedule,
  mask: Any,
  *,
  nesterov: bool,
  bucket_bytes: int | None,
  executor: str,
  clip_norm: float | None = None,
  skip_nonfinite: bool = False,
  device_buckets: Any = None,
  arrival_order: Any = None,
  cast: str = 'host',
  hardware: Any = None,
  mesh: Any = None,
  shard_axis: Any = None,
) -> optax.GradientTransformationExtraArgs:
  """Builds the transformation behind `adam` and `adamw` (see their docs)."""
  zero = zero_lib.make(mesh, shard_axis)
  placement.check_device_buckets(device_buckets)
  if cast not in placement.CASTS:
    raise ValueError(f'cast must be one of {placement.CASTS}, got {cast!r}')
  if clip_norm is not None:
    _check_clip_norm(clip_norm)
  use_stv = clip_norm is not None or skip_nonfinite
  if bucket_bytes is None:
    bucket_bytes = DEFAULT_BUCKET_BYTES
  _validate_options(
    learning_rate, b1, b2, eps, eps_root, weight_decay, bucket_bytes
  )
  executor = executors.resolve(executor)
  # STV on the kernel double-buffers each host bucket (see stv.py).
  double_buffered = use_stv and executor == 'ffi'
  use_kernel = mu_dtype is None or np.dtype(mu_dtype) == np.float32
  bucket_elements = max(1, int(bucket_bytes) // 4)
  no_decay = isinstance(weight_decay, (int, float)) and weight_decay == 0.0

  def state_sizes(lay: layout.Layout, paired: frozenset[int]) -> tuple:
    sizes = lay.bucket_sizes
    if zero is not None:
      sizes = tuple(zero.padded(n) for n in sizes)
    return tuple(n * (2 if k in paired else 1) for k, n in enumerate(sizes))

  def paired_ids(lay: layout.Layout, on_device: frozenset[int]) -> frozenset:
    if not double_buffered:
      return frozenset()
    return frozenset(range(lay.num_buckets)) - on_device

  def place(bucket: jax.Array, on_host: bool) -> jax.Array:
    if zero is not None:  # Placed by init's out_shardings.
      return zero.pad(bucket)
    return (
      host_memory.to_host(bucket) if on_host else host_memory.to_device(bucket)
    )

  def make_layout(tree: Any) -> layout.Layout:
    n = len(jax.tree.leaves(tree))
    decay = [False] * n if no_decay else layout.resolve_mask(mask, tree)
    return layout.build_layout(
      tree, decay, bucket_elements=bucket_elements, use_kernel=use_kernel
    )

  def fallback_tx(lay: layout.Layout):
    return _fallback_tx(
      learning_rate,
      b1,
      b2,
      eps,
      eps_root,
      mu_dtype,
      weight_decay,
      lay.fallback_decay,
      nesterov,
    )

  def resident(lay: layout.Layout, tree: Any) -> frozenset[int]:
    return placement.device_bucket_ids(
      lay, device_buckets, arrival_order, tree, hardware
    )

  def init_fn(params: optax.Params) -> SuperOffloadState:
    if zero is not None:
      # Traced, so that every placement is a sharding of the mesh's global
      # arrays (eager transfers of process-local values to a mesh spanning
      # several processes are not supported), with the output shardings
      # spelled out: under auto mesh axes jit does not take them from the
      # placements inside.
      return jax.jit(build_state, out_shardings=zero_shardings(params))(params)
    return build_state(params)

  def zero_shardings(params: optax.Params) -> SuperOffloadState:
    lay = make_layout(params)
    on_device = resident(lay, params)
    buckets = tuple(
      zero.bucket_sharding(on_host=k not in on_device)
      for k in range(lay.num_buckets)
    )
    leaves = jax.tree.leaves(params)
    fallback = jax.eval_shape(
      fallback_tx(lay).init, [leaves[i] for i in lay.fallback]
    )
    counter = zero.replicated(on_host=False)
    kept = None
    if double_buffered:
      kept = tuple(None if k in on_device else b for k, b in enumerate(buckets))
    return SuperOffloadState(
      count=counter,
      mu=buckets,
      nu=buckets,
      master=buckets,
      fallback=jax.tree.map(
        lambda x: zero.replicated(on_host=len(x.shape) > 0), fallback
      ),
      redone=counter,
      skipped=counter,
      row=counter if double_buffered else None,
      kept_grads=kept,
    )

  def build_state(params: optax.Params) -> SuperOffloadState:
    lay = make_layout(params)
    on_device = resident(lay, params)
    leaves = jax.tree.leaves(params)
    if zero is not None:
      leaves = [zero.unshard(x) for x in leaves]
    paired = paired_ids(lay, on_device)
    master, mu, nu, kept = [], [], [], []
    for group in lay.groups:
      for bucket in layout.pack(group, leaves):
        k = len(master)
        on_host = k not in on_device
        if zero is not None:  # Padded before it is doubled into two rows.
          bucket = zero.pad(bucket)
        shards = 0 if k not in paired else zero.size if zero else 1
        # The kept gradients' padding lets them share the spare row's
        # alignment (stv.KEPT_GRAD_PAD).
        kept.append(
          place(
            jnp.zeros(bucket.size + stv.KEPT_GRAD_PAD * shards, jnp.float32),
            on_host,
          )
          if shards
          else None
        )
        # A fresh zeros array each for mu and nu: two state leaves must
        # never share a buffer (both are donated).
        for out, x in (
          (master, bucket),
          (mu, jnp.zeros_like(bucket)),
          (nu, jnp.zeros_like(bucket)),
        ):
          # Double-buffered: two rows, the spare starting as a copy.
          out.append(place(stv.two_rows(x, shards) if shards else x, on_host))
    fallback = fallback_tx(lay).init([leaves[i] for i in lay.fallback])
    if zero is None:  # With ZeRO, init's out_shardings place the state.
      fallback = jax.tree.map(_state_to_host, fallback)

    def counter() -> jax.Array:
      x = jnp.zeros([], jnp.int32)
      return x if zero is not None else host_memory.to_device(x)

    return SuperOffloadState(
      count=counter(),
      mu=tuple(mu),
      nu=tuple(nu),
      master=tuple(master),
      fallback=fallback,
      redone=counter(),
      skipped=counter(),
      row=counter() if double_buffered else None,
      kept_grads=tuple(kept) if double_buffered else None,
    )

  def check_state(
    lay: layout.Layout,
    state: SuperOffloadState,
    from_grads: bool,
    paired: frozenset[int],
  ) -> None:
    if not isinstance(state, SuperOffloadState):
      raise TypeError(
        f'expected a SuperOffloadState, got {type(state).__name__}'
      )
    got = tuple(int(np.prod(np.shape(b))) for b in state.master)
    want = state_sizes(lay, paired)
    if got != want or any(len(x) != len(got) for x in (state.mu, state.nu)):
      hint = (
        ' (without params, the layout comes from the gradients: give them '
        "the parameters' dtypes, or pass params)"
        if from_grads
        else ''
      )
      raise ValueError(
        'optimizer state was built for another parameter tree: its '
        f'buckets hold {list(got)} elements, these parameters need '
        f'{list(want)}{hint}'
        + (
          f' (padded to multiples of the {zero.size} shards)'
          if zero is not None
          else ''
        )
      )

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args  # Accepted for optax.GradientTransformationExtraArgs.
    reference = params if params is not None else updates
    lay = make_layout(reference)
    on_device = resident(lay, reference)
    paired = paired_ids(lay, on_device)
    check_state(lay, state, from_grads=params is None, paired=paired)
    grads = layout.check_tree(lay, updates, 'gradients')
    param_leaves = (
      None if params is None else layout.check_tree(lay, params, 'params')
    )
    count = state.count
    lr = learning_rate(count) if callable(learning_rate) else learning_rate
    wd = weight_decay(count) if callable(weight_decay) else weight_decay

    cast_on_device = placement.resolve_cast(cast, reference, hardware)
    # Leaves that can be flattened as they are (see `Zero.unshard`).
    flat_ready = grads if zero is None else [zero.unshard(g) for g in grads]
    # Speculative pass: every bucket's host step starts at once.
    buckets = []  # (executor, step, grads, dtypes, leaf ids) per bucket.
    states, weights, kept = [], [], []
    pending = {}  # Double-buffered buckets to finish after validation.
    k = 0
    for group in lay.groups:
      step = executors.BucketStep(
        count=count,
        learning_rate=lr,
        b1=b1,
        b2=b2,
        eps=eps,
        eps_root=eps_root,
        weight_decay=wd if group.decay else 0.0,
        nesterov=nesterov,
        want_delta=params is None,
        cast_on_device=cast_on_device,
        want_sumsq=use_stv,
      )
      for b, bucket in enumerate(group.buckets):
        leaf_ids = [group.leaves[j] for j in bucket]
        bucket_grads = [
          _kernel_grad(g, cast_on_device)
          for g in layout.bucket_leaves(group, b, flat_ready)
        ]
        dtypes = [lay.dtypes[i] for i in leaf_ids]
        if zero is not None:  # One flat gradient, this device's slice.
          padded = zero.padded(group.bucket_sizes[b])
          bucket_grads = [zero.scatter(bucket_grads, padded)]
          dtypes = [group.dtype]
        bucket_executor = 'resident' if k in on_device else executor
        args = (state.master[k], state.mu[k], state.nu[k], bucket_grads)
        if k in paired:  # Finished after validation; weights move then.
          out = _speculate(zero, dtypes)(
            step, state.row, *args[:3], state.kept_grads[k], bucket_grads
          )
          pending[k] = out
          m, a, v, w = out.master, out.mu, out.nu, None
          kept.append(out.kept)
        else:
          m, a, v, w = _bucket_step(zero, bucket_executor, dtypes)(
            step, None, *args
          )
          kept.append(None)
        buckets.append((bucket_executor, step, bucket_grads, dtypes, leaf_ids))
        states.append((m, a, v))
        weights.append(w)
        k += 1

    # Validation, on the device, alongside the speculative steps.
    redo = skip = norm = None
    if use_stv:
      # Double-buffered buckets summed their squared gradients in the
      # kernel's pass; the rest (device buckets, other executors, optax
      # leaves) here.
      rest = [
        g for i, b in enumerate(buckets) if i not in pending for g in b[2]
      ]
      rest += [grads[i] for i in lay.fallback]
      norm = stv.global_norm(rest, [out.sumsq for out in pending.values()])
      finite = jnp.isfinite(norm)
      if skip_nonfinite:  # Double-buffered buckets kept their gradients.
        finite = stv.all_finite(
          norm, rest + [out.kept for out in pending.values()]
        )
      redo, skip, scale = stv.validate(norm, finite, clip_norm, skip_nonfinite)
      for i, out in pending.items():
        fixed = _validate_and_finish(zero)(
          buckets[i][1], (state.row, redo, skip, scale), out, buckets[i][2]
        )
        states[i], weights[i] = tuple(fixed[:3]), fixed[3]
      others = [i for i in range(len(buckets)) if i not in pending]
      if others:
        fixed_states, fixed_weights = _fix_if_needed(
          [buckets[i] for i in others],
          [(state.master[i], state.mu[i], state.nu[i]) for i in others],
          [states[i] for i in others],
          [weights[i] for i in others],
          redo,
          skip,
          scale,
          zero,
        )
        for i, s_, w_ in zip(others, fixed_states, fixed_weights, strict=True):
          states[i], weights[i] = s_, w_

    # Without STV the device-side updates would race the backward pass's
    # reads of the weights (STV's validation already orders them).
    token = None
    if params is not None and not use_stv and in_place.wanted(zero):
      token = in_place.token_after([s_[0] for s_ in states])
    out_leaves: list[Any] = [None] * len(grads)
    for (*_, leaf_ids), ws in zip(buckets, weights, strict=True):
      if zero is not None:  # All-gathered on the device, split into leaves.
        sizes = [int(np.prod(lay.shapes[i], dtype=np.int64)) for i in leaf_ids]
        ws = zero.gather(ws[0], sizes, count)
      for i, w in zip(leaf_ids, ws, strict=True):
        w = w.reshape(lay.shapes[i])
        if zero is not None:  # Back to the leaf's own (explicit) sharding.
          w = zero.match(w, grads[i])
        if params is not None:  # fp32 master split on device: cast here.
          w = w.astype(lay.dtypes[i])
        if token is not None:
          w = in_place.after(w, token)
        # Without params: the fp32 change of the master.
        u = w if params is None else _exact_delta(w, param_leaves[i])
        out_leaves[i] = u if skip is None else jnp.where(skip, 0.0, u)
    for i in range(len(grads)):  # Zero-size leaves no bucket holds.
      if out_leaves[i] is None and i not in lay.fallback:
        out_leaves[i] = jnp.zeros(lay.shapes[i], jnp.float32)

    fallback_state = state.fallback
    if lay.fallback:
      fb_params = (
        None if params is None else [param_leaves[i] for i in lay.fallback]
      )
      fb_grads = [grads[i] for i in lay.fallback]
      if use_stv:  # Serially here: these leaves take the optax path anyway.
        fb_grads = [
          stv.clip_serially(g, redo, norm, clip_norm) for g in fb_grads
        ]
      fb_updates, fallback_state = fallback_tx(lay).update(
        fb_grads,
        jax.tree.map(host_memory.to_device, state.fallback),
        fb_params,
      )
      fallback_state = jax.tree.map(_state_to_host, fallback_state)
      if skip is not None:
        fallback_state = jax.tree.map(
          lambda new, old: jnp.where(skip, old, new),
          fallback_state,
          state.fallback,
        )
        fb_updates = [jnp.where(skip, jnp.zeros_like(u), u) for u in fb_updates]
      for i, u in zip(lay.fallback, fb_updates, strict=True):
        out_leaves[i] = u

    new_count = optax.safe_increment(count)
    redone, skipped = state.redone, state.skipped
    if use_stv:
      new_count = jnp.where(skip, count, new_count)
      redone = redone + redo.astype(jnp.int32)
      skipped = skipped + skip.astype(jnp.int32)
    row = state.row
    if double_buffered:  # The written row is current, unless dropped.
      row = jnp.where(skip, row, 1 - row)
    new_state = SuperOffloadState(
      count=new_count,
      mu=tuple(s[1] for s in states),
      nu=tuple(s[2] for s in states),
      master=tuple(s[0] for s in states),
      fallback=fallback_state,
      redone=redone,
      skipped=skipped,
      row=row,
      kept_grads=tuple(kept) if double_buffered else None,
    )
    return jax.tree.unflatten(lay.treedef, out_leaves), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
