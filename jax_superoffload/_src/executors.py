"""The ways to run one bucket's Adam step on the leaves' own state arrays.

- "ffi": the Grace Adam kernel as XLA host compute, on the state where it
  lives (pinned host memory), updated in place.
- "xla_host": the same math in `jax.numpy`, also as host compute; the
  fallback where the kernel is not registered with the accelerator's PJRT
  plugin ("auto" picks "ffi" on a GPU only where that registration works).
- "device": the MaxText-style baseline: the state lives in host memory
  between steps but is copied to the accelerator, updated there and copied
  back.
- "resident" (internal): a device bucket, whose state lives on the device.

A bucket is only a schedule: one call over k leaves, each leaf with its own
master, mu and nu arrays shaped like its parameter.
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
from jax_superoffload._src import moments
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

  def fp32_weights(self, dtypes: Sequence[Any]) -> bool:
    """Whether the new weights are the new fp32 masters themselves."""
    return (
      self.want_delta
      or self.cast_on_device
      or all(jnp.dtype(d) == jnp.float32 for d in dtypes)
    )


class BucketOut(NamedTuple):
  """A bucket's new state (per leaf) and its new weights on the device."""

  master: list[jax.Array]
  mu: list[jax.Array]
  nu: list[jax.Array]
  # Per leaf: the new weights (fp32, or the parameter's dtype when the
  # kernel wrote low-precision copies), or the fp32 change of the master.
  weights: list[jax.Array]


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
  # the last step produced (as ReseedTolerance in adam_ffi.cc).
  tolerance = jnp.abs(jnp.asarray(learning_rate, jnp.float32)) * 0.0625
  close |= jnp.abs(param.astype(jnp.float32) - master) <= tolerance
  return jnp.where(close, master, param.astype(jnp.float32))


def _math_step(step: BucketStep, master, mu, nu, grads, dtypes, params):
  """The step in `jax.numpy` on whatever memory its inputs are in.

  Low-precision moments are decoded, the step taken in fp32 and the new
  moments stored rounded (bf16 to nearest even; 8-bit by `moments.py`'s
  codec), as the kernel does.
  """
  if params is not None:
    master = [
      reseed(m, p, step.learning_rate)
      for m, p in zip(master, params, strict=True)
    ]
  out = [
    adam_reference.adam_step_reference(
      m,
      g.astype(jnp.float32),
      _decoded(a, True),
      _decoded(v, False),
      **step.kwargs(),
    )
    for m, g, a, v in zip(master, grads, mu, nu, strict=True)
  ]
  new_master = [o[0] for o in out]
  weights = None
  if not step.fp32_weights(dtypes):
    weights = [m.astype(d) for m, d in zip(new_master, dtypes, strict=True)]
  new_mu = [_stored(o[1], a, True) for o, a in zip(out, mu, strict=True)]
  new_nu = [_stored(o[2], v, False) for o, v in zip(out, nu, strict=True)]
  return new_master, new_mu, new_nu, weights


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


def _kernel_step(step: BucketStep, master, mu, nu, grads, dtypes, params):
  """The step by the Grace Adam kernel (inside host compute)."""
  fp32 = step.fp32_weights(dtypes)
  if any(x.dtype != jnp.float32 for x in jax.tree.leaves((mu, nu))):
    return _lowp_kernel_step(step, master, mu, nu, grads, dtypes, params)
  m, a, v, w, _ = grace_adam.adam_step_segments(
    master,
    mu,
    nu,
    list(grads),
    None if fp32 else list(dtypes),
    params=params,
    **step.kwargs(),
  )
  return m, a, v, None if fp32 else w


def _lowp_kernel_step(step: BucketStep, master, mu, nu, grads, dtypes, params):
  """`_kernel_step` with bf16 or 8-bit blockwise moments."""
  fp32 = step.fp32_weights(dtypes)
  blockwise = isinstance(mu[0], moments.Blockwise)
  scales = None
  if blockwise:
    scales = ([x.scales for x in mu], [x.scales for x in nu])
    mu, nu = [x.codes for x in mu], [x.codes for x in nu]
  m, a, v, s, w, _ = grace_adam.adam_step_lowp_segments(
    list(master),
    list(mu),
    list(nu),
    scales,
    list(grads),
    None if fp32 else list(dtypes),
    params=params,
    **step.kwargs(),
  )
  if blockwise:
    a = [moments.Blockwise(c, x) for c, x in zip(a, s[0], strict=True)]
    v = [moments.Blockwise(c, x) for c, x in zip(v, s[1], strict=True)]
  return m, a, v, None if fp32 else w


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


def _delta_or_new(step: BucketStep, new_master, old_master):
  """Per leaf on the device: the new master, or its change (no params)."""
  new = [host_memory.to_device(m) for m in new_master]
  if not step.want_delta:
    return new
  old = [host_memory.to_device(m) for m in old_master]
  return [n - o for n, o in zip(new, old, strict=True)]


def step_bucket(
  executor: str,
  step: BucketStep,
  master: Sequence[jax.Array],
  mu: Sequence[jax.Array],
  nu: Sequence[jax.Array],
  grads: Sequence[jax.Array],
  dtypes: Sequence[Any],
  params: Sequence[jax.Array] | None,
) -> BucketOut:
  """One bucket's step.

  Args:
    executor: "ffi", "xla_host", "device" or "resident" (resolved).
    step: scalars and flags.
    master: the leaves' fp32 master weights (host memory).
    mu: their first moments (host memory).
    nu: their second moments (host memory).
    grads: the leaves' gradients (device memory), in order.
    dtypes: the dtype of each leaf's new weights.
    params: the parameters the step starts from (see `reseed`), or None.

  Returns:
    The new state (where it was) and the new weights on the device.
  """
  master, mu, nu = list(master), list(mu), list(nu)
  if executor in ('resident', 'device'):
    move = host_memory.to_device if executor == 'device' else (lambda x: x)
    on_device = [[move(x) for x in xs] for xs in (master, mu, nu)]
    m, a, v, w = _math_step(step, *on_device, grads, dtypes, params)
    if w is None:
      w = _delta_or_new(step, m, on_device[0])
    if executor == 'device':
      m, a, v = ([host_memory.to_host(x) for x in xs] for xs in (m, a, v))
    return BucketOut(m, a, v, w)
  kernel = _kernel_step if executor == 'ffi' else _math_step
  host_grads = [host_memory.to_host(g) for g in grads]
  host_params = None
  if params is not None:
    host_params = [host_memory.to_host(p) for p in params]
  m, a, v, w = _on_host_with_scalars(
    lambda bound, m, a, v, g, p: kernel(bound, m, a, v, g, dtypes, p),
    step,
    master,
    mu,
    nu,
    host_grads,
    host_params,
  )
  if w is None:
    w = _delta_or_new(step, m, master)
  else:
    w = [host_memory.to_device(x) for x in w]
  return BucketOut(m, a, v, w)


class Speculated(NamedTuple):
  """Double-buffered leaves after their speculative step (host memory)."""

  master: list[jax.Array]  # f32[2, *shape]: row `row` untouched.
  mu: list[jax.Array]
  nu: list[jax.Array]
  kept: list[jax.Array]  # The gradients the step read, as fp32.
  sumsq: jax.Array  # f32[1]: their sum of squares (scaled).
  weights: list[jax.Array] | None  # Per leaf; None for fp32 weights.


def speculate(
  step: BucketStep, row, master, mu, nu, kept, grads, dtypes, params
) -> Speculated:
  """STV's speculative "ffi" step on double-buffered leaves (see stv.py)."""
  fp32 = step.fp32_weights(dtypes)
  host_grads = [host_memory.to_host(g) for g in grads]
  host_params = None
  if params is not None:
    host_params = [host_memory.to_host(p) for p in params]

  def fn(bound, row, master, mu, nu, kept, grads, params):
    m, a, v, k, sumsq, weights = grace_adam.adam_step_speculative(
      master,
      mu,
      nu,
      kept,
      row,
      list(grads),
      None if fp32 else list(dtypes),
      params=params,
      **bound.kwargs(),
    )
    return Speculated(m, a, v, k, sumsq, None if fp32 else weights)

  return _on_host_with_scalars(
    fn,
    step,
    row,
    list(master),
    list(mu),
    list(nu),
    list(kept),
    host_grads,
    host_params,
  )


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

  m, a, v, w = _on_host_with_scalars(
    fn,
    step,
    out.master,
    out.mu,
    out.nu,
    out.kept,
    out.weights or [],
    (row, redo, skip, scale),
  )
  weights = w if out.weights is not None else None
  return out._replace(master=m, mu=a, nu=v, weights=weights)


def finish_pair(step: BucketStep, out: Speculated, row) -> BucketOut:
  """Double-buffered leaves' new weights on the device, per leaf.

  The new master is the row the speculative step wrote (after a skipped
  step the weights are discarded, so it does not matter which row).
  """
  state = (out.master, out.mu, out.nu)
  if out.weights is not None:
    return BucketOut(*state, [host_memory.to_device(w) for w in out.weights])
  row = jnp.asarray(row, jnp.int32)
  weights = []
  for pair in out.master:
    pair = host_memory.to_device(pair)
    new = jax.lax.dynamic_index_in_dim(pair, 1 - row, keepdims=False)
    if step.want_delta:
      new = new - jax.lax.dynamic_index_in_dim(pair, row, keepdims=False)
    weights.append(new)
  return BucketOut(*state, weights)
