"""One bucket's step: what it reads and writes, and the calls that take it.

An executor (executors.py) chooses how a bucket's step runs; the functions
here take it: in `jax.numpy` (`math_step`), by the Grace Adam kernel
(`kernel_step`), or, under STV on the kernel, speculatively on
double-buffered leaves and then validated (`speculate`, `validate_pair`,
`finish_pair`).
"""

from __future__ import annotations

import math
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_superoffload._src.core import backend
from jax_superoffload._src.core import host_memory
from jax_superoffload._src.core import moments
from jax_superoffload._src.core.hyperparams import Hyperparams
from jax_superoffload._src.host import adam_reference
from jax_superoffload._src.host import grace_adam


class LeafState(NamedTuple):
  """A bucket's state before its step, a list per field (one per leaf)."""

  master: list[jax.Array]
  mu: list[Any]  # Arrays, or moments.Blockwise for 8-bit moments.
  nu: list[Any]
  kept: list[jax.Array] | None = None  # Double-buffered leaves only.
  row: Any = None  # Double-buffered leaves: the current row.


class BucketOut(NamedTuple):
  """A bucket's new state (per leaf) and its new weights on the device."""

  master: list[jax.Array]
  mu: list[Any]
  nu: list[Any]
  # Per leaf: the new weights (fp32, or the parameter's dtype when the
  # kernel wrote low-precision copies), or the fp32 change of the master.
  weights: list[jax.Array] | None


class Bucket(NamedTuple):
  """One bucket of a step's schedule, with what its step reads."""

  index: int
  leaves: list[int]
  executor: Any  # The `executors.Executor` that steps it.
  hyper: Hyperparams
  grads: list[jax.Array]  # As the kernel reads them (ZeRO: this shard's).
  params: list[jax.Array] | None  # The step starts from them (`reseed`).
  dtypes: list[Any]  # Each leaf's parameter dtype.
  specs: list[Any] | None  # ZeRO: each leaf's partition spec.
  # ZeRO: the specs of each leaf's moments (8-bit: moments.Blockwise of the
  # codes' and the scales' specs); None without ZeRO.
  moment_specs: list[Any] | None
  want_delta: bool  # No params: return new - old master.
  fp32_weights: bool  # The new weights are the new fp32 masters.
  # A scalar after every gradient of the step, for the stream executor's
  # join on a GPU (`stream_place`); None elsewhere.
  barrier: jax.Array | None = None
  # The stream executor on a GPU: the staging bytes of the step's largest
  # bucket (`staging_bound`), which sizes its pinned staging slots at once;
  # 0 elsewhere.
  staging_bytes: int = 0
  # The stream executor: a bool scalar, true where `params` are the weights
  # the last step produced (weights_digest.py), so that its host step need
  # not read them; None elsewhere (they are read).
  unchanged: jax.Array | None = None


class Verdict(NamedTuple):
  """What STV's validation said of a step (stv.py), which `fix` reads."""

  redo: jax.Array  # Take the step again with gradients times `scale`.
  skip: jax.Array  # Drop the step.
  scale: jax.Array
  norm: jax.Array


def reseed(
  master: jax.Array, param: jax.Array, learning_rate: Any = 0.0
) -> jax.Array:
  """The master where it rounds to `param`, `param` where it does not.

  The parameters are the source of truth: a master that no longer rounds
  to them (weights loaded, surgery, an EMA swap) restarts from them.
  """
  if param.dtype == jnp.float32:
    # The master is not read, but it must stay an input of the step: a
    # pruned input is not donated, and the new master would then need a
    # fresh buffer every step (page faults on every page of it).
    return jax.lax.optimization_barrier((master, param))[1]

  # A 16-bit update cannot always land exactly on the rounded master (a
  # weight crossing zero, or more than halving): one unit in the last place
  # away is still the weight the last step produced.
  def ordered(x):  # Adjacent floats are adjacent integers.
    bits = jax.lax.bitcast_convert_type(x, jnp.int16).astype(jnp.int32)
    return jnp.where(bits < 0, -(bits & 0x7FFF), bits)

  close = jnp.abs(ordered(master.astype(param.dtype)) - ordered(param)) <= 1
  # Nor can it when the step is larger than the weight: within its own
  # rounding (lr / 16 covers steps up to 16 lr) the parameter is the one
  # the last step produced (as ReseedTolerance in ffi_support.h).
  tolerance = jnp.abs(jnp.asarray(learning_rate, jnp.float32)) * 0.0625
  close |= jnp.abs(param.astype(jnp.float32) - master) <= tolerance
  return jnp.where(close, master, param.astype(jnp.float32))


def math_step(hyper: Hyperparams, dtypes, master, mu, nu, grads, params):
  """The step in `jax.numpy` on whatever memory its inputs are in.

  Low-precision moments are decoded, the step taken in fp32 and the new
  moments stored rounded (bf16 to nearest even; 8-bit by `moments.py`'s
  codec), as the kernel does. `dtypes`: the new weights' dtypes, or None
  for fp32 weights (then `weights` is None).
  """
  if params is not None:
    master = [
      reseed(m, p, hyper.learning_rate)
      for m, p in zip(master, params, strict=True)
    ]
  out = [
    adam_reference.reference_step(
      hyper, m, g.astype(jnp.float32), _decoded(a, True), _decoded(v, False)
    )
    for m, g, a, v in zip(master, grads, mu, nu, strict=True)
  ]
  new_master = [o[0] for o in out]
  weights = None
  if dtypes is not None:
    weights = [m.astype(d) for m, d in zip(new_master, dtypes, strict=True)]
  return BucketOut(
    new_master,
    [_stored(o[1], a, True) for o, a in zip(out, mu, strict=True)],
    [_stored(o[2], v, False) for o, v in zip(out, nu, strict=True)],
    weights,
  )


def _decoded(moment, signed: bool) -> jax.Array:
  """A stored moment (fp32, bf16 or 8-bit blockwise) as fp32."""
  if isinstance(moment, moments.Blockwise):
    return moments.dequantize(moment, signed)
  return moment.astype(jnp.float32)


def _stored(new: jax.Array, old, signed: bool):
  """The new fp32 moment in `old`'s storage, rounded as the kernel does."""
  if isinstance(old, moments.Blockwise):
    return moments.quantize(new, signed)
  return new.astype(old.dtype)


def kernel_step(
  hyper: Hyperparams,
  dtypes,
  master,
  mu,
  nu,
  grads,
  params,
  skip=False,
  place: grace_adam.Place | None = None,
  unchanged=None,
):
  """The step by the Grace Adam kernel (in host compute, or `Stream`'s).

  `skip` (low-precision moments only): no step where it is true. `place`:
  see `grace_adam.Place`. `unchanged`: see `Bucket.unchanged`.
  """
  unchanged = False if unchanged is None else unchanged
  if all(x.dtype == jnp.float32 for x in jax.tree.leaves((mu, nu))):
    assert skip is False, 'fp32 moments are skipped by the paired kernel'
    m, a, v, w, _ = grace_adam.adam_step_segments(
      master,
      mu,
      nu,
      list(grads),
      dtypes,
      hyper,
      params=params,
      params_unchanged=unchanged,
      place=place,
    )
    # A joined call returns the new masters' device copies as its weights.
    return BucketOut(m, a, v, w or None)
  blockwise = isinstance(mu[0], moments.Blockwise)
  scales = None
  if blockwise:
    scales = ([x.scales for x in mu], [x.scales for x in nu])
    mu, nu = [x.codes for x in mu], [x.codes for x in nu]
  m, a, v, s, w, _ = grace_adam.adam_step_lowp_segments(
    master,
    mu,
    nu,
    scales,
    list(grads),
    dtypes,
    hyper,
    params=params,
    params_unchanged=unchanged,
    skip=skip,
    place=place,
  )
  if blockwise:
    a = [moments.Blockwise(c, x) for c, x in zip(a, s[0], strict=True)]
    v = [moments.Blockwise(c, x) for c, x in zip(v, s[1], strict=True)]
  return BucketOut(m, a, v, w or None)


def delta_or_new(b: Bucket, new_master, old_master) -> list[jax.Array]:
  """Per leaf on the device: the new master, or its change (no params)."""
  new = [host_memory.to_device(m) for m in new_master]
  if not b.want_delta:
    return new
  old = [host_memory.to_device(m) for m in old_master]
  return [n - o for n, o in zip(new, old, strict=True)]


def weight_dtypes(b: Bucket) -> list | None:
  """The dtypes the step writes the new weights in; None: fp32 masters."""
  return None if b.fp32_weights else list(b.dtypes)


def stream_weight_dtypes(b: Bucket, place: Any) -> list | None:
  """`weight_dtypes` for STV's speculative stream call.

  A joined call (a GPU) runs its step after it returns, so its new
  weights must reach the device through the join. The speculative step's
  new master is one row of a pair in host memory, so it writes copies
  (exact in fp32) instead.
  """
  if getattr(place, 'join', False):
    return joined_weight_dtypes(b)
  return weight_dtypes(b)


def joined_weight_dtypes(b: Bucket) -> list | None:
  """The dtypes of the weights copies a joined stream call of `b` writes.

  None where it writes none: its new weights are the new fp32 masters,
  read after the join. fp32 copies where the weights are fp32 and either
  the step is double-buffered (its new master is one row of a pair) or
  a joined start can write them over its gradients during the backward
  (`grace_adam.weights_fit_grads`), as it does 16-bit ones.
  """
  dtypes = weight_dtypes(b)
  if dtypes is not None:
    return dtypes
  fp32 = [jnp.float32] * len(b.leaves)
  if getattr(b.executor, 'paired', False):
    return fp32
  return fp32 if grace_adam.weights_fit_grads(b.grads, fp32) else None


def joined_weights(b: Bucket, weights: list, like: list, old) -> list:
  """A joined call's new weights, shaped `like`, as `update` wants.

  The join copied them to the device (flat). With `want_delta` (fp32
  weights), their change from `old()`, the master before the step (which
  XLA reads ahead of the in-place call, or a row the call does not write).
  """
  new = [w.reshape(x.shape) for w, x in zip(weights, like, strict=True)]
  if not b.want_delta:
    return new
  return [
    n - host_memory.to_device(o).reshape(n.shape)
    for n, o in zip(new, old(), strict=True)
  ]


def to_host_list(xs):
  return None if xs is None else [host_memory.to_host(x) for x in xs]


def scalars_to(place, xs: list) -> list:
  """Scalar (0-d) state leaves moved by `place`; the others as they are.

  Scalars live on the device between steps (see state.lives_on_host) and
  visit host memory for the host step.
  """
  return jax.tree.map(lambda x: place(x) if x.ndim == 0 else x, list(xs))


# Staging slots hold their buffers at this alignment (stream_context.h).
_STAGING_ALIGNMENT = 256
# Staged buffers a bucket call has besides its leaves': the count and the
# hyperparameters, flags, the sum of squares; all small.
_STAGED_SCALARS = 32


def _aligned(nbytes: int) -> int:
  return -(-nbytes // _STAGING_ALIGNMENT) * _STAGING_ALIGNMENT


def staging_bound(buckets: list[Bucket]) -> int:
  """An upper bound of the staging bytes of the largest of `buckets`.

  Per leaf, what a stream call stages from device memory: its gradient,
  its parameter (re-seed), a 0-d leaf's state and the weights copies it
  writes (`joined_weight_dtypes`); then the scalars. The state stays in
  host memory (its results alias it), but where the other results go is
  XLA's choice: XLA:GPU of jaxlib 0.12.0.1 keeps them in host memory
  beside the state, that of 0.12.1 in device memory, where the worker
  stages them (tests/test_gpu_compile.py checks the bound against the
  compiled calls of either). The stream executor's slots are sized to it
  at once, so no step after the first allocates staging whatever order
  the buckets come in (xla_ffi/stream_launch.h).
  """
  bound = 0
  for b in buckets:
    dtypes = joined_weight_dtypes(b)
    copies = None
    if dtypes is not None:
      copies = [
        jax.ShapeDtypeStruct(jnp.shape(g), d)
        for g, d in zip(b.grads, dtypes, strict=True)
      ]
    bound = max(bound, staged_bytes(b.grads, b.params, copies))
  return bound


def staged_bytes(
  grads: list, params: list | None, weights: list | None = None
) -> int:
  """What one stream call stages (see `staging_bound`).

  `grads`, `params` and `weights` (the weights copies the call writes)
  are arrays or anything with a shape and a dtype.
  """
  total = _STAGED_SCALARS * _STAGING_ALIGNMENT
  for x in (*grads, *(params or ()), *(weights or ())):
    total += _aligned(math.prod(jnp.shape(x)) * jnp.dtype(x.dtype).itemsize)
  for g in grads:
    if not jnp.shape(g):
      total += 3 * _STAGING_ALIGNMENT
  return total


def stream_place(
  barrier: jax.Array | None = None, staging_bytes: int = 0
) -> grace_adam.StreamPlace:
  """Where the stream-ordered handlers read their operands.

  Flat: a gradient that a dot left column-major would otherwise reach the
  handler in a layout it does not read; rank 1 has one layout. The handler
  copies it to host memory itself where XLA left it in device memory
  (XLA:GPU elides a move to host memory whose only user is a custom call).
  On a GPU each call is joined (`grace_adam.StreamPlace`) after `barrier`,
  a scalar that depends on every gradient of the step; without one, at
  once. On the CPU the handlers run the step before they return.
  """
  join = backend.target() == 'gpu'
  return grace_adam.StreamPlace(
    join=join,
    barrier=barrier if join else None,
    staging_bytes=staging_bytes if join else 0,
  )


def join_barrier(grads: list[jax.Array]) -> jax.Array:
  """An int32 scalar that exists only once every gradient does.

  One element of each is enough for the dependency; its value is never
  used (the join only passes it through), so NaN or Inf are harmless.
  Each element is taken apart (an optimization barrier keeps XLA from
  fusing them into one op over every gradient), so it can be read as soon
  as its gradient exists and keeps no gradient alive until the end.
  """
  firsts = [
    jax.lax.optimization_barrier(g.reshape(-1)[:1].astype(jnp.float32))
    for g in grads
    if g.size
  ]
  if not firsts:
    return jnp.zeros((), jnp.int32)
  total = jnp.sum(jnp.concatenate(firsts))
  return jax.lax.bitcast_convert_type(total, jnp.int32)


def weights_to_device(weights: list, like: list) -> list[jax.Array]:
  """New weights (host memory, maybe flat) on the device, shaped `like`."""
  return [
    host_memory.to_device(w).reshape(x.shape)
    for w, x in zip(weights, like, strict=True)
  ]


def spec_if(x, spec):
  """`spec` where `x` is given, None where it is not."""
  return spec if x is not None else None


class Speculated(NamedTuple):
  """Double-buffered leaves after their speculative step (host memory)."""

  master: list[jax.Array]  # f32[2, *shape]: row `row` untouched.
  mu: list[jax.Array]
  nu: list[jax.Array]
  kept: list[jax.Array]  # The gradients the step read, as fp32.
  sumsq: jax.Array  # f32[1]: their sum of squares (scaled).
  weights: list[jax.Array] | None  # Per leaf; None for fp32 weights.


def speculate(
  hyper, b: Bucket, row, master, mu, nu, kept, grads, params, stream=False
):
  """STV's speculative kernel step on double-buffered leaves (see stv.py)."""
  place = stream_place(b.barrier, b.staging_bytes) if stream else None
  dtypes = stream_weight_dtypes(b, place)

  def fn(hyper, row, master, mu, nu, kept, grads, params):
    m, a, v, k, sumsq, weights = grace_adam.adam_step_speculative(
      master,
      mu,
      nu,
      kept,
      row,
      list(grads),
      dtypes,
      hyper,
      params=params,
      params_unchanged=False if b.unchanged is None else b.unchanged,
      place=place,
    )
    # On the stream the weights are flat until finish_pair shapes them.
    return Speculated(m, a, v, k, sumsq, None if dtypes is None else weights)

  if stream:
    return fn(hyper, row, master, mu, nu, kept, grads, params)
  return host_memory.on_host(
    fn,
    hyper,
    row,
    master,
    mu,
    nu,
    kept,
    to_host_list(grads),
    to_host_list(params),
  )


def validate_pair(
  hyper, out: Speculated, row, redo, skip, scale, stream=False, staging=0
):
  """Redoes a clipped speculative step from its untouched row, in place."""
  place = stream_place(staging_bytes=staging) if stream else None

  def fn(hyper, master, mu, nu, kept, weights, flags):
    row, redo, skip, scale = flags
    return grace_adam.adam_step_validated(
      master,
      mu,
      nu,
      kept,
      row,
      weights,
      hyper,
      redo=redo,
      skip=skip,
      redo_scale=scale,
      place=place,
    )

  args = (
    hyper,
    out.master,
    out.mu,
    out.nu,
    out.kept,
    out.weights or [],
    (row, redo, skip, scale),
  )
  m, a, v, w = fn(*args) if stream else host_memory.on_host(fn, *args)
  weights = w if out.weights is not None else None
  return out._replace(master=m, mu=a, nu=v, weights=weights)


def finish_pair(b: Bucket, out: Speculated, row, joined: bool) -> BucketOut:
  """Double-buffered leaves' new weights on the device, per leaf.

  The new master is the row the speculative step wrote (after a skipped
  step the weights are discarded, so it does not matter which row).
  `joined`: a joined stream call's, whose join copied the weights to the
  device.
  """
  state = (out.master, out.mu, out.nu)
  row = jnp.asarray(row, jnp.int32)
  if out.weights is not None and joined:

    def current():
      return [
        jax.lax.dynamic_index_in_dim(host_memory.to_device(p), row, 0, False)
        for p in out.master
      ]

    return BucketOut(*state, joined_weights(b, out.weights, out.kept, current))
  if out.weights is not None:  # Shaped like the kept gradients' leaves.
    return BucketOut(
      *state,
      [
        host_memory.to_device(w).reshape(k.shape)
        for w, k in zip(out.weights, out.kept, strict=True)
      ],
    )
  weights = []
  for pair in out.master:
    pair = host_memory.to_device(pair)
    new = jax.lax.dynamic_index_in_dim(pair, 1 - row, keepdims=False)
    if b.want_delta:
      new = new - jax.lax.dynamic_index_in_dim(pair, row, keepdims=False)
    weights.append(new)
  return BucketOut(*state, weights)
