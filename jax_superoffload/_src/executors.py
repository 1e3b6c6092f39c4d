"""The three ways to run one bucket's Adam step.

- "ffi": the Grace Adam kernel as XLA host compute, on the state where it
  lives (pinned host memory), updated in place.
- "xla_host": the same math in `jax.numpy`, also as host compute; the
  fallback where the kernel is not registered with the accelerator's PJRT
  plugin ("auto" picks "ffi" on a GPU only where that registration works).
- "device": the MaxText-style baseline: the state lives in host memory
  between steps but is copied to the accelerator, updated there and copied
  back.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_superoffload._src import adam_reference
from jax_superoffload._src import grace_adam
from jax_superoffload._src import host_memory
from jax_superoffload._src import plugin_ffi

EXECUTORS = ('auto', 'ffi', 'xla_host', 'device')


def resolve(executor: str) -> str:
  """Validates an executor name and resolves "auto" for the backend."""
  if executor not in EXECUTORS:
    raise ValueError(f'executor must be one of {EXECUTORS}, got {executor!r}')
  if executor in ('xla_host', 'device') or jax.default_backend() == 'cpu':
    return 'ffi' if executor == 'auto' else executor
  # Elsewhere host compute is compiled inside the accelerator's PJRT plugin,
  # which finds the kernel only in its own registry (plugin_ffi.py).
  registration = plugin_ffi.host_registration()
  if executor == 'ffi' and not registration.ok:
    warnings.warn(
      f'executor="ffi": Grace Adam is not in the PJRT plugin\'s registry '
      f'({registration.reason}); XLA may not find it in host compute',
      stacklevel=2,
    )
  if executor == 'ffi' or registration.ok:
    return 'ffi'
  return 'xla_host'


@dataclasses.dataclass(frozen=True)
class BucketStep:
  """The per-step scalars and flags shared by every bucket of a group."""

  count: Any
  learning_rate: Any
  b1: Any
  b2: Any
  eps: Any
  eps_root: Any
  weight_decay: Any
  nesterov: bool
  want_delta: bool  # Return new - old master (when params are absent).
  grad_scale: Any = 1.0
  # Superchip-aware casting: True moves fp32 both ways and casts on the
  # device; False moves gradients as stored and low-precision weights.
  cast_on_device: bool = False
  want_sumsq: bool = False  # STV: the kernel also sums squared gradients.

  def kwargs(self) -> dict[str, Any]:
    return dict(
      count=self.count,
      learning_rate=self.learning_rate,
      b1=self.b1,
      b2=self.b2,
      eps=self.eps,
      eps_root=self.eps_root,
      weight_decay=self.weight_decay,
      nesterov=self.nesterov,
      grad_scale=self.grad_scale,
    )


def split_leaves(
  flat: jax.Array, sizes: Sequence[int], count: Any = None
) -> list[jax.Array]:
  """`flat` cut into one slice per leaf of the given sizes.

  With several leaves, each of odd length is cut with a dynamic slice whose
  offset XLA cannot fold to a constant (`min(count, 0)` is 0: the step count
  is never negative). XLA:CPU compiles a fusion that reads an odd-length
  slice at a constant offset into code about ten times slower than at a
  dynamic one (640 leaves of 104,857 elements: ~400 vs ~75 ms to write back
  64M weights on the CI machine; even lengths take ~40 ms at constant
  offsets, so they keep static slices).
  """
  dynamic = (
    count is not None
    and len(sizes) > 1
    and any(n % 2 for n in sizes)
    and jax.default_backend() == 'cpu'
  )
  zero = jnp.minimum(jnp.asarray(count, jnp.int32), 0) if dynamic else None
  out, start = [], 0
  for n in sizes:
    if dynamic and n % 2:
      out.append(jax.lax.dynamic_slice(flat, (start + zero,), (n,)))
    else:
      out.append(flat[start : start + n])
    start += n
  return out


def _split(
  flat: jax.Array, grads: Sequence[jax.Array], count: Any
) -> list[jax.Array]:
  """`split_leaves` by the sizes of a bucket's gradients."""
  return split_leaves(flat, [g.size for g in grads], count)


def _run(kernel: str, step: BucketStep, master, mu, nu, grads, dtypes):
  """The bucket's step on whichever memory its inputs are in.

  Returns the new state and the per-leaf new weights, or None in their place
  when the weights are the new fp32 master itself (fp32 parameters, or a
  delta to be taken against the old master), to be split on the device.
  """
  fp32 = (
    step.want_delta
    or step.cast_on_device
    or all(jnp.dtype(d) == jnp.float32 for d in dtypes)
  )
  if kernel == 'ffi':
    kwargs = step.kwargs()
    new_master, new_mu, new_nu, weights, sumsq = grace_adam.adam_step_segments(
      master,
      mu,
      nu,
      list(grads),
      None if fp32 else list(dtypes),
      compute_sumsq=step.want_sumsq,
      **kwargs,
    )
    return new_master, new_mu, new_nu, None if fp32 else weights, sumsq
  else:
    grad = (
      jnp.concatenate([g.astype(jnp.float32) for g in grads])
      if grads
      else jnp.zeros((0,), jnp.float32)
    )
    new_master, new_mu, new_nu = adam_reference.adam_step_reference(
      master, grad, mu, nu, **step.kwargs()
    )
    weights = [
      w.astype(d)
      for w, d in zip(
        _split(new_master, grads, step.count), dtypes, strict=True
      )
    ]
  return new_master, new_mu, new_nu, None if fp32 else weights


_SCALARS = (
  'count',
  'learning_rate',
  'b1',
  'b2',
  'eps',
  'eps_root',
  'weight_decay',
  'grad_scale',
)


def array_scalars(step: BucketStep) -> tuple[tuple[str, ...], tuple[Any, ...]]:
  """The step's scalars that are arrays, to pass into a traced region.

  Array scalars (a schedule's value, inject_hyperparams, a clipping scale)
  go into host compute or `shard_map` as arguments, never as closed-over
  tracers; Python floats stay Python floats so that 1 - b1 is rounded from
  double precision, as in optax.
  """
  names = tuple(
    n for n in _SCALARS if not isinstance(getattr(step, n), (int, float))
  )
  return names, tuple(jnp.asarray(getattr(step, n)) for n in names)


def bind(step: BucketStep, names: tuple[str, ...], values) -> BucketStep:
  """Inverse of `array_scalars` inside the traced region."""
  return dataclasses.replace(step, **dict(zip(names, values, strict=True)))


def _on_host_with_scalars(fn, step: BucketStep, *arrays):
  """Runs `fn(step, *arrays)` as host compute."""
  names, scalars = array_scalars(step)

  def host_fn(scalars, *arrays):
    return fn(bind(step, names, scalars), *arrays)

  return host_memory.on_host(host_fn, scalars, *arrays)


def step_bucket(
  executor: str,
  step: BucketStep,
  master: jax.Array,
  mu: jax.Array,
  nu: jax.Array,
  grads: Sequence[jax.Array],
  dtypes: Sequence[Any],
):
  """One bucket's step.

  Args:
    executor: "ffi", "xla_host" or "device" (already resolved).
    step: scalars and flags.
    master: the bucket's fp32 master weights (host memory).
    mu: its first moment (host memory).
    nu: its second moment (host memory).
    grads: the bucket's leaves' flat gradients (device memory), in order.
    dtypes: the dtype of each leaf's new weights.

  Returns:
    `(master, mu, nu)` in host memory and, per leaf, the new flat weights on
    the device (or, with `step.want_delta`, the fp32 change of the master).
  """
  if executor == 'resident':  # A device bucket: state and math on device.
    out = _run('reference', step, master, mu, nu, grads, dtypes)
    weights = out[3]
    if weights is None:
      weights = _device_weights(step, out[0], master, grads)
    return (*out[:3], weights)
  if executor == 'device':
    on_device = [host_memory.to_device(x) for x in (master, mu, nu)]
    out = _run('reference', step, *on_device, grads, dtypes)
    weights = out[3]
    if weights is None:
      weights = _device_weights(step, out[0], on_device[0], grads)
    return (*(host_memory.to_host(x) for x in out[:3]), weights)
  out, _ = host_step(executor, step, master, mu, nu, grads, dtypes)
  return finish(step, out, master, grads)


def host_step(executor, step: BucketStep, master, mu, nu, grads, dtypes):
  """The host-compute part of `step_bucket` ("ffi" or "xla_host").

  Returns the host-side results (state, and the weights copies or None) and
  the gradients as moved to the host; `finish` brings the weights over.
  """
  kernel = 'ffi' if executor == 'ffi' else 'reference'
  flat_grads = [host_memory.to_host(g) for g in grads]
  out = _on_host_with_scalars(
    lambda bound, *arrays: _run(kernel, bound, *arrays, dtypes),
    step,
    master,
    mu,
    nu,
    flat_grads,
  )
  return out, flat_grads


def finish(step: BucketStep, out, master, grads):
  """Moves a host step's new weights to the device, per leaf."""
  if out[3] is None:  # fp32: one transfer of the bucket, split on device.
    weights = _device_weights(
      step, host_memory.to_device(out[0]), master, grads
    )
    return (*out[:3], weights)
  return (*out[:3], [host_memory.to_device(w) for w in out[3]])


class Speculated(NamedTuple):
  """A double-buffered bucket after its speculative step (host memory)."""

  master: jax.Array  # Two rows each: row `row` untouched, the other new.
  mu: jax.Array
  nu: jax.Array
  kept: jax.Array  # The gradients the step read, as fp32.
  sumsq: jax.Array  # f32[1]: their sum of squares (scaled).
  weights: list[jax.Array] | None  # Per leaf; None for fp32 weights.


def speculate(
  step: BucketStep, row, master, mu, nu, kept, grads, dtypes
) -> Speculated:
  """STV's speculative "ffi" step on a double-buffered bucket (see stv.py)."""
  fp32 = (
    step.want_delta
    or step.cast_on_device
    or all(jnp.dtype(d) == jnp.float32 for d in dtypes)
  )
  flat_grads = [host_memory.to_host(g) for g in grads]

  def fn(bound, row, master, mu, nu, kept, grads):
    m, a, v, k, sumsq, weights = grace_adam.adam_step_speculative(
      master,
      mu,
      nu,
      kept,
      row,
      list(grads),
      None if fp32 else list(dtypes),
      **bound.kwargs(),
    )
    return Speculated(m, a, v, k, sumsq, None if fp32 else weights)

  return _on_host_with_scalars(fn, step, row, master, mu, nu, kept, flat_grads)


def validate_pair(step: BucketStep, out: Speculated, row, redo, skip, scale):
  """Redoes a clipped speculative step from its untouched row, in place."""

  def fn(bound, master, mu, nu, kept, weights, flags):
    row, redo, skip, scale = flags
    return grace_adam.adam_step_validated(
      master,
      mu,
      nu,
      kept,
      row,
      weights,
      redo=redo,
      skip=skip,
      redo_scale=scale,
      **bound.kwargs(),
    )

  fixed = _on_host_with_scalars(
    fn,
    step,
    out.master,
    out.mu,
    out.nu,
    out.kept,
    out.weights or [],
    (row, redo, skip, scale),
  )
  weights = fixed[3] if out.weights is not None else None
  return out._replace(
    master=fixed[0], mu=fixed[1], nu=fixed[2], weights=weights
  )


def finish_pair(step: BucketStep, out: Speculated, row, grads):
  """A double-buffered bucket's new weights on the device, per leaf.

  The new master is the row the speculative step wrote (after a skipped
  step the weights are discarded, so it does not matter which row). The
  pair is moved whole and cut on the device: on the CPU backend the move
  is free and the cut fuses into the consumer, which reads one row.
  """
  state = (out.master, out.mu, out.nu)
  if out.weights is not None:
    return (*state, [host_memory.to_device(w) for w in out.weights])
  pair = host_memory.to_device(out.master)
  n = pair.size // 2
  row = jnp.asarray(row, jnp.int32)
  new = jax.lax.dynamic_slice(pair, ((1 - row) * n,), (n,))
  weights = _split(new, grads, step.count)
  if step.want_delta:
    old = jax.lax.dynamic_slice(pair, (row * n,), (n,))
    old = _split(old, grads, step.count)
    weights = [a - b for a, b in zip(weights, old, strict=True)]
  return (*state, weights)


def _device_weights(step: BucketStep, new_master, old_master, grads):
  """Per-leaf fp32 weights (or changes of the master) from a whole bucket."""
  new = _split(new_master, grads, step.count)
  if not step.want_delta:
    return new
  old = _split(host_memory.to_device(old_master), grads, step.count)
  return [n - o for n, o in zip(new, old, strict=True)]
