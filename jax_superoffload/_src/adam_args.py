"""Argument checks and scalar packing shared by the Adam step paths."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

# Gradient dtypes the kernel reads natively.
KERNEL_GRAD_DTYPES = (
  np.dtype(np.float32),
  np.dtype(jnp.bfloat16),
  np.dtype(np.float16),
)
# Dtypes of the optional low-precision copy of the new weights.
LOWP_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(np.float16))

# Order of the scalars the FFI handler reads (see xla_ffi/adam_ffi.cc).
SCALAR_NAMES = (
  'learning_rate',
  'b1',
  'one_minus_b1',
  'b2',
  'one_minus_b2',
  'eps',
  'eps_root',
  'weight_decay',
  'grad_scale',
)


def _concrete(x) -> float | None:
  """The value of `x` if it is known at trace time, else None."""
  if isinstance(x, (bool, int, float, np.number)):
    return float(x)
  if isinstance(x, np.ndarray) and x.ndim == 0:
    return float(x)
  is_tracer = isinstance(x, jax.core.Tracer)
  if isinstance(x, jax.Array) and not is_tracer and x.ndim == 0:
    return float(x)
  return None


def _require_scalar(name: str, x) -> None:
  if np.ndim(x) != 0:
    raise ValueError(f'{name} must be a scalar, got shape {np.shape(x)}')


def check_hyperparameters(
  *,
  learning_rate=None,
  b1=None,
  b2=None,
  eps=None,
  eps_root=None,
  weight_decay=None,
  grad_scale=None,
  count=None,
) -> None:
  """Raises ValueError for out-of-range hyperparameters known at trace time."""
  values = {
    'learning_rate': learning_rate,
    'b1': b1,
    'b2': b2,
    'eps': eps,
    'eps_root': eps_root,
    'weight_decay': weight_decay,
    'grad_scale': grad_scale,
    'count': count,
  }
  for name, x in values.items():
    if x is None or callable(x):
      continue
    _require_scalar(name, x)
    value = _concrete(x)
    if value is None:
      continue
    if name in ('b1', 'b2') and not 0.0 <= value < 1.0:
      raise ValueError(f'{name} must be in [0, 1), got {value}')
    if name in ('learning_rate', 'eps', 'eps_root', 'count') and value < 0:
      raise ValueError(f'{name} must be non-negative, got {value}')
    if not np.isfinite(value):
      raise ValueError(f'{name} must be finite, got {value}')


def validate(
  master,
  grad,
  mu,
  nu,
  *,
  count,
  learning_rate,
  b1,
  b2,
  eps,
  eps_root,
  weight_decay,
  grad_scale,
  lowp_dtype,
  master_dtypes: Sequence[np.dtype],
) -> np.dtype | None:
  """Checks an Adam step's arguments; returns the low-precision dtype."""
  arrays = {'master': master, 'grad': grad, 'mu': mu, 'nu': nu}
  for name, x in arrays.items():
    if not hasattr(x, 'shape') or not hasattr(x, 'dtype'):
      raise TypeError(f'{name} must be an array, got {type(x).__name__}')
  for name in ('grad', 'mu', 'nu'):
    if tuple(arrays[name].shape) != tuple(master.shape):
      raise ValueError(
        f'{name} has shape {tuple(arrays[name].shape)} but master has shape '
        f'{tuple(master.shape)}'
      )
  if np.dtype(master.dtype) not in master_dtypes:
    allowed = ', '.join(str(d) for d in master_dtypes)
    raise TypeError(f'master must be {allowed}, got {master.dtype}')
  for name in ('mu', 'nu'):
    if np.dtype(arrays[name].dtype) != np.dtype(master.dtype):
      raise TypeError(
        f'{name} must have the master dtype {master.dtype}, got '
        f'{arrays[name].dtype}'
      )
  if (
    np.dtype(master.dtype) == np.float32
    and np.dtype(grad.dtype) not in KERNEL_GRAD_DTYPES
  ):
    raise TypeError(
      f'grad must be float32, bfloat16 or float16, got {grad.dtype}'
    )
  if not jnp.issubdtype(grad.dtype, jnp.inexact):
    raise TypeError(f'grad must be floating point, got {grad.dtype}')
  lowp = None
  if lowp_dtype is not None:
    lowp = np.dtype(lowp_dtype)
    if lowp not in LOWP_DTYPES:
      raise TypeError(f'lowp_dtype must be bfloat16 or float16, got {lowp}')
  check_hyperparameters(
    learning_rate=learning_rate,
    b1=b1,
    b2=b2,
    eps=eps,
    eps_root=eps_root,
    weight_decay=weight_decay,
    grad_scale=grad_scale,
    count=count,
  )
  if jnp.issubdtype(jnp.result_type(count), jnp.inexact):
    raise TypeError(f'count must be an integer, got {jnp.result_type(count)}')
  return lowp


def one_minus(b) -> jax.typing.ArrayLike:
  # For Python floats, 1 - b is taken in double precision and rounded once,
  # as optax's `(1 - decay) * g` does with a Python float decay.
  value = _concrete(b)
  if value is not None and not isinstance(b, jax.Array):
    return 1.0 - value
  return 1 - jnp.asarray(b, jnp.float32)


def pack_scalars(
  *, learning_rate, b1, b2, eps, eps_root, weight_decay, grad_scale
) -> jax.Array:
  """Packs the per-step scalars into the f32[9] buffer the handler reads."""
  values = {
    'learning_rate': learning_rate,
    'b1': b1,
    'one_minus_b1': one_minus(b1),
    'b2': b2,
    'one_minus_b2': one_minus(b2),
    'eps': eps,
    'eps_root': eps_root,
    'weight_decay': weight_decay,
    'grad_scale': grad_scale,
  }
  return jnp.stack(
    [jnp.asarray(values[name], jnp.float32) for name in SCALAR_NAMES]
  )
