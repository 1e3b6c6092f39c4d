"""The three ways to run one bucket's Adam step.

- "ffi": the Grace Adam kernel as XLA host compute, on the state where it
  lives (pinned host memory), updated in place.
- "xla_host": the same math in `jax.numpy`, also as host compute; the
  fallback where a CPU FFI call cannot run inside host compute (expected on
  pip-installed GPU jaxlib).
- "device": the MaxText-style baseline: the state lives in host memory
  between steps but is copied to the accelerator, updated there and copied
  back.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jax_superoffload._src import adam_reference, grace_adam, host_memory

EXECUTORS = ('auto', 'ffi', 'xla_host', 'device')


def resolve(executor: str) -> str:
  """Validates an executor name and resolves "auto" for the backend."""
  if executor not in EXECUTORS:
    raise ValueError(f'executor must be one of {EXECUTORS}, got {executor!r}')
  if executor != 'auto':
    return executor
  # A CPU FFI call inside host compute is expected to fail on pip GPU
  # jaxlib (JAX skips its own test of it there), so GPUs get "xla_host".
  return 'ffi' if jax.default_backend() == 'cpu' else 'xla_host'


@dataclasses.dataclass(frozen=True)
class BucketStep:
  """The per-step scalars and flags shared by every bucket of a group."""

  count: jax.Array
  learning_rate: Any
  b1: Any
  b2: Any
  eps: Any
  eps_root: Any
  weight_decay: Any
  nesterov: bool
  lowp_dtype: Any  # bf16/f16 for low-precision params, None for f32.
  want_delta: bool  # Also return new - old master (when params are absent).

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
      lowp_dtype=self.lowp_dtype,
    )


def _run(kernel, step: BucketStep, master, grad, mu, nu):
  out = kernel(master, grad, mu, nu, **step.kwargs())
  new_master, new_mu, new_nu = out[:3]
  weights = out[3] if step.lowp_dtype is not None else new_master
  if step.want_delta:
    weights = new_master - master
  return new_master, new_mu, new_nu, weights


def step_bucket(
  executor: str,
  step: BucketStep,
  master: jax.Array,
  grad: jax.Array,
  mu: jax.Array,
  nu: jax.Array,
):
  """One bucket's step.

  Args:
    executor: "ffi", "xla_host" or "device" (already resolved).
    step: scalars and flags.
    master: fp32 master weights (host memory).
    grad: fp32 gradient (device memory).
    mu: first moment (host memory).
    nu: second moment (host memory).

  Returns:
    `(master, mu, nu)` in host memory and the new weights on the device: in
    the parameters' dtype, or the fp32 change of the master if
    `step.want_delta`.
  """
  if executor == 'device':
    out = _run(
      adam_reference.adam_step_reference,
      step,
      *(host_memory.to_device(x) for x in (master, grad, mu, nu)),
    )
    return (*(host_memory.to_host(x) for x in out[:3]), out[3])
  kernel = (
    grace_adam.adam_step
    if executor == 'ffi'
    else adam_reference.adam_step_reference
  )
  # Array scalars (a schedule's value, inject_hyperparams) go in as
  # arguments, never as closed-over tracers; Python floats stay Python
  # floats so that 1 - b1 is rounded from double precision, as in optax.
  names = tuple(
    n
    for n in (
      'count',
      'learning_rate',
      'b1',
      'b2',
      'eps',
      'eps_root',
      'weight_decay',
    )
    if not isinstance(getattr(step, n), (int, float))
  )
  scalars = tuple(jnp.asarray(getattr(step, n)) for n in names)

  def host_fn(master, grad, mu, nu, scalars):
    bound = dataclasses.replace(step, **dict(zip(names, scalars, strict=True)))
    return _run(kernel, bound, master, grad, mu, nu)

  out = host_memory.on_host(
    host_fn, master, host_memory.to_host(grad), mu, nu, scalars
  )
  return (*out[:3], host_memory.to_device(out[3]))
