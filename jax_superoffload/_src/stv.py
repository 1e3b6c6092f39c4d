"""Speculation-then-validation (STV) for clipping and non-finite steps.

Global-norm clipping and the NaN/Inf check need every gradient before a step
can be taken, which would make each bucket's host step wait for the whole
backward pass. Instead each bucket's step runs at once (speculatively, with
unscaled gradients); the gradients' global norm is computed on the device
alongside; and only when it says so is the step fixed. The fix is exact:
the state before the step is never overwritten before validation, so a
clipped step is taken again from it, and the result is what
`optax.clip_by_global_norm` followed by Adam computes, with the same fp32
operations as a step taken without speculation.

- "ffi" executor: each host bucket's master, mu and nu hold two rows end to
  end (`SuperOffloadState.row` names the current one). The speculative
  kernel reads the current row and writes the other, in place (both rows
  alias the call's outputs), and keeps the gradients it read as fp32 in
  `SuperOffloadState.kept_grads`. After validation: accepted, the written
  row becomes current (nothing runs); clipped (norm >= clip_norm, or not
  finite without `skip_nonfinite`), the kernel steps again from the
  untouched row with `grad_scale = clip_norm / norm` over the written one;
  non-finite with `skip_nonfinite`, the current row stays current.
- Other executors and device buckets: the step writes new buffers anyway,
  so the old state is simply still alive at validation; the redo and the
  drop take it from there (`lax.cond`: nothing runs unless needed).

Cost when nothing triggers: the global norm, which the kernel takes in the
same pass as the step, and the kept gradients (4 B/param more written by
that pass). The spare row is not in cache when the kernel writes it, so it
writes it with streaming stores (x86: a plain store would first read every
line, 12 B/param more), and the kept gradients too where they share the
spare row's alignment (else plain stores, 4 B/param more); the step then
moves 32 to 36 B/param against an in-place step's 28. Host memory: +12
B/param for the spare row and +4 B/param for the kept gradients, which
every step has (as temporaries) and which STV needs until validation;
keeping them in the donated state means no step maps fresh memory for them
(XLA:CPU page-faults fresh temporaries in every step). A redo costs one
more kernel pass (the same 28 B/param as a step).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_superoffload._src import executors
from jax_superoffload._src import host_memory
from jax_superoffload._src import zero as zero_lib


def global_norm(
  grads: Sequence[jax.Array], partial_sums: Sequence[jax.Array] = ()
) -> jax.Array:
  """sqrt(sum of squares) of all gradients, as optax.tree.norm takes it.

  `partial_sums` are sums of squares already taken elsewhere (by the kernel,
  in its pass over a bucket, in host memory), one or, with ZeRO, one per
  shard.
  """
  total = jnp.zeros([], jnp.float32)
  for s in partial_sums:
    total = total + jnp.sum(host_memory.to_device(s))
  for g in grads:
    # Squared in at least fp32, as the kernel does: bf16 squares would put
    # an error of 2^-9 into the clipping factor.
    g = g.astype(jnp.promote_types(g.dtype, jnp.float32))
    total = total + jnp.sum(jnp.real(g * jnp.conj(g))).astype(jnp.float32)
  return jnp.sqrt(total)


def all_finite(norm: jax.Array, grads: Sequence[jax.Array]) -> jax.Array:
  """Whether `grads`, whose global norm is `norm`, hold no NaN and no Inf.

  The norm tells, except when it is +inf: finite gradients whose squares
  overflow fp32 (|g| from about 1.8e19, or a sum from 3.4e38) give that
  too, and such a step is clipped (to zero gradients, as optax does), not
  dropped. Only then are the gradients read (`lax.cond`), wherever they
  are (the kept host copies of double-buffered buckets included).
  """

  def look(grads):
    ok = jnp.ones([], bool)
    for g in grads:
      ok = jnp.logical_and(ok, jnp.all(jnp.isfinite(host_memory.to_device(g))))
    return ok

  return jax.lax.cond(
    jnp.isposinf(norm), look, lambda _: jnp.isfinite(norm), list(grads)
  )


def validate(
  norm: jax.Array,
  finite: jax.Array,
  clip_norm: float | None,
  skip_nonfinite: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Returns (redo, skip, scale) for a step whose gradients have `norm`.

  `finite`: whether the gradients are all finite (`all_finite`). `redo`:
  take the step again from the state before it, with gradients times
  `scale`; `skip`: keep the state before it and drop the step. As in
  optax.clip_by_global_norm, gradients are left alone only when
  norm < clip_norm, so a NaN norm without `skip_nonfinite` redoes the step
  with a NaN scale, as the serial recipe would.
  """
  skip = jnp.logical_and(skip_nonfinite, jnp.logical_not(finite))
  if clip_norm is None:
    redo = jnp.zeros([], bool)
    scale = jnp.ones([], jnp.float32)
  else:
    clipped = jnp.logical_not(norm < clip_norm)
    redo = jnp.logical_and(clipped, jnp.logical_not(skip))
    scale = jnp.where(redo, clip_norm / norm, 1.0).astype(jnp.float32)
  return redo, skip, scale


def clip_serially(g: jax.Array, redo, norm, clip_norm) -> jax.Array:
  """optax.clip_by_global_norm's formula, for leaves not on the kernel."""
  if clip_norm is None:
    return g
  clipped = (g / norm.astype(g.dtype)) * clip_norm
  return jnp.where(redo, clipped, g)


class HostState(NamedTuple):
  """The current master, mu and nu, trees like the parameters."""

  master: Any
  mu: Any
  nu: Any


def current_row(x: jax.Array, kept: jax.Array, row: jax.Array) -> jax.Array:
  """Row `row` of a double-buffered leaf; other leaves as they are.

  A double-buffered leaf has shape (2, *shape) and its kept gradients
  `shape`; the others keep zero-size gradients of another rank.
  """
  if np.ndim(x) != np.ndim(kept) + 1 or tuple(np.shape(x)[1:]) != tuple(
    np.shape(kept)
  ):
    return x
  return jax.lax.dynamic_index_in_dim(
    jnp.asarray(x), jnp.asarray(row, jnp.int32), keepdims=False
  )


class Verdict(NamedTuple):
  """What validation said of a step."""

  redo: jax.Array  # Take the step again with gradients times `scale`.
  skip: jax.Array  # Drop the step.
  scale: jax.Array
  norm: jax.Array


def speculate_bucket(opts, b, row, master, mu, nu, kept):
  """A double-buffered bucket's speculative step (per shard under ZeRO)."""

  def fn(step, row, master, mu, nu, kept, grads, params):
    return executors.speculate(
      step, row, master, mu, nu, kept, grads, b.dtypes, params
    )

  specs = b.specs
  pairs = None if specs is None else [zero_lib.pair_spec(s) for s in specs]
  fp32 = b.step.fp32_weights(b.dtypes)
  wrapped = zero_lib.per_shard(
    opts.zero,
    fn,
    in_specs=(
      pairs,
      pairs,
      pairs,
      specs,
      specs,
      specs if b.params is not None else None,
    ),
    out_specs=executors.Speculated(
      pairs,
      pairs,
      pairs,
      specs,
      zero_lib.per_shard_scalar(opts.zero),
      None if fp32 else specs,
    ),
  )
  return wrapped(b.step, row, master, mu, nu, kept, b.grads, b.params)


def validate_buckets(opts, inputs, buckets, results, state, bucket_step):
  """STV's validation of every bucket's speculative step, and its fix.

  Returns the verdict and the buckets' results after the fix: the
  double-buffered buckets redone in place by the kernel when needed, the
  others redone from (or reset to) their state before the step.
  """
  paired = [b for b in buckets if b.paired]
  others = [b for b in buckets if not b.paired]
  # Double-buffered buckets summed their squared gradients in the kernel's
  # pass (not under ZeRO, where a replicated leaf is summed by every
  # shard); the rest here.
  summed = paired if opts.zero is None else []
  summed_ids = {b.index for b in summed}
  rest = [g for b in buckets if b.index not in summed_ids for g in b.grads]
  rest += [inputs.grads[i] for i in inputs.plan.lay.fallback]
  norm = global_norm(rest, [results[b.index].sumsq for b in summed])
  finite = jnp.isfinite(norm)
  if opts.skip_nonfinite:  # Double-buffered buckets kept their gradients.
    kept = [k for b in summed for k in results[b.index].kept]
    finite = all_finite(norm, rest + kept)
  redo, skip, scale = validate(
    norm, finite, opts.clip_norm, opts.skip_nonfinite
  )
  verdict = Verdict(redo, skip, scale, norm)
  results = dict(results)
  for b in paired:
    results[b.index] = _finish_pair(
      opts, b, state.row, verdict, results[b.index]
    )
  if others:
    st = inputs.state
    originals = {
      b.index: tuple(
        [st[n][i] for i in b.leaves] for n in ('master', 'mu', 'nu')
      )
      for b in others
    }
    fixed = _fix_if_needed(
      opts,
      others,
      originals,
      {b.index: results[b.index] for b in others},
      verdict,
      bucket_step,
    )
    results.update(fixed)
  return verdict, results


def _finish_pair(opts, b, row, verdict, out):
  """A double-buffered bucket's redo if needed, then its new weights."""

  def fn(step, flags, out):
    row, redo, skip, scale = flags
    fixed = executors.validate_pair(step, out, row, redo, skip, scale)
    return executors.finish_pair(step, fixed, row)

  specs = b.specs
  pairs = None if specs is None else [zero_lib.pair_spec(s) for s in specs]
  in_spec = executors.Speculated(
    pairs,
    pairs,
    pairs,
    specs,
    zero_lib.per_shard_scalar(opts.zero),
    None if out.weights is None else specs,
  )
  wrapped = zero_lib.per_shard(
    opts.zero,
    fn,
    in_specs=(in_spec,),
    out_specs=executors.BucketOut(pairs, pairs, pairs, specs),
  )
  flags = (row, verdict.redo, verdict.skip, verdict.scale)
  return wrapped(b.step, flags, out)


def _fix_if_needed(opts, buckets, originals, results, verdict, bucket_step):
  """Redoes the steps from their original state if validation failed.

  For buckets whose step wrote new buffers (every executor but "ffi"),
  the state before the step is still there: a clipped step is taken again
  from it with the gradients scaled (the kernel's `grad_scale`), exactly
  as without speculation; a dropped step keeps it. Runs only when needed
  (`lax.cond`), so a step that validates pays nothing.
  """

  def keep(results):
    return results

  def fix(results):
    def redo_all(_):
      return {
        b.index: bucket_step(
          opts, b, *originals[b.index], grad_scale=verdict.scale
        )
        for b in buckets
      }

    def drop(_):  # The weights do not matter: updates become 0.
      return {
        b.index: results[b.index]._replace(
          master=list(originals[b.index][0]),
          mu=list(originals[b.index][1]),
          nu=list(originals[b.index][2]),
        )
        for b in buckets
      }

    return jax.lax.cond(verdict.redo, redo_all, drop, None)

  return jax.lax.cond(
    jnp.logical_or(verdict.redo, verdict.skip), fix, keep, results
  )
