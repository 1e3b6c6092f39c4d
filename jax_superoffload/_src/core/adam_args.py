"""Argument checks shared by the Adam step paths."""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from jax_superoffload._src.core.hyperparams import Hyperparams

# Gradient dtypes the kernel reads natively.
KERNEL_GRAD_DTYPES = (
  np.dtype(np.float32),
  np.dtype(jnp.bfloat16),
  np.dtype(np.float16),
)
# Dtypes of the optional low-precision copy of the new weights.
LOWP_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(np.float16))


def validate(
  master,
  grad,
  mu,
  nu,
  hyper: Hyperparams,
  *,
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
  hyper.check()
  return lowp
