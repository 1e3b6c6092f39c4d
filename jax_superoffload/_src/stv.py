"""Speculation-then-validation (STV) for clipping and non-finite steps.

Global-norm clipping and the NaN/Inf check need every gradient before a step
can be taken, which would make each bucket's host step wait for the whole
backward pass. Instead each bucket's step runs at once (speculatively, with
unscaled gradients); the gradients' global norm is computed on the device
alongside; and only when it says so is the step fixed:

- norm >= clip_norm (or not finite, without `skip_nonfinite`): every bucket
  is undone algebraically and redone with its gradients scaled by
  clip_norm / norm (the kernel's `grad_scale`), which is what
  `optax.clip_by_global_norm` followed by Adam computes;
- non-finite gradients with `skip_nonfinite`: every bucket is undone and
  the step dropped (parameters and state as before, count not advanced).
  The speculative step already left NaN/Inf elements untouched
  (`keep_nonfinite`), so the undo never has to invert a NaN.

Cost when nothing triggers: nothing but the global norm, which the kernel
takes in the same pass as the step (its gradients are in cache), and one
fix call per bucket that returns at once. Extra host memory: none beyond
the step's host gradient buffers (4 B/param for fp32 gradients, 2 for
bf16), which every step has and which STV keeps alive until validation;
the rare fix path works in place for the "ffi" executor (other executors
make transient copies of the undone state).

The undo is algebraic: in double precision in the kernel (`AdamUndoRange`)
and in fp32 for the other executors (`executors._undo`); its error is a
few ulps of each quantity's magnitude, tested in C++ and in Python, and the
whole path is checked against the serial recipe.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jax_superoffload._src import host_memory


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
    total = total + jnp.sum(jnp.real(g * jnp.conj(g))).astype(jnp.float32)
  return jnp.sqrt(total)


def validate(
  norm: jax.Array, clip_norm: float | None, skip_nonfinite: bool
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Returns (redo, skip, scale) for a step whose gradients have `norm`.

  `redo`: undo and redo with gradients times `scale`; `skip`: undo and drop
  the step. As in optax.clip_by_global_norm, gradients are left alone only
  when norm < clip_norm, so a NaN norm without `skip_nonfinite` redoes the
  step with a NaN scale, as the serial recipe would.
  """
  finite = jnp.isfinite(norm)
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
