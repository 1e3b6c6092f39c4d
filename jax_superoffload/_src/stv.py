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
that pass). The spare row and the kept gradients are not in cache when the
kernel writes them, so it writes them with streaming stores (x86: a plain
store would first read every line, 16 B/param more); the step then moves
32 B/param against an in-place step's 28. Host memory: +12 B/param for the
spare row and +4 B/param for the kept gradients, which every step has (as
temporaries) and which STV needs until validation; keeping them in the
donated state means no step maps fresh memory for them (XLA:CPU page-faults
fresh temporaries in every step). Each shard's kept gradients carry
`KEPT_GRAD_PAD` elements more, so they can be placed with the spare row's
alignment. A redo costs one more kernel pass (the same 28 B/param as a
step).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_superoffload._src import host_memory

# Elements a kept-gradient buffer holds beyond its bucket (per shard): the
# kernel's kKeptGradPad (stv_kernel.h).
KEPT_GRAD_PAD = 16


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
  """The current master, mu and nu of every bucket."""

  master: tuple[jax.Array | np.ndarray, ...]
  mu: tuple[jax.Array | np.ndarray, ...]
  nu: tuple[jax.Array | np.ndarray, ...]


def two_rows(bucket: jax.Array, shards: int = 1) -> jax.Array:
  """A bucket doubled into two rows: [row 0 | row 1] on each of `shards`.

  With ZeRO the bucket is sharded along its one axis, so each shard's two
  rows are laid out together and the kernel sees them as its local pair.
  """
  local = bucket.reshape(shards, -1)
  return jnp.stack([local, local], axis=1).reshape(-1)


def current_row(pair: jax.Array, row: int) -> np.ndarray:
  """Row `row` of a concrete double-buffered bucket, as laid by two_rows."""
  local = pair.sharding.shard_shape(pair.shape)[0]
  shards = pair.shape[0] // local
  return np.asarray(pair).reshape(shards, 2, -1)[:, row].reshape(-1)
