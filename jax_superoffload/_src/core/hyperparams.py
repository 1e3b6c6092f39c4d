"""One Adam step's hyperparameters: the one form every step path takes.

`adam`/`adamw` turn their arguments (and schedules) into a `Hyperparams`
per step; executors, host compute, `shard_map` and the kernel wrappers all
take that object. The kernel's f32[9] scalars buffer is made from it at the
FFI boundary only (`packed`).

It is a pytree whose array fields are its leaves and whose Python numbers
are static: a Python float stays a Python float through host compute and
`shard_map`, so that `1 - b1` is taken in double precision and rounded
once, as optax's `(1 - decay) * g` does with a Python float decay.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_superoffload import _grace_adam

# Order of the scalars the FFI handlers read, declared once in C++
# (kPackedScalars, xla_ffi/adam_kernel.h).
PACKED_NAMES: tuple[str, ...] = tuple(_grace_adam.PACKED_SCALARS)
_FIELDS = (
  'count',
  'learning_rate',
  'b1',
  'b2',
  'eps',
  'eps_root',
  'weight_decay',
  'grad_scale',
)


def _static(x: Any) -> bool:
  return isinstance(x, (bool, int, float))


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Hyperparams:
  """The scalars of one Adam/AdamW step.

  Each scalar is a Python number or a scalar array (a schedule's value,
  `optax.inject_hyperparams`, a clipping scale). `count` is the number of
  steps taken before this one; `grad_scale` multiplies the gradients.
  """

  count: Any
  learning_rate: Any
  b1: Any = 0.9
  b2: Any = 0.999
  eps: Any = 1e-8
  eps_root: Any = 0.0
  weight_decay: Any = 0.0
  grad_scale: Any = 1.0
  nesterov: bool = False

  def replace(self, **changes: Any) -> Hyperparams:
    return dataclasses.replace(self, **changes)

  def tree_flatten(self):
    arrays = tuple(n for n in _FIELDS if not _static(getattr(self, n)))
    statics = tuple((n, getattr(self, n)) for n in _FIELDS if n not in arrays)
    children = tuple(getattr(self, n) for n in arrays)
    return children, (arrays, statics, bool(self.nesterov))

  @classmethod
  def tree_unflatten(cls, aux, children) -> Hyperparams:
    arrays, statics, nesterov = aux
    values = dict(statics)
    values.update(zip(arrays, children, strict=True))
    return cls(**values, nesterov=nesterov)

  def check(self) -> None:
    """Raises ValueError for a value out of range, where it is known.

    Callables (schedules) and traced values are not checked.
    """
    for name in _FIELDS:
      check_scalar(name, getattr(self, name))
    if jnp.issubdtype(jnp.result_type(self.count), jnp.inexact):
      raise TypeError(
        f'count must be an integer, got {jnp.result_type(self.count)}'
      )

  def scalar(self, name: str) -> Any:
    """One of PACKED_NAMES: a field, or 1 - b1 or 1 - b2 (see one_minus)."""
    if name.startswith('one_minus_'):
      return one_minus(getattr(self, name.removeprefix('one_minus_')))
    return getattr(self, name)

  def packed(self) -> jax.Array:
    """The f32[9] scalars buffer the kernel's handlers read."""
    return jnp.stack(
      [jnp.asarray(self.scalar(name), jnp.float32) for name in PACKED_NAMES]
    )


def concrete(x: Any) -> float | None:
  """The value of `x` if it is known at trace time, else None."""
  if isinstance(x, (bool, int, float, np.number)):
    return float(x)
  if isinstance(x, np.ndarray) and x.ndim == 0:
    return float(x)
  is_tracer = isinstance(x, jax.core.Tracer)
  if isinstance(x, jax.Array) and not is_tracer and x.ndim == 0:
    return float(x)
  return None


def check_scalar(name: str, x: Any) -> None:
  """Raises ValueError for a hyperparameter out of range (see `check`)."""
  if x is None or callable(x):
    return
  if np.ndim(x) != 0:
    raise ValueError(f'{name} must be a scalar, got shape {np.shape(x)}')
  value = concrete(x)
  if value is None:
    return
  if name in ('b1', 'b2') and not 0.0 <= value < 1.0:
    raise ValueError(f'{name} must be in [0, 1), got {value}')
  if name in ('learning_rate', 'eps', 'eps_root', 'count') and value < 0:
    raise ValueError(f'{name} must be non-negative, got {value}')
  if not np.isfinite(value):
    raise ValueError(f'{name} must be finite, got {value}')


def one_minus(b: Any) -> jax.typing.ArrayLike:
  """1 - b: from double precision for a Python number, else in fp32."""
  value = concrete(b)
  if value is not None and not isinstance(b, jax.Array):
    return 1.0 - value
  return 1 - jnp.asarray(b, jnp.float32)
