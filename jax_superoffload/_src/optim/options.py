"""The options of `adam` / `adamw`, validated once into a frozen object."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_superoffload._src.core import hyperparams
from jax_superoffload._src.core import layout
from jax_superoffload._src.core import moments
from jax_superoffload._src.core.hyperparams import Hyperparams
from jax_superoffload._src.host import executors
from jax_superoffload._src.host import stv_executors
from jax_superoffload._src.optim import placement
from jax_superoffload._src.parallel import zero as zero_lib

DEFAULT_BUCKET_BYTES = 256 * 2**20
KERNEL_MU_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16))


@dataclasses.dataclass(frozen=True)
class Options:
  """Everything `adam` / `adamw` were built with, checked."""

  learning_rate: optax.ScalarOrSchedule
  b1: float
  b2: float
  eps: float
  eps_root: float
  mu_dtype: Any  # None or a dtype; the kernel stores fp32 or bf16.
  nu_dtype: Any  # None, float32 or bfloat16 (kernel leaves only).
  moments_8bit: bool  # 8-bit blockwise mu and nu (moments.py).
  weight_decay: optax.ScalarOrSchedule
  mask: Any  # optax-style mask of the decayed leaves.
  nesterov: bool
  bucket_elements: int  # fp32 elements per kernel call, about.
  executor: executors.Executor  # Of the host buckets, chosen once.
  clip_norm: Any  # None, a positive number or a scalar float array.
  skip_nonfinite: bool
  device_buckets: Any
  arrival_order: Any
  cast: str
  hardware: Any
  zero: zero_lib.Zero | None

  @property
  def use_stv(self) -> bool:
    return self.clip_norm is not None or self.skip_nonfinite

  @property
  def double_buffered(self) -> bool:
    """STV on the kernel double-buffers each host leaf (see stv.py)."""
    return self.executor.paired

  @property
  def use_kernel(self) -> bool:
    if self.mu_dtype is None or np.dtype(self.mu_dtype) == np.float32:
      return True
    return np.dtype(self.mu_dtype) in KERNEL_MU_DTYPES

  @property
  def moment_dtypes(self) -> tuple[np.dtype, np.dtype]:
    """The dtypes the kernel's leaves store mu and nu in."""
    return moments.storage_dtypes(
      self.mu_dtype, self.nu_dtype, self.moments_8bit
    )

  @property
  def no_decay(self) -> bool:
    wd = self.weight_decay
    return isinstance(wd, (int, float)) and wd == 0.0

  def hyperparams(self, count: Any, decay: bool = True) -> Hyperparams:
    """Step `count`'s hyperparameters (schedules evaluated at `count`)."""
    lr, wd = self.learning_rate, self.weight_decay
    return Hyperparams(
      count=count,
      learning_rate=lr(count) if callable(lr) else lr,
      b1=self.b1,
      b2=self.b2,
      eps=self.eps,
      eps_root=self.eps_root,
      weight_decay=(wd(count) if callable(wd) else wd) if decay else 0.0,
      nesterov=self.nesterov,
    )

  def layout(self, tree: Any) -> layout.Layout:
    n = len(jax.tree.leaves(tree))
    decay = (
      [False] * n if self.no_decay else layout.resolve_mask(self.mask, tree)
    )
    return layout.build_layout(
      tree,
      decay,
      bucket_elements=self.bucket_elements,
      use_kernel=self.use_kernel,
    )

  def device_bucket_ids(self, lay: layout.Layout, tree: Any) -> frozenset:
    return placement.device_bucket_ids(
      lay, self.device_buckets, self.arrival_order, tree, self.hardware
    )

  def cast_on_device(self, tree: Any) -> bool:
    return placement.resolve_cast(self.cast, tree, self.hardware)


def _check_clip_norm(clip_norm: Any) -> None:
  # A number, or a scalar array as optax.inject_hyperparams makes of one
  # (its value is checked unless traced: inject rebuilds us inside update).
  number = isinstance(clip_norm, (int, float)) and not isinstance(
    clip_norm, bool
  )
  # Integer arrays too: inject_hyperparams makes int32 of clip_norm=1.
  array = isinstance(clip_norm, (jax.Array, np.ndarray, np.generic)) and (
    np.ndim(clip_norm) == 0
    and (
      jnp.issubdtype(clip_norm.dtype, jnp.floating)
      or jnp.issubdtype(clip_norm.dtype, jnp.integer)
    )
  )
  if (number or array) and (
    isinstance(clip_norm, jax.core.Tracer) or clip_norm > 0
  ):
    return
  raise ValueError(
    f'clip_norm must be a positive number or a scalar real array, got '
    f'{clip_norm!r}'
  )


def _check_bucket_bytes(bucket_bytes: Any) -> int:
  if bucket_bytes is None:
    return DEFAULT_BUCKET_BYTES
  if (
    not isinstance(bucket_bytes, (int, np.integer))
    or isinstance(bucket_bytes, bool)
    or bucket_bytes < 4
  ):
    raise ValueError(
      f'bucket_bytes must be an integer >= 4, got {bucket_bytes!r}'
    )
  return int(bucket_bytes)


def _check_mu_dtype(mu_dtype: Any) -> None:
  if mu_dtype is None:
    return
  # As optax: complex moments too (they take optax's path, see use_kernel).
  bad = f'mu_dtype must be a floating or complex dtype, got {mu_dtype!r}'
  try:
    dtype = jnp.dtype(mu_dtype)
  except TypeError as e:
    raise ValueError(bad) from e
  if not jnp.issubdtype(dtype, jnp.inexact):
    raise ValueError(bad)


def _check_moments(mu_dtype: Any, nu_dtype: Any, moments_8bit: bool) -> None:
  """Low-precision moments: the formats the kernel stores."""
  if nu_dtype is not None and np.dtype(nu_dtype) not in KERNEL_MU_DTYPES:
    raise ValueError(f'nu_dtype must be float32 or bfloat16, got {nu_dtype!r}')
  if moments_8bit and (mu_dtype is not None or nu_dtype is not None):
    raise ValueError(
      'moments_8bit=True stores both moments in 8 bits: leave mu_dtype and '
      f'nu_dtype unset (got {mu_dtype!r}, {nu_dtype!r})'
    )
  mu, nu = moments.storage_dtypes(mu_dtype, nu_dtype, moments_8bit)
  if nu == jnp.bfloat16 and mu == np.float32:
    raise ValueError('nu_dtype=bfloat16 needs mu_dtype=bfloat16 as well')
  if nu_dtype is not None and mu not in KERNEL_MU_DTYPES:
    raise ValueError(
      f"nu_dtype is a kernel option; mu_dtype={mu_dtype!r} takes optax's "
      "path, which keeps nu in the parameters' dtype"
    )


def make(
  *,
  learning_rate: optax.ScalarOrSchedule,
  b1: float,
  b2: float,
  eps: float,
  eps_root: float,
  mu_dtype: Any,
  weight_decay: optax.ScalarOrSchedule,
  mask: Any,
  nesterov: bool,
  bucket_bytes: int | None,
  executor: str,
  nu_dtype: Any = None,
  moments_8bit: bool = False,
  clip_norm: Any = None,
  skip_nonfinite: bool = False,
  device_buckets: Any = None,
  arrival_order: Any = None,
  cast: str = 'host',
  hardware: Any = None,
  mesh: Any = None,
  shard_axis: Any = None,
) -> Options:
  """Validates the arguments of `adam` / `adamw` into `Options`."""
  zero = zero_lib.make(mesh, shard_axis)
  placement.check_device_buckets(device_buckets)
  if cast not in placement.CASTS:
    raise ValueError(f'cast must be one of {placement.CASTS}, got {cast!r}')
  if clip_norm is not None:
    _check_clip_norm(clip_norm)
  scalars = dict(
    learning_rate=learning_rate,
    b1=b1,
    b2=b2,
    eps=eps,
    eps_root=eps_root,
    weight_decay=weight_decay,
  )
  for name, value in scalars.items():  # Schedules are not checked.
    hyperparams.check_scalar(name, value)
  bucket_bytes = _check_bucket_bytes(bucket_bytes)
  _check_mu_dtype(mu_dtype)
  _check_moments(mu_dtype, nu_dtype, bool(moments_8bit))
  if zero is not None and moments_8bit:
    zero = dataclasses.replace(zero, block=moments.BLOCK)
  return Options(
    learning_rate=learning_rate,
    b1=b1,
    b2=b2,
    eps=eps,
    eps_root=eps_root,
    mu_dtype=mu_dtype,
    nu_dtype=nu_dtype,
    moments_8bit=bool(moments_8bit),
    weight_decay=weight_decay,
    mask=mask,
    nesterov=bool(nesterov),
    bucket_elements=max(1, bucket_bytes // 4),
    executor=stv_executors.for_name(
      executor,
      stv=clip_norm is not None or bool(skip_nonfinite),
      fp32_moments=moments.storage_dtypes(mu_dtype, nu_dtype, moments_8bit)
      == (np.float32, np.float32),
    ),
    clip_norm=clip_norm,
    skip_nonfinite=bool(skip_nonfinite),
    device_buckets=device_buckets,
    arrival_order=arrival_order,
    cast=cast,
    hardware=hardware,
    zero=zero,
  )
