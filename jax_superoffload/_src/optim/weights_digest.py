"""Whether `update`'s parameters are the weights the last step produced.

The `stream` executor's host step starts from the parameters where the
master no longer rounds to them (the parameters are the source of truth),
so each step would copy every parameter to the host (2 GB at 1B in bf16)
for a comparison that, in a plain training loop, changes nothing. Here
the comparison runs on the device, in XLA: each step keeps in the state
a digest of the weights its master rounds to, and the next step compares
it with the same digest of the parameters it is given. The digest kept is
of `optax.apply_updates(params, updates)`, what the caller will pass, and
only where those parameters would re-seed nothing from the new master
(no element `far`). Equal, the step is told that the parameters are
unchanged and does not read them (the re-seed would keep the master as
it is, bit for bit); unequal (weights loaded, an EMA swap, a user's own
update rule), it copies and re-seeds as before.

A digest is two 32-bit sums over the elements of some leaves, laid end to
end, of `fmix32(bits(x_i) ^ key(i))` with two keys: fmix32,
MurmurHash3's finalizer, is a bijection of 32-bit words, so a change of
any one element changes both sums, and other changes leave both equal with
a probability of about 2^-64. The sums are modular, so the order in which
XLA adds them does not matter. The leaves of a few consecutive buckets
share a digest (`groups`). The state keeps one row per parameter leaf (a
shape that does not depend on the buckets), a group's digest in its first
leaf's row. A row of zeros stands for no digest (a state made without
one, a leaf that is no group's first, a step after which the
caller's parameters would re-seed the master): it matches no parameters
but with a probability of about 2^-64, as changed ones do; so does a
digest kept for other buckets (a run resumed with another `bucket_bytes`).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax

from jax_superoffload._src.core import host_memory

COLUMNS = 2  # The two sums.
# The dtypes of the leaves the kernel steps from their parameters.
DTYPES = (
  jnp.dtype(jnp.float32),
  jnp.dtype(jnp.bfloat16),
  jnp.dtype(jnp.float16),
)


def _fmix32(h: jax.Array) -> jax.Array:
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _words(x: jax.Array) -> jax.Array:
  """The bits of each element of `x` (f32, bf16 or f16), as uint32[n]."""
  x = jnp.asarray(x).reshape(-1)
  if x.dtype.itemsize == 4:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  return jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)


def of_group(xs: Sequence[jax.Array]) -> jax.Array:
  """The digest of leaves `xs` laid end to end: uint32[2]."""
  words = [_words(x) for x in xs]
  words = words[0] if len(words) == 1 else jnp.concatenate(words)
  index = jax.lax.iota(jnp.uint32, words.size)
  sums = [
    jnp.sum(_fmix32(words ^ (index * jnp.uint32(mul) + add)), dtype=jnp.uint32)
    for mul, add in ((0x9E3779B9, 0x7F4A7C15), (0x85EBCA77, 0x165667B1))
  ]
  return jnp.stack(sums)


def covers(x) -> bool:
  """Whether a leaf is digested: a non-empty f32, bf16 or f16 array.

  In device memory: parameters in host memory (weight flow) are read
  where they are, in place, so there is no copy to spare, and a digest
  would move them to the device.
  """
  dtype = getattr(x, 'dtype', None)
  if dtype is None or jnp.dtype(dtype) not in DTYPES or x.size == 0:
    return False
  return host_memory.typed_on_device(x)


def invalid(num_leaves: int) -> jax.Array:
  """uint32[num_leaves, 2] zeros: matching no parameters (but about 2^-64)."""
  return jnp.zeros((num_leaves, COLUMNS), jnp.uint32)


# Leaves per digest at most: XLA fuses the leaves' concatenation into the
# digest's reduction (no copy of them), for a bounded number of operands.
GROUP_LEAVES = 32


def groups(buckets: Sequence[Sequence[int]]) -> list[list[int]]:
  """The digested groups of a step's buckets (leaf ids, in bucket order).

  Consecutive whole buckets, up to GROUP_LEAVES leaves (or one bucket of
  more): one digest per group, kept in its first leaf's row. Few, since
  XLA:GPU's compile time grows with the number of reductions (each a
  kernel it configures), and a step holds two digests per group.
  """
  out: list[list[int]] = []
  for ids in buckets:
    if out and len(out[-1]) + len(ids) <= GROUP_LEAVES:
      out[-1] = out[-1] + list(ids)
    else:
      out.append(list(ids))
  return [g for g in out if g]


def unchanged(
  stored: jax.Array, params: Sequence[jax.Array], ids: Sequence[int]
) -> jax.Array:
  """Whether leaves `ids` (a group), given `params`, have their digest."""
  if not all(covers(p) for p in params):
    return jnp.bool_(False)
  return jnp.all(stored[ids[0]] == of_group(params))


def bucket_flags(
  stored: jax.Array, params: Sequence[jax.Array], buckets: Sequence
) -> list[jax.Array]:
  """Per bucket (leaf ids): whether its group's parameters are unchanged."""
  flags = []
  for group in groups(buckets):
    flag = unchanged(stored, [params[i] for i in group], group)
    members = set(group)
    flags += [flag for ids in buckets if ids and ids[0] in members]
  return flags


def _patterns(x: jax.Array) -> jax.Array:
  """A 16-bit float's bit pattern, as int32."""
  return jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.int32)


def _ordered(x: jax.Array) -> jax.Array:
  """16-bit floats as integers in their order (adjacent floats adjacent)."""
  bits = _patterns(x)
  magnitude = bits & 0x7FFF
  return jnp.where(bits >= 0x8000, -magnitude, magnitude)


# A bound on half a unit in the last place of a 16-bit weight w, relative
# to |w|, and for the subnormals of both (2^-24 covers f16's and bf16's).
_HALF_ULP = {jnp.dtype(jnp.bfloat16): 2.0**-8, jnp.dtype(jnp.float16): 2.0**-11}
_HALF_ULP_SUBNORMAL = 2.0**-24


def far(
  weights: jax.Array, given: jax.Array, tolerance: jax.Array | float
) -> jax.Array:
  """Where parameters `given` would re-seed a master of `weights` (bool).

  `weights`: what the master rounds to (to nearest even); `tolerance`:
  the re-seed's of the step that will read `given` (ReseedTolerance), 0
  where it is not known. The host step keeps an fp32 parameter's master
  only where it is that master, bit for bit, and a 16-bit one's where the
  parameter is one unit in the last place from its rounding (raw patterns
  for bf16, ReseedBf16Loop; ordered values for f16, ReseedRange) or within
  `tolerance` of it. The master is not on the device: it is within half a
  unit of `weights`, a bound taken whole, with a margin for fp32's
  rounding of it, so that False is sure and True may only cost a copy.
  """
  if given.dtype == jnp.float32:
    return jax.lax.bitcast_convert_type(
      weights, jnp.uint32
    ) != jax.lax.bitcast_convert_type(given, jnp.uint32)
  if given.dtype == jnp.bfloat16:
    adjacent = jnp.abs(_patterns(weights) - _patterns(given)) <= 1
  else:
    adjacent = jnp.abs(_ordered(weights) - _ordered(given)) <= 1
  w, x = weights.astype(jnp.float32), given.astype(jnp.float32)
  bound = jnp.abs(x - w) + jnp.abs(w) * _HALF_ULP[given.dtype]
  bound = bound + _HALF_ULP_SUBNORMAL
  near = bound <= jnp.asarray(tolerance, jnp.float32) * 0.999
  return jnp.logical_not(adjacent | near)


def reseed_tolerance(learning_rate: jax.typing.ArrayLike) -> jax.Array:
  """The re-seed's tolerance at `learning_rate` (ReseedTolerance)."""
  return jnp.abs(jnp.asarray(learning_rate, jnp.float32)) * jnp.float32(0.0625)


def after_step(
  num_leaves: int,
  digested: Sequence[tuple[Sequence[int], Sequence, Sequence]],
  valid: jax.Array | bool = True,
  tolerance: jax.Array | float = 0.0,
) -> jax.Array:
  """The digest a step leaves, uint32[num_leaves, 2].

  `digested`: per group (`groups`), its leaf ids, the weights their new
  masters round to and the parameters the caller will pass next, both in
  the parameters' dtypes. The caller's parameters are
  `optax.apply_updates(params, updates)`; the group's row (that of its
  first leaf) is their digest, valid where they re-seed nothing (no
  element `far`, with the next step's re-seed `tolerance`) and `valid`
  (false, a scalar traced or not: a dropped step, whose master need not
  round to them). The other rows are zeros: a group's other leaves, and
  leaves whose master changed some other way (optax's path,
  `overlap_scan`'s rows), or not at all.
  """
  rows = [jnp.zeros((COLUMNS,), jnp.uint32)] * num_leaves
  for ids, weights, given in digested:
    if not ids or not all(covers(x) for x in given):
      continue
    # A reduction of its own: folded into the digest's, XLA:GPU took 15 s
    # more to compile the 1B step.
    fars = [
      far(w, x, tolerance).reshape(-1)
      for w, x in zip(weights, given, strict=True)
    ]
    lands = jnp.logical_not(jnp.any(jnp.concatenate(fars)))
    ok = jnp.logical_and(valid, lands)
    rows[ids[0]] = jnp.where(ok, of_group(given), rows[ids[0]])
  if not rows:
    return invalid(0)
  return jnp.stack(rows)


def checked(opts, state, num_leaves: int) -> jax.Array | None:
  """The state's `weights_digest` where `update` uses it, checked.

  A state without one (older checkpoints, other executors) reads the
  parameters every step; so does a step under ZeRO.
  """
  digest = state.weights_digest
  if digest is None or not opts.digests_weights:
    return None
  want = (num_leaves, COLUMNS)
  if tuple(digest.shape) != want or digest.dtype != jnp.uint32:
    raise ValueError(
      f'optimizer state weights_digest is {digest.dtype}{list(digest.shape)},'
      f' the parameters need uint32{list(want)} (build the state with this '
      "transformation's init)"
    )
  return digest


def after_update(opts, state, digest, digested_groups, step, verdict):
  """The `weights_digest` after `update`'s step (a state that has one).

  `digested_groups`: the groups of leaf ids the next step compares (those
  of the buckets, `groups`, and of `overlap_scan`'s stacks); `step`: the
  parameters given (by leaf, or None), the weights the new masters round
  to (by leaf, where the step made them) and the updates. Unused this
  step (`digest` None: ZeRO) or without parameters, it matches nothing.
  """
  params, produced, updates = step
  if digest is None or params is None:
    return jnp.zeros_like(state.weights_digest)
  kept = True if verdict is None else jnp.logical_not(verdict.skip)
  digested = []
  for ids in digested_groups:
    if not all(i in produced and covers(params[i]) for i in ids):
      continue  # Its row stays zero: the next step reads them.
    weights = [produced[i] for i in ids]
    # The parameters the caller passes next: optax.apply_updates's.
    given = [
      (params[i] + updates[i]).astype(w.dtype)
      for i, w in zip(ids, weights, strict=True)
    ]
    digested.append((ids, weights, given))
  tolerance = _next_tolerance(opts, state.count)
  return after_step(digest.shape[0], digested, kept, tolerance)


def _next_tolerance(opts, count) -> jax.Array | float:
  """The re-seed tolerance of the next step, where it is known.

  From a learning rate that is a Python number or a schedule (at the next
  count). An array may be another at the next step (the value of
  `optax.inject_hyperparams`' schedule): 0, and a parameter that did not
  land within one unit of its weight is then read.
  """
  lr = opts.learning_rate
  if callable(lr):
    lr = lr(optax.safe_increment(count))
  elif not isinstance(lr, (int, float)):
    return 0.0
  return reseed_tolerance(lr)
