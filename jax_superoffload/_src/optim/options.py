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
from jax_superoffload._src.optim import placement
from jax_superoffload._src.optim.offload import KERNEL_MOMENT_DTYPES
from jax_superoffload._src.optim.offload import Offload
from jax_superoffload._src.optim.offload import check_bucket_bytes
from jax_superoffload._src.parallel import zero as zero_lib

# The scalar arguments of adam / adamw (or schedules), checked alike.
_SCALARS = ('learning_rate', 'b1', 'b2', 'eps', 'eps_root', 'weight_decay')
# Options fields taken from `Offload` as they are.
_FROM_OFFLOAD = (
  'nu_dtype',
  'moments_8bit',
  'clip_norm',
  'skip_nonfinite',
  'device_buckets',
  'arrival_order',
  'cast',
  'hardware',
)


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
  def digests_weights(self) -> bool:
    """Whether the state keeps a digest of the weights (weights_digest.py).

    The "stream" executor's host step then reads the parameters only when
    they changed. Not under ZeRO, whose shards step inside `shard_map`.
    """
    return self.executor.name == 'stream' and self.zero is None

  @property
  def keeps_digest(self) -> bool:
    """Whether the state has a `weights_digest` leaf at all.

    As `digests_weights`, and also for a state split as its parameters are
    (`Follow`), which keeps one unused (it matches nothing): whether
    `init` saw the split or not, the state then has one layout, and
    `state_shardings` gives a trainer's jit the layout its `init` makes.
    """
    follows = isinstance(self.zero, zero_lib.Follow)
    return self.executor.name == 'stream' and (self.zero is None or follows)

  @property
  def use_kernel(self) -> bool:
    if self.mu_dtype is None or np.dtype(self.mu_dtype) == np.float32:
      return True
    return np.dtype(self.mu_dtype) in KERNEL_MOMENT_DTYPES

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

  def decide_placement(
    self, lay: layout.Layout, tree: Any
  ) -> placement.Placement:
    """The device buckets and casting side for `tree` ("auto": planned)."""
    return placement.decide(
      lay,
      tree,
      device_buckets=self.device_buckets,
      arrival_order=self.arrival_order,
      cast=self.cast,
      hardware=self.hardware,
    )

  def with_zero(self, zero: zero_lib.Zero | None) -> Options:
    """These options with the state split by `zero` (None: as they are)."""
    return self if zero is None else dataclasses.replace(self, zero=zero)


def _check_number(name: str, value: Any) -> None:
  """A scalar argument is a real number (or a schedule), not a string."""
  if value is None or callable(value):
    return
  dtype = getattr(value, 'dtype', None)
  if dtype is None and isinstance(value, (int, float, complex, np.number)):
    dtype = np.result_type(value)
  if dtype is None or not jnp.issubdtype(dtype, np.number):
    raise TypeError(
      f'{name} must be a number or an optax schedule, got '
      f'{type(value).__name__} {value!r}'
    )
  if jnp.issubdtype(dtype, np.complexfloating):
    raise TypeError(f'{name} must be a real number, got {value!r}')
  known = hyperparams.concrete(value)
  if name == 'weight_decay' and known is not None and known < 0:
    raise ValueError(f'weight_decay must be non-negative, got {known}')


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


def _check_moments(mu_dtype: Any, offload: Offload) -> None:
  """Low-precision moments: the formats the kernel stores."""
  nu_dtype, moments_8bit = offload.nu_dtype, offload.moments_8bit
  if moments_8bit and mu_dtype is not None:
    raise ValueError(
      'moments_8bit=True stores both moments in 8 bits: leave mu_dtype and '
      f'nu_dtype unset (got {mu_dtype!r}, {nu_dtype!r})'
    )
  mu, nu = moments.storage_dtypes(mu_dtype, nu_dtype, moments_8bit)
  if nu == jnp.bfloat16 and mu == np.float32:
    raise ValueError('nu_dtype=bfloat16 needs mu_dtype=bfloat16 as well')
  if nu_dtype is not None and mu not in KERNEL_MOMENT_DTYPES:
    raise ValueError(
      f"nu_dtype is a kernel option; mu_dtype={mu_dtype!r} takes optax's "
      "path, which keeps nu in the parameters' dtype"
    )


def build(
  learning_rate: optax.ScalarOrSchedule,
  b1: float,
  b2: float,
  eps: float,
  eps_root: float,
  mu_dtype: Any,
  weight_decay: optax.ScalarOrSchedule,
  mask: Any,
  nesterov: bool,
  offload: Offload,
) -> Options:
  """Validates the arguments of `adam` / `adamw` into `Options`."""
  values = (learning_rate, b1, b2, eps, eps_root, weight_decay)
  scalars = dict(zip(_SCALARS, values, strict=True))
  for name, value in scalars.items():  # Schedules are not checked.
    _check_number(name, value)
    hyperparams.check_scalar(name, value)
  _check_mu_dtype(mu_dtype)
  _check_moments(mu_dtype, offload)
  zero = zero_lib.from_mesh(offload.mesh, offload.shard_axis)
  if zero is not None and offload.moments_8bit:
    zero = dataclasses.replace(zero, block=moments.BLOCK)
  moment_dtypes = moments.storage_dtypes(
    mu_dtype, offload.nu_dtype, offload.moments_8bit
  )
  return Options(
    **scalars,
    mu_dtype=mu_dtype,
    mask=mask,
    nesterov=bool(nesterov),
    bucket_elements=max(1, check_bucket_bytes(offload.bucket_bytes) // 4),
    executor=executors.for_name(
      offload.executor,
      stv=offload.use_stv,
      fp32_moments=moment_dtypes == (np.float32, np.float32),
    ),
    zero=zero,
    **{name: getattr(offload, name) for name in _FROM_OFFLOAD},
  )
