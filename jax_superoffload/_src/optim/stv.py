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
- "ffi" with bf16 or 8-bit moments (`executors.AfterVerdict`): no second
  row, so no speculation: the kernel steps once the verdict is known, with
  the gradients scaled when clipped, and not at all when dropped.
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
import optax

from jax_superoffload._src.core import host_memory
from jax_superoffload._src.host import executors


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


def verdict_of(
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


def clip_serially(grads: list, verdict, clip_norm) -> list:
  """optax.clip_by_global_norm's formula, for leaves not on the kernel."""
  if verdict is None or clip_norm is None:
    return grads

  def clip(g):
    clipped = (g / verdict.norm.astype(g.dtype)) * clip_norm
    return jnp.where(verdict.redo, clipped, g)

  return [clip(g) for g in grads]


def drop_if_skipped(verdict, update: jax.Array) -> jax.Array:
  """Zero where validation dropped the step, `update` otherwise."""
  if verdict is None:
    return update
  return jnp.where(verdict.skip, jnp.zeros_like(update), update)


def keep_if_skipped(verdict, old: dict, new: dict) -> dict:
  """Per field of lists: `old` where the step was dropped, else `new`."""
  if verdict is None:
    return new
  return {
    n: [jnp.where(verdict.skip, o, x) for o, x in zip(old[n], xs, strict=True)]
    for n, xs in new.items()
  }


def counters(state, verdict) -> tuple:
  """The state's count, redone, skipped and row after the step."""
  count = optax.safe_increment(state.count)
  if verdict is None:
    return count, state.redone, state.skipped, state.row
  row = state.row
  if row is not None:  # The written row is current, unless dropped.
    row = jnp.where(verdict.skip, row, 1 - row)
  return (
    jnp.where(verdict.skip, state.count, count),
    state.redone + verdict.redo.astype(jnp.int32),
    state.skipped + verdict.skip.astype(jnp.int32),
    row,
  )


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


def validate_buckets(opts, inputs, buckets, before, results):
  """STV's validation of every bucket's speculative step, and its fix.

  `before`: each bucket's state before the step (`executors.LeafState`).
  Returns the verdict; the buckets' results after their executors' fix (a
  double-buffered bucket redone in place by the kernel when needed, the
  others redone from, or reset to, their state before the step); and the
  gradients the double-buffered buckets kept, on the device where scalar.
  """
  paired = [b for b in buckets if b.executor.paired]
  kept = {
    b.index: executors.scalars_to(host_memory.to_device, results[b.index].kept)
    for b in paired
  }
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
    held = [k for b in summed for k in results[b.index].kept]
    finite = all_finite(norm, rest + held)
  redo, skip, scale = verdict_of(
    norm, finite, opts.clip_norm, opts.skip_nonfinite
  )
  verdict = executors.Verdict(redo, skip, scale, norm)
  fixed = {
    b.index: b.executor.fix(
      opts.zero, b, before[b.index], results[b.index], verdict
    )
    for b in buckets
  }
  return verdict, fixed, kept
